"""``scripts/cuda_graphs.py`` on the CPU: it times the eager UNet forward and leaves the graph
fields empty (capture needs CUDA), writes its report, and refuses what it cannot probe."""

from __future__ import annotations

import json

import pytest

from tests.factories import load_script


def _script():
    return load_script("cuda_graphs.py")


@pytest.mark.parametrize("model", ["tiny-sd2-inpaint", "tiny-sdxl-inpaint"])
def test_it_times_the_eager_forward_of_each_unet_family(model, models_dir, tmp_path):
    out = tmp_path / "graphs.json"
    argv = [
        "--model", model, "--size", "64", "--rows", "2,4", "--repeats", "2", "--device", "cpu",
        "--dtype", "float32", "--models-dir", str(models_dir), "--json", str(out),
    ]  # fmt: skip
    assert _script().main(argv) == 0
    report = json.loads(out.read_text())
    assert report["model"] == model and report["device"] == "cpu"
    assert [r["rows"] for r in report["records"]] == [2, 4]
    for record in report["records"]:
        assert record["eager_ms"] > 0
        assert record["graph_ms"] is None and record["speedup"] is None


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--model", "tiny-flux-fill"], "UNet models only"),
        (["--model", "tiny-sd2-inpaint", "--rows", "2,x"], "--rows: positive counts"),
        (["--model", "tiny-sd2-inpaint", "--rows", "0"], "--rows: positive counts"),
    ],
)
def test_it_refuses_what_it_cannot_probe(argv, says, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        _script().main([*argv, "--device", "cpu", "--models-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err

"""`maskserve bench engine` and `maskserve bench exactness` on a tiny model (CPU): the records say
what was measured, and the exactness checks hold at float32."""

from __future__ import annotations

import json

import pytest
import torch

from backend.bench.engine_bench import run_engine_bench, write_outputs
from backend.bench.exactness import (
    FLOAT32_TOLERANCE,
    LOW_PRECISION_FACTOR,
    run_exactness,
    write_records,
)
from backend.cli import main


def test_engine_bench_measures_both_modes_against_the_ordinary_pipeline(models_dir, tmp_path):
    records = run_engine_bench(
        "tiny-sd2-inpaint",
        [0.2],
        steps=2,
        models_dir=models_dir,
        cache_dir=tmp_path,
        resolution=128,
    )
    assert [(r.mode, r.mask_ratio) for r in records] == [("kv", 0.2), ("hidden", 0.2)]
    for r in records:
        assert r.device == "cpu" and r.dtype == "float32" and r.device_name.endswith("cpu")
        assert 0.1 < r.measured_mask_ratio < 0.35
        assert r.speedup == pytest.approx(r.ordinary_s / r.maskaware_s)
        assert r.ideal_speedup > 1 and r.cache_bytes > 0
        assert r.ordinary_peak_gpu_bytes == r.maskaware_peak_gpu_bytes == 0  # no GPU here
    plot = write_outputs(records, tmp_path / "engine.json")
    assert plot.stat().st_size > 0
    assert len(json.loads((tmp_path / "engine.json").read_text())) == 2


def test_exactness_checks_hold_at_float32_on_the_cpu(models_dir, tmp_path):
    records = run_exactness(models_dir, tmp_path, families=("sd2-inpaint",))
    checks = {(r.check, r.mode) for r in records}
    assert ("exact-replay", "hidden") in checks and ("mixed-batch row 1", "kv") in checks
    assert len(checks) == len(records) == 9
    assert all(r.floor == 0 and r.tolerance == FLOAT32_TOLERANCE for r in records)
    assert all(r.within_tolerance and r.reference_max_abs > 1 for r in records)
    write_records(records, tmp_path / "exactness.json")
    saved = json.loads((tmp_path / "exactness.json").read_text())
    assert saved["tolerance"]["float32"] == FLOAT32_TOLERANCE
    assert all(r["within_tolerance"] for r in saved["records"])


def test_bfloat16_stays_within_what_bfloat16_does_to_the_ordinary_pipeline(models_dir, tmp_path):
    """bfloat16 moves the ordinary pipeline itself (the floor); the mask-aware edit may differ
    from it by at most LOW_PRECISION_FACTOR floors (at most a tenth of the latents' scale), and
    by more than float32's bound somewhere."""
    records = run_exactness(models_dir, tmp_path, dtype=torch.bfloat16, families=("sdxl-inpaint",))
    for r in records:
        assert r.floor > 0.01
        assert r.tolerance == min(LOW_PRECISION_FACTOR * r.floor, 0.1 * r.reference_max_abs)
    assert all(r.within_tolerance for r in records), [r for r in records if not r.within_tolerance]
    assert max(r.max_abs_diff for r in records) > FLOAT32_TOLERANCE


def test_exactness_refuses_an_unknown_dtype(tmp_path, capsys):
    assert main(["bench", "exactness", "--dtypes", "float8", "--json", str(tmp_path / "x")]) == 2
    assert "--dtypes: 'float8' is none of float32, bfloat16" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_profile_in_memory_writes_the_profile_and_no_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MASKSERVE_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "profiles"
    argv = ["profile", "--model", "tiny-sd2-inpaint", "--size", "128", "--modes", "kv"]
    assert main([*argv, "--repeats", "1", "--in-memory", "--out-dir", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["tiny-sd2-inpaint__cpu__kv.json"]
    assert not (tmp_path / "data" / "models").exists()  # built in memory, never saved
    assert "compute R^2" in capsys.readouterr().out

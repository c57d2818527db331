"""`maskserve bench step-launches` on tiny-sd2 (CPU): every form at every batch size, the bucketed
mask-aware step under the dense one, JSON and PNG written, bad arguments refused."""

from __future__ import annotations

import json

import pytest

from backend.bench.step_launches import FORMS, run_step_launches, summary_lines, write_step_launches
from backend.cli import main

pytestmark = pytest.mark.model


def test_step_launches_counts_every_form_at_every_batch_size(models_dir, tmp_path):
    records = run_step_launches("tiny-sd2-inpaint", [1, 2], models_dir, tmp_path / "cache", size=64)
    assert [(r.requests, r.form) for r in records] == [(n, f) for n in (1, 2) for f in FORMS]
    for count in (1, 2):
        launched = {r.form: r.launched for r in records if r.requests == count}
        assert launched["bucketed"] <= launched["dense"] < launched["exact"]
    plot = write_step_launches(records, tmp_path / "launches.json")
    assert plot.exists() and len(json.loads((tmp_path / "launches.json").read_text())) == 6
    assert summary_lines(records)[0].startswith("tiny-sd2-inpaint x1: dense ")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--requests", "0,2"], "--requests: positive counts"),
        (["--models", ","], "--models: one or more model ids"),
    ],
)
def test_step_launches_refuses_bad_arguments(flags, message, tmp_path, capsys):
    argv = ["bench", "step-launches", *flags, "--json", str(tmp_path / "x.json")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()

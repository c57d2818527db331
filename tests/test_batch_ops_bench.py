"""`maskserve bench batch-ops` on the tiny SD2 model (CPU): both forms of the compared setting at
each batch size: padded attention, and stacked adapter deltas, dispatching fewer operators once
requests differ."""

from __future__ import annotations

import json

import pytest

from backend.bench.batch_ops import run_batch_ops, summary_lines, write_batch_ops
from backend.cli import main


def test_batch_ops_counts_each_form_at_each_batch_size(models_dir, tmp_path):
    records = run_batch_ops(
        "tiny-sd2-inpaint", [1, 3], models_dir, tmp_path / "cache", size=128, repeats=1
    )
    assert [(r.requests, r.form) for r in records] == [
        (1, "grouped"),
        (1, "padded"),
        (3, "grouped"),
        (3, "padded"),
    ]
    one, three = {r.form: r for r in records[:2]}, {r.form: r for r in records[2:]}
    assert three["grouped"].rows == 6 and one["padded"].rows == 2
    # one request is one group: the same call either way
    assert one["grouped"].operators == one["padded"].operators > 0
    assert three["padded"].operators < three["grouped"].operators
    assert all(r.step_s > 0 and r.device == "cpu" for r in records)
    plot = write_batch_ops(records, tmp_path / "ops.json")
    assert plot.stat().st_size > 0 and len(json.loads((tmp_path / "ops.json").read_text())) == 4
    assert len(summary_lines(records)) == 2 and "3 requests (6 rows)" in summary_lines(records)[1]


def test_batch_ops_compares_the_adapter_forms(models_dir, tmp_path):
    records = run_batch_ops(
        "tiny-sd2-inpaint",
        [1, 3],
        models_dir,
        tmp_path / "cache",
        size=128,
        steps=4,
        repeats=1,
        compare="lora",
    )
    assert [(r.requests, r.form, r.compare, r.adapters) for r in records] == [
        (1, "grouped", "lora", 2),
        (1, "stacked", "lora", 2),
        (3, "grouped", "lora", 2),
        (3, "stacked", "lora", 2),
    ]
    one, three = {r.form: r for r in records[:2]}, {r.form: r for r in records[2:]}
    # two adapters on one request: grouped runs each adapter's delta apart
    assert one["stacked"].operators < one["grouped"].operators
    # six adapters on three requests: stacked still three operators a layer
    assert three["grouped"].operators - one["grouped"].operators > 2 * (
        three["stacked"].operators - one["stacked"].operators
    )
    assert all(r.attention == "grouped" for r in records)  # auto on the CPU
    write_batch_ops(records, tmp_path / "lora.json")
    assert "stacked" in summary_lines(records)[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--requests", "0,2"], "--requests: positive counts"),
        (["--steps", "4", "--repeats", "5"], "--steps 4 is too few to time 5 steps"),
        (["--compare", "lora", "--adapters", "0"], "--compare lora needs --adapters 1 or more"),
    ],
)
def test_batch_ops_refuses_bad_arguments(flags, message, tmp_path, capsys):
    argv = ["bench", "batch-ops", *flags, "--json", str(tmp_path / "x.json")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()

"""`maskserve bench step-trace` (CPU): the dense and the cached step side by side at each batch
size, the device timeline's arithmetic (intervals, kernels against copies) on event records, and
bad arguments refused before any model loads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from backend.bench.step_trace import (
    device_times,
    overlap_s,
    run_step_trace,
    summary_lines,
    union_s,
    write_step_trace,
)
from backend.cli import main

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(name, start_us, end_us, device=CUDA, **extra):
    return SimpleNamespace(
        name=name,
        device_type=device,
        time_range=SimpleNamespace(start=start_us, end=end_us),
        **extra,
    )


def test_union_counts_overlapping_intervals_once():
    assert union_s([]) == 0.0
    assert union_s([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union_s([(0.0, 4.0), (1.0, 2.0)]) == pytest.approx(4.0)  # one inside another
    assert overlap_s([(0.0, 2.0)], [(1.0, 3.0), (5.0, 6.0)]) == pytest.approx(1.0)
    assert overlap_s([(0.0, 1.0)], [(2.0, 3.0)]) == 0.0


def test_device_times_split_kernels_from_host_to_device_copies():
    events = [
        event("aten::addmm", 0, 10_000, CPU),  # host work: not the device's
        event("cudaLaunchKernel", 0, 5, CPU),
        event("ampere_sgemm_128x64", 1_000, 3_000),
        event("elementwise_kernel", 2_000, 4_000),  # overlaps the first: 3 ms of compute in all
        event("Memcpy HtoD (Pinned -> Device)", 3_500, 6_000),  # 0.5 ms under compute
        event("Memcpy DtoD (Device -> Device)", 7_000, 8_000),  # not a load
        event("Memset (Device)", 8_000, 8_500),
        event("Context Sync", 8_500, 9_500),  # the device waiting: not compute
    ]
    times = device_times(events, wall_s=0.010)
    assert times["kernels"] == 2
    assert times["compute_s"] == pytest.approx(0.003)
    assert times["copy_s"] == pytest.approx(0.0025)
    assert times["copy_hidden_s"] == pytest.approx(0.0005)
    assert times["busy_s"] == pytest.approx(0.005)
    assert times["idle_share"] == pytest.approx(0.5)
    # where the profiler names each event's activity, that decides (a sync is not a kernel)
    typed = [
        event("some_kernel", 0, 2_000, activity_type="kernel"),
        event("Stream Wait Event", 2_000, 9_000, activity_type="cuda_sync"),
        event("Memcpy HtoD (Pinned -> Device)", 1_000, 4_000, activity_type="gpu_memcpy"),
    ]
    typed_times = device_times(typed, wall_s=0.010)
    assert typed_times["kernels"] == 1 and typed_times["compute_s"] == pytest.approx(0.002)
    assert typed_times["busy_s"] == pytest.approx(0.004)
    assert typed_times["copy_hidden_s"] == pytest.approx(0.001)
    # a CPU run: no device events, every device field 0
    assert all(value == 0 for value in device_times(events[:2], wall_s=0.01).values())


def test_step_trace_runs_both_arms_at_each_batch_size(models_dir, tmp_path):
    records = run_step_trace(
        "tiny-sd2-inpaint",
        [1, 2],
        models_dir,
        tmp_path / "cache",
        size=64,
        steps=4,
        repeats=2,
        trace_dir=tmp_path / "traces",
    )
    assert [(r.requests, r.arm, r.rows) for r in records] == [
        (1, "dense", 2),
        (1, "cached", 2),
        (2, "dense", 4),
        (2, "cached", 4),
    ]
    assert all(r.step_s > 0 and r.operators > 0 and r.device == "cpu" for r in records)
    assert all(r.kernels == 0 and r.busy_s == 0.0 for r in records)  # no device on a CPU
    assert {r.attention for r in records} == {"grouped"}  # auto, on a CPU
    # the dense step is the model's own forward: the cached one gathers and merges the cache
    dense, cached = records[0], records[1]
    assert dense.operators != cached.operators
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert traces == [
        "tiny-sd2-inpaint-1-cached.json",
        "tiny-sd2-inpaint-1-dense.json",
        "tiny-sd2-inpaint-2-cached.json",
        "tiny-sd2-inpaint-2-dense.json",
    ]
    assert "traceEvents" in json.loads((tmp_path / "traces" / traces[0]).read_text())
    plot = write_step_trace(records, tmp_path / "trace.json")
    assert plot.stat().st_size > 0 and len(json.loads((tmp_path / "trace.json").read_text())) == 4
    lines = summary_lines(records)
    assert len(lines) == 2 and "2 requests: step dense" in lines[1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--requests", "0,2"], "--requests: positive counts"),
        (["--requests", "1,x"], "--requests: positive counts separated by commas"),
        (["--steps", "4", "--repeats", "5"], "--steps 4 is too few to time 5 steps"),
    ],
)
def test_step_trace_refuses_bad_arguments(flags, message, tmp_path, capsys):
    argv = ["bench", "step-trace", *flags, "--json", str(tmp_path / "x.json")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_step_trace_refuses_an_unknown_attention_form(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "step-trace", "--attention", "sparse", "--json", str(tmp_path / "x.json")])
    assert exited.value.code == 2 and "invalid choice: 'sparse'" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()

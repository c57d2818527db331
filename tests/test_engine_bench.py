"""`maskserve bench engine`, `bench launch-proxy` and `bench exactness` on tiny models (CPU): the
records say what was measured, the arms run side by side, and the exactness checks hold at
float32."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch

from backend.bench.engine_arms import ARMS
from backend.bench.engine_bench import run_engine_bench, write_outputs
from backend.bench.exactness import (
    FLOAT32_TOLERANCE,
    LOW_PRECISION_FACTOR,
    run_exactness,
    write_records,
)
from backend.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_engine_bench_times_the_arms_side_by_side_per_batch(models_dir, tmp_path):
    report = run_engine_bench(
        "tiny-sd2-inpaint",
        [0.2],
        steps=2,
        models_dir=models_dir,
        cache_dir=tmp_path,
        resolution=128,
        arms=("ordinary", "maskaware", "maskaware-device", "ordinary-fresh-process"),
        batches=(1, 2),
        partial_json=tmp_path / "engine.partial.json",
    )
    cells = [(r.arm, r.mode, r.batch) for r in report.records]
    assert sorted(cells) == sorted(
        (arm, mode, batch)
        for batch in (1, 2)
        for arm, mode in (
            ("ordinary", "dense"),
            ("maskaware", "kv"),
            ("maskaware", "hidden"),
            ("maskaware-device", "kv"),
            ("maskaware-device", "hidden"),
            ("ordinary-fresh-process", "dense"),
        )
    )
    by_cell = {(r.arm, r.mode, r.batch): r for r in report.records}
    for r in report.records:
        assert r.device == "cpu" and r.dtype == "float32" and r.device_name.endswith("cpu")
        assert 0.1 < r.measured_mask_ratio < 0.35
        assert r.edits_per_s == pytest.approx(r.batch / r.edit_s) and r.step_s > 0
        ordinary = by_cell["ordinary", "dense", r.batch]
        assert r.speedup == pytest.approx(ordinary.edit_s / r.edit_s)
        assert r.speedup_vs_compiled is None  # that arm did not run
        assert r.peak_gpu_bytes == 0  # no GPU here
    for mode in ("kv", "hidden"):
        r = by_cell["maskaware", mode, 1]
        assert r.ideal_speedup > 1 and r.cache_bytes > 0 and r.ssim > 0.5
        # the same edit, its cache read from the device tier: the same pixels
        device = by_cell["maskaware-device", mode, 1]
        assert device.ssim == r.ssim and device.cache_bytes == r.cache_bytes
    runs = {arm: report.arms[arm] for arm in ("maskaware", "maskaware-device")}
    assert {arm: (meta["cache_tier"], meta["step_shapes"]) for arm, meta in runs.items()} == {
        "maskaware": ("host", "exact"),
        "maskaware-device": ("device", "exact"),
    }
    assert by_cell["ordinary", "dense", 1].ssim is None  # the reference itself
    # the plain pipeline in its own process: the same pixels, nothing of MaskServe imported
    assert by_cell["ordinary-fresh-process", "dense", 2].ssim > 0.99
    assert report.arms["ordinary-fresh-process"]["maskserve_modules"] == []
    assert set(report.arms["maskaware"]["warmup_s"]) == {"1", "2"}
    assert len(json.loads((tmp_path / "engine.partial.json").read_text())["records"]) == 12
    plot = write_outputs(report, tmp_path / "engine.json")
    assert plot.stat().st_size > 0
    saved = json.loads((tmp_path / "engine.json").read_text())
    assert len(saved["records"]) == 12 and set(saved["arms"]) == {r.arm for r in report.records}


@pytest.mark.slow
def test_every_arm_runs_and_the_compiled_one_matches_eager(
    models_dir, tmp_path, monkeypatch, capsys
):
    """The whole arm table on tiny-sd2 at 64 px, 2 steps, through the CLI (torch.compile of the
    ordinary denoiser and of the mask-aware units: ~90 s on a 2-core CPU)."""
    monkeypatch.setenv("MASKSERVE_MODELS_DIR", str(models_dir))
    monkeypatch.setenv("MASKSERVE_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "engine.json"
    argv = ["bench", "engine", "--model", "tiny-sd2-inpaint", "--size", "64", "--steps", "2"]
    argv += ["--mask-ratios", "0.2", "--modes", "kv", "--arms", ",".join(ARMS), "--json", str(out)]
    assert main(argv) == 0
    saved = json.loads(out.read_text())
    assert {r["arm"] for r in saved["records"]} == set(saved["arms"]) == set(ARMS)
    assert all(r["speedup"] and r["speedup_vs_compiled"] for r in saved["records"])
    compiled = saved["arms"]["ordinary-compiled"]
    assert compiled["compile_mode"] == "default" and compiled["compile_check"]["within_tolerance"]
    assert compiled["warmup_s"]["1"] > 0
    # the compiled mask-aware step against the eager one, its bound recorded; compiling is in its
    # build (the check's first step) and warm-up, never in the timed calls
    units = saved["arms"]["maskaware-compiled"]
    assert units["compile_steps"] == "default" and units["step_shapes"] == "bucketed"
    assert units["cache_tier"] == saved["arms"]["maskaware-device"]["cache_tier"] == "device"
    check = units["compile_check"]
    assert check["compared"] == "first step's update" and check["within_tolerance"]
    assert 0 < check["tolerance"] <= 1e-4 * check["reference_max_abs"]
    assert units["build_s"] > 1 and units["warmup_s"]["1"] > 0
    ratios = {r["arm"]: (r["speedup"], r["speedup_vs_compiled"]) for r in saved["records"]}
    edit_s = {r["arm"]: r["edit_s"] for r in saved["records"]}
    for arm in ("maskaware-device", "maskaware-compiled"):
        assert ratios[arm] == pytest.approx(
            (edit_s["ordinary"] / edit_s[arm], edit_s["ordinary-compiled"] / edit_s[arm])
        )
    assert (
        out.with_suffix(".png").stat().st_size > 0 and not out.with_suffix(".partial.json").exists()
    )
    assert "vs compiled" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--arms", "ordinary,eager-ish"], "--arms: eager-ish is not an arm"),
        (["--batch", "1,0"], "--batch: positive counts"),
        (["--fresh-process-baseline", "--in-memory"], "--fresh-process-baseline"),
    ],
)
def test_engine_bench_refuses_bad_flags_by_name(flags, named, tmp_path, capsys):
    argv = ["bench", "engine", "--model", "tiny-sd2-inpaint", "--json", str(tmp_path / "x.json")]
    assert main([*argv, *flags]) == 2
    assert named in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before any work


def test_the_plain_pipeline_script_imports_nothing_of_maskserve():
    tree = ast.parse((ROOT / "scripts" / "plain_pipeline.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    third_party = {name.split(".")[0] for name in imported} - set(sys.stdlib_module_names)
    assert third_party == {"torch", "diffusers", "PIL"}


@pytest.mark.slow
def test_launch_proxy_counts_and_times_the_forward_eager_and_compiled(
    models_dir, tmp_path, monkeypatch, capsys
):
    """One model (torch.compile of the ordinary forward and the mask-aware step: ~70 s on a
    2-core CPU)."""
    monkeypatch.setenv("MASKSERVE_MODELS_DIR", str(models_dir))
    monkeypatch.setenv("MASKSERVE_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "proxy.json"
    argv = ["bench", "launch-proxy", "--models", "tiny-sd2-inpaint", "--repeats", "3"]
    assert main([*argv, "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["rows"] == 2 and record["requests"] == 1 and record["size"] == 64
    assert record["compiled_operators"] < record["eager_operators"] / 2
    assert record["max_abs_difference"] < 1e-4 * record["reference_max_abs"]
    assert record["maskaware_operators"] > 0 and 0.1 < record["measured_mask_ratio"] < 0.4
    # the compiled mask-aware step: fewer launches than either eager step, the same update
    assert record["compiled_step_operators"] < record["bucketed_operators"]
    assert record["bucketed_operators"] < record["maskaware_operators"]
    assert (
        record["compiled_step_max_abs_difference"]
        < 1e-4 * record["compiled_step_reference_max_abs"]
    )
    assert record["compiled_step_compile_s"] > 0
    assert record["compiled_step_vs_eager"] == pytest.approx(
        record["maskaware_step_ms"] / record["compiled_step_ms"]
    )
    assert record["compiled_step_vs_dense"] == pytest.approx(
        record["compiled_ms"] / record["compiled_step_ms"]
    )
    assert out.with_suffix(".png").stat().st_size > 0
    assert "compiled in" in capsys.readouterr().out


def test_launch_proxy_refuses_rows_a_model_cannot_split(tmp_path, capsys):
    argv = ["bench", "launch-proxy", "--models", "tiny-sd2-inpaint", "--rows", "3"]
    assert main([*argv, "--json", str(tmp_path / "x.json")]) == 2
    assert "--rows: tiny-sd2-inpaint takes 2 rows a request, got 3" in capsys.readouterr().err


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

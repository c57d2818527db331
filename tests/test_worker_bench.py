"""`maskserve bench worker` end to end at a toy scale: every mode serves the whole trace through a
separate CPU process, and the report holds what the issue asks for (not a timing test)."""

from __future__ import annotations

import json

from backend.bench.trace import poisson_trace
from backend.bench.worker_bench import BenchConfig, run_worker_bench, write_outputs
from backend.config import load_settings


def test_the_worker_bench_serves_the_trace_in_every_mode_and_writes_its_report(
    models_dir, tmp_path
):
    cfg = BenchConfig(
        rps=4.0, duration_s=1.5, num_templates=3, ram_templates=1, steps=2, size=128, max_batch=4
    )
    settings = load_settings(
        env={}, paths={"data_dir": str(tmp_path), "models_dir": str(models_dir)}
    )
    # a large entry of another model in the same directory
    foreign = tmp_path / "template_cache" / ("f" * 32)
    foreign.mkdir(parents=True)
    (foreign / "manifest.json").write_text("{}")
    with open(foreign / "step_0000.safetensors", "wb") as sparse:
        sparse.truncate(1 << 30)  # 1 GiB apparent size, no disk blocks
    results = run_worker_bench(cfg, settings)
    expected_jobs = len(
        poisson_trace(cfg.rps, cfg.duration_s, cfg.num_templates, cfg.mask_mean, seed=cfg.seed)
    )
    assert [r.label for r in results] == [
        "continuous",
        "static",
        "inline",
        "continuous, all templates in RAM",
    ]
    for r in results:
        assert r.num_jobs == expected_jobs > 0
        assert 0 < r.p50_latency_s <= r.p95_latency_s and r.throughput_rps > 0
        assert (
            r.mean_step_s > 0 and r.mean_batch_rows >= 1 and 0.0 <= r.cache["ram_hit_rate"] <= 1.0
        )
    # RAM holds one template of three: the rest come from disk
    assert results[0].cache["bytes_loaded"] > 0
    # The budget counts the trace's own entries, so the one-template run evicts and the all-in-RAM
    # run does not.
    assert results[0].cache["ram_evictions"] > 0 and results[-1].cache["ram_evictions"] == 0
    plot = write_outputs(cfg, results, tmp_path / "bench.json")
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["config"]["rps"] == 4.0 and len(report["results"]) == 4
    assert plot.exists() and plot.stat().st_size > 0

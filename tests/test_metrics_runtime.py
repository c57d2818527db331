"""Prometheus export of stats snapshots, and the JSON log format every process uses."""

from __future__ import annotations

import json
import logging

from prometheus_client import generate_latest

from backend.metrics import make_registry
from backend.runtime import JsonFormatter
from backend.worker.stats import WorkerStats


def test_snapshot_becomes_prometheus_metrics():
    stats = WorkerStats()
    stats.record_step(3, 0.010, 0.009)
    stats.record_job("denoised")
    text = generate_latest(make_registry({"maskserve_worker": stats.snapshot})).decode()
    assert "maskserve_worker_steps 1.0" in text
    assert 'maskserve_worker_jobs{key="denoised"} 1.0' in text
    assert "maskserve_worker_max_batch_rows 3.0" in text


def test_counters_and_overhead():
    stats = WorkerStats(window=2)
    for forward in (0.5, 0.6, 0.7):
        stats.record_step(2, forward + 0.001, forward)
    snap = stats.snapshot()
    assert snap["steps"] == 3 and abs(snap["mean_overhead_s"] - 0.001) < 1e-9
    assert len(stats.recent_overhead_s) == 2  # bounded window


def test_json_log_lines():
    record = logging.LogRecord(
        "maskserve.worker", logging.WARNING, __file__, 1, "cache %s lost", ("abc",), None
    )
    entry = json.loads(JsonFormatter("worker").format(record))
    assert (
        entry["msg"] == "cache abc lost"
        and entry["role"] == "worker"
        and entry["level"] == "WARNING"
    )

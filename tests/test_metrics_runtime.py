"""Prometheus export of stats snapshots (counters typed as counters), the job latency histogram
(observed once per job where its terminal status is written), the metrics endpoints' address, and
the JSON log format every process uses."""

from __future__ import annotations

import io
import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import CollectorRegistry, generate_latest

from backend.api.app import create_app
from backend.cache import CacheMetrics
from backend.config import load_settings
from backend.jobstate import JobStateStore
from backend.metrics import (
    JOB_LATENCY_BUCKETS,
    JobLatencyCollector,
    make_registry,
    serve_metrics,
)
from backend.protocol import JobEvent
from backend.runtime import JsonFormatter
from backend.services.redis_server import free_port
from backend.services.stack import Stack
from backend.worker.stats import WorkerStats


def test_snapshot_becomes_prometheus_metrics():
    stats = WorkerStats()
    stats.record_step(3, 0.010, 0.009)
    stats.record_job("denoised")
    text = generate_latest(
        make_registry(
            {"maskserve_worker": stats.snapshot},
            counters={"maskserve_worker": WorkerStats.COUNTERS},
        )
    ).decode()
    assert "maskserve_worker_steps_total 1.0" in text
    assert 'maskserve_worker_jobs_total{key="denoised"} 1.0' in text
    assert "maskserve_worker_max_batch_rows 3.0" in text


def test_counters_and_overhead():
    stats = WorkerStats(window=2)
    for forward in (0.5, 0.6, 0.7):
        stats.record_step(2, forward + 0.001, forward)
    snap = stats.snapshot()
    assert snap["steps"] == 3 and abs(snap["mean_overhead_s"] - 0.001) < 1e-9
    assert len(stats.recent_overhead_s) == 2  # bounded window


def test_mean_step_by_batch_size():
    stats = WorkerStats()
    steps = [(2, 0.4), (1, 0.2), (2, 0.5), (4, 0.9), (1, 0.3)]
    for rows, seconds in steps:
        stats.record_step(rows, seconds, seconds)
    by_rows = stats.mean_step_s_by_rows()
    assert list(by_rows) == sorted({rows for rows, _ in steps})
    for size, mean in by_rows.items():
        own = [seconds for rows, seconds in steps if rows == size]
        assert mean == pytest.approx(sum(own) / len(own))
    assert WorkerStats().mean_step_s_by_rows() == {}


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


def _types(text: str) -> dict[str, str]:
    """metric family -> its ``# TYPE`` (a counter's family named without ``_total``, as
    exposition formats differ on whether ``# TYPE`` names it with the suffix)."""
    found = re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M)
    return {
        name.removesuffix("_total") if kind == "counter" else name: kind for name, kind in found
    }


def test_the_worker_and_cache_counts_that_only_grow_are_prometheus_counters():
    """What ``run_worker`` registers: every count of the worker and its cache is a counter
    (``rate()`` works on it), the means, percentiles, rates and current values are gauges."""
    stats, cache = WorkerStats(), CacheMetrics(ram_hits=3, bytes_loaded=10)
    stats.record_step(2, 0.01, 0.009)
    stats.record_job("done")
    stats.record_held(1)
    stats.record_deferred(2)
    registry = make_registry(
        {"maskserve_worker": stats.snapshot, "maskserve_cache": cache.snapshot},
        counters={
            "maskserve_worker": WorkerStats.COUNTERS,
            "maskserve_cache": CacheMetrics.COUNTERS,
        },
    )
    text = generate_latest(registry).decode()
    types = _types(text)
    for name in (
        "maskserve_worker_steps",
        "maskserve_worker_jobs",
        "maskserve_worker_cache_fallbacks",
        "maskserve_worker_held_row_schedules",
        "maskserve_worker_deferred_row_schedules",
        "maskserve_cache_ram_hits",
        "maskserve_cache_ram_misses",
        "maskserve_cache_bytes_loaded",
        "maskserve_cache_disk_evictions",
        "maskserve_cache_prefetch_uses",
        "maskserve_cache_device_hits",
        "maskserve_cache_device_misses",
        "maskserve_cache_bytes_promoted",
        "maskserve_cache_device_evictions",
    ):
        assert types[name] == "counter", name
    for name in (
        "maskserve_worker_mean_step_s",
        "maskserve_worker_p95_overhead_s",
        "maskserve_worker_max_batch_rows",
        "maskserve_worker_held_rows",
        "maskserve_worker_deferred_rows",
        "maskserve_cache_ram_hit_rate",
        "maskserve_cache_device_bytes",
        "maskserve_cache_device_budget_bytes",
    ):
        assert types[name] == "gauge", name
    assert "maskserve_worker_deferred_rows 2.0" in text
    assert "maskserve_cache_ram_hits_total 3.0" in text
    assert 'maskserve_worker_jobs_total{key="done"} 1.0' in text
    # every int of the cache is declared a count or a current value (a new counter cannot
    # silently become a gauge)
    ints = {k for k, v in CacheMetrics().snapshot().items() if type(v) is int}
    assert ints - CacheMetrics.GAUGES == CacheMetrics.COUNTERS and CacheMetrics.GAUGES <= ints


# ----- the job latency histogram ------------------------------------------------------------------
KEY = "metrics-key"


@pytest.fixture
def api(redis_url, redis_client, tmp_path):
    settings = load_settings(
        {
            "MASKSERVE_REDIS_URL": redis_url,
            "MASKSERVE_DATA_DIR": str(tmp_path / "data"),
            "MASKSERVE_API_KEYS": KEY,
        },
        api={"read_rate_per_minute": 0, "write_rate_per_minute": 0},
    )
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as client:
        yield settings, client


def _submit(client) -> str:
    image = Image.new("RGB", (64, 48), (90, 120, 30))
    mask = Image.new("L", (64, 48), 0)
    mask.paste(255, (16, 12, 40, 30))
    files = {}
    for name, picture in (("image", image), ("mask", mask)):
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        files[name] = (f"{name}.png", buffer.getvalue(), "image/png")
    reply = client.post("/v1/jobs", data={"prompt": "a red chair", "steps": "4"}, files=files)
    assert reply.status_code == 202, reply.text
    return reply.json()["job_id"]


def _histogram(text: str, status: str) -> dict[str, float]:
    samples = {}
    pattern = (
        r"^maskserve_job_latency_seconds_(bucket|count|sum)"
        rf'\{{([^}}]*status="{status}"[^}}]*)\}} (\S+)$'
    )
    for part, labels, value in re.findall(pattern, text, flags=re.M):
        le = re.search(r'le="([^"]+)"', labels)
        samples[le.group(1) if le else part] = float(value)
    return samples


def test_job_latency_is_observed_once_per_finished_job_where_its_end_is_written(api, redis_client):
    """A job done by post-processing (its done event written twice, as a redelivered task does)
    and one cancelled through the API (cancelled twice): one observation each, labelled with the
    model and the final status, in the histogram the API's ``/metrics`` serves."""
    settings, client = api
    jobstate = JobStateStore(redis_client, settings.retention.job_record_s)
    done_id, cancelled_id = _submit(client), _submit(client)
    model = jobstate.record(done_id).model_id
    for status in ("preprocessing", "waiting", "running", "postprocessing"):
        jobstate.record_event(JobEvent(job_id=done_id, status=status, at=time.time()))
    for _delivery in range(2):  # the second delivery changes nothing: the job is done already
        done = JobEvent(job_id=done_id, status="done", at=time.time(), result_ref="results/x")
        jobstate.record_event(done)  # as post-processing ends a job
    assert jobstate.status(done_id) == "done"
    assert client.delete(f"/v1/jobs/{cancelled_id}").status_code == 200
    assert client.delete(f"/v1/jobs/{cancelled_id}").status_code == 409
    assert not jobstate.fail(done_id, "too late")  # a terminal status is final: not observed

    text = client.get("/metrics").text
    assert _types(text)["maskserve_job_latency_seconds"] == "histogram"
    for status in ("done", "cancelled"):
        series = _histogram(text, status)
        assert series["count"] == 1.0 and series["+Inf"] == 1.0, (status, series)
        assert 0.0 <= series["sum"] < 60.0
        assert [float(le) for le in series if le not in ("count", "sum", "+Inf")] == list(
            JOB_LATENCY_BUCKETS
        )
        assert series["600.0"] == 1.0  # cumulative: a job of seconds is in every bucket above
    assert f'model="{model}"' in text and 'kind="edit"' in text
    assert _histogram(text, "failed") == {}


def test_job_latency_buckets_hold_the_seconds_from_submission_to_the_end(redis_client):
    jobstate = JobStateStore(redis_client)
    jobstate.create("slow", model_id="m")
    created = jobstate.record("slow").created_at
    jobstate.record_event(JobEvent(job_id="slow", status="failed", at=created + 42.0))
    registry = CollectorRegistry()
    registry.register(JobLatencyCollector(redis_client))
    series = _histogram(generate_latest(registry).decode(), "failed")
    assert series["sum"] == pytest.approx(42.0, abs=0.01)
    assert (series["30.0"], series["60.0"], series["count"]) == (0.0, 1.0, 1.0)


# ----- where the metrics endpoints listen ------------------------------------------------------
def _answers(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=3):
            return True
    except (urllib.error.URLError, OSError):
        return False


def test_a_metrics_endpoint_binds_the_configured_host_and_logs_the_address_it_bound(caplog):
    port = free_port()
    with caplog.at_level(logging.INFO, logger="backend.metrics"):
        server = serve_metrics(port, CollectorRegistry(), "127.0.0.1")
    try:
        assert server.server_address[:2] == ("127.0.0.1", port)
        assert _answers("127.0.0.1", port)
        assert not _answers("127.0.0.2", port)  # not every interface (0.0.0.0 would answer)
        assert f"metrics on http://127.0.0.1:{port}/metrics" in caplog.text
        # a port already taken: a role keeps working without metrics, and says so
        with caplog.at_level(logging.ERROR, logger="backend.metrics"):
            assert serve_metrics(port, CollectorRegistry(), "127.0.0.1") is None
        assert f"cannot listen on 127.0.0.1:{port}" in caplog.text
    finally:
        server.shutdown()
        server.server_close()


def test_the_stack_serves_its_metrics_on_metrics_host_and_names_the_bound_port(tmp_path):
    settings = load_settings(
        {"MASKSERVE_METRICS_HOST": "127.0.0.2", "MASKSERVE_DATA_DIR": str(tmp_path)}
    )
    with socket.socket() as taken:  # the port asked for is taken: a free one, named everywhere
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        stack = Stack(settings, [])
        port = stack.serve_metrics(busy)
    try:
        assert port != busy and stack._metrics_server.server_address[:2] == ("127.0.0.2", port)
        assert _answers("127.0.0.2", port) and not _answers("127.0.0.1", port)
        status = json.loads(stack.status_path.read_text())
        assert status["metrics"] == {"up": f"http://127.0.0.2:{port}/metrics"}
    finally:
        stack.stop()

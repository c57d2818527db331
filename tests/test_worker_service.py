"""The worker service on a real Redis: inbox stream in, progress into the job state store, finished
denoises onto the Celery post-processing queue, heartbeat with live state and a TTL."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from backend import protocol
from backend.blobs import BlobStore
from backend.cache.plans import Tier
from backend.config import load_settings
from backend.engine.factory import CPU_STAGES, build_engine
from backend.jobstate import JobStateStore
from backend.protocol import CancelJob, ServiceLevel, WorkerHeartbeat
from backend.protocol.keys import heartbeat_key
from backend.worker.redis_inbox import send_to_inbox
from backend.worker.service import HEARTBEAT_TTL_S, Heartbeat
from tests.factories import (
    MASK,
    built_worker,
    make_params,
    make_prepared_job,
    make_template,
    queued_raw,
)


@pytest.fixture
def service(redis_url, redis_client, models_dir, tmp_path):
    with built_worker(redis_url, redis_client, models_dir, tmp_path, "w-test") as built:
        yield *built, JobStateStore(redis_client)


@pytest.fixture(scope="module")
def cpu_engine(models_dir, tmp_path_factory):
    """The CPU stages' engine that prepares the jobs a worker receives (the worker's own engine
    holds only the denoiser)."""
    root = tmp_path_factory.mktemp("cpu-stages")
    settings = load_settings(env={}, paths={"data_dir": str(root), "models_dir": str(models_dir)})
    return build_engine(settings, role=CPU_STAGES)


def drain(worker, jobstate, job_id, limit=200):
    """Iterate until the job left the worker (acked: nothing pending in its inbox)."""
    for _ in range(limit):
        worker.iterate(0.01)
        if (
            jobstate.status(job_id) not in ("queued", "preprocessing")
            and worker.inbox.pending() == 0
        ):
            return
    raise AssertionError("the worker did not finish the job")


def test_a_job_from_the_inbox_reports_progress_and_goes_to_post_processing(
    service, redis_client, cpu_engine
):
    settings, worker, _, jobstate = service
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    params = make_params(worker.engine, size=(worker.engine.spec.default_resolution,) * 2)
    template = make_template(size=params.size[0])
    mask = MASK.resize(template.size)
    job = make_prepared_job(cpu_engine, blobs, "svc-1", template, mask, seed=4, params=params)
    jobstate.create("svc-1")
    jobstate.record_event(protocol.JobEvent(job_id="svc-1", status="preprocessing", at=time.time()))
    send_to_inbox(redis_client, "w-test", job)
    drain(worker, jobstate, "svc-1")
    record = jobstate.get("svc-1")
    assert record["status"] == "running" and record["step"] == record["num_steps"] == params.steps
    assert record["worker_id"] == "w-test"
    (task,) = queued_raw(redis_client, settings.celery.post_queue)  # the Celery message, JSON
    assert b"maskserve.postprocess" in task and b"svc-1" in task
    assert worker.inbox.pending() == 0  # acked once handed on


def test_a_cancel_through_the_inbox_ends_the_job(service, redis_client, cpu_engine):
    settings, worker, _, jobstate = service
    jobstate.create("svc-2")
    send_to_inbox(redis_client, "w-test", CancelJob(job_id="svc-2"))
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    params = make_params(worker.engine, size=(worker.engine.spec.default_resolution,) * 2)
    template = make_template(size=params.size[0])
    send_to_inbox(
        redis_client,
        "w-test",
        make_prepared_job(
            cpu_engine,
            blobs,
            "svc-2",
            template,
            MASK.resize(template.size),
            seed=1,
            params=params,
        ),
    )
    drain(worker, jobstate, "svc-2")
    assert jobstate.status("svc-2") == "cancelled"
    assert len(queued_raw(redis_client, settings.celery.post_queue)) == 0


def test_the_heartbeat_carries_live_state_under_a_short_ttl(service, redis_client):
    settings, worker, caches, _ = service
    Heartbeat(redis_client, worker, caches, settings).refresh(force=True)
    beat = protocol.decode(redis_client.get(heartbeat_key("w-test")))
    assert isinstance(beat, WorkerHeartbeat) and beat.model_id == worker.engine.spec.model_id
    assert (
        beat.device == "cpu" and beat.max_batch == settings.worker.max_batch and beat.running == []
    )
    assert 0 < redis_client.ttl(heartbeat_key("w-test")) <= HEARTBEAT_TTL_S


def test_the_heartbeat_lists_the_templates_on_the_caches_device_tier(
    service, redis_client, monkeypatch
):
    settings, worker, caches, _ = service
    tiers = {Tier.DEVICE: ["on-device"], Tier.RAM: ["in-ram"], Tier.DISK: ["in-ram", "on-disk"]}
    monkeypatch.setattr(caches, "resident", tiers.__getitem__)
    Heartbeat(redis_client, worker, caches, settings).refresh(force=True)
    beat = protocol.decode(redis_client.get(heartbeat_key("w-test")))
    assert beat.resident_device == ["on-device"] and beat.resident_ram == ["in-ram"]
    assert beat.resident_disk == ["in-ram", "on-disk"]


def test_a_step_out_of_device_memory_asks_the_caches_device_tier_then_the_graphs(
    service, caplog, monkeypatch
):
    _, worker, caches, _ = service
    asked = []
    monkeypatch.setattr(
        "backend.engine.editor.release_graphs", lambda book: asked.append(book) or 0
    )
    with caplog.at_level("WARNING", logger="backend.cache.store"):
        assert worker.memory.release(1 << 20) == 0  # a CPU worker's device tier holds nothing
    assert "cache device tier gave back bytes=0 asked=1048576" in caplog.text
    assert asked == [worker.engine.graphs]  # then the compiled graphs are given back
    assert "compiled_graphs" in worker.stats.snapshot()


def test_the_worker_process_serves_its_inbox_exports_metrics_and_stops_cleanly(
    redis_url, redis_client, models_dir, tmp_path, service, cpu_engine
):
    """`maskserve worker` as a process: a job sent to its inbox reaches the post queue, /metrics
    answers, SIGTERM stops it with status 0 and its heartbeat key is gone."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from backend.services.redis_server import free_port

    settings, worker, _, jobstate = service  # the in-process engine builds the model files first
    port = free_port()
    env = {
        **os.environ,
        "MASKSERVE_REDIS_URL": redis_url,
        "MASKSERVE_DATA_DIR": str(settings.paths.data_dir),
        "MASKSERVE_MODELS_DIR": str(models_dir),
        "MASKSERVE_WORKER_ID": "w-proc",
        "MASKSERVE_WORKER_METRICS_PORT": str(port),
    }
    log = open(tmp_path / "worker.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "backend.cli", "worker", "--model", cpu_engine.spec.model_id],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        blobs = BlobStore(settings.paths.data_dir / "blobs")
        params = make_params(worker.engine, size=(worker.engine.spec.default_resolution,) * 2)
        template = make_template(size=params.size[0])
        jobstate.create("proc-1")
        send_to_inbox(
            redis_client,
            "w-proc",
            make_prepared_job(
                cpu_engine,
                blobs,
                "proc-1",
                template,
                MASK.resize(template.size),
                seed=2,
                params=params,
            ),
        )
        deadline = time.time() + 90
        while (
            len(queued_raw(redis_client, settings.celery.post_queue)) == 0
            and time.time() < deadline
        ):
            assert process.poll() is None, (tmp_path / "worker.log").read_text()
            time.sleep(0.1)
        assert len(queued_raw(redis_client, settings.celery.post_queue)) == 1, (
            tmp_path / "worker.log"
        ).read_text()
        assert redis_client.exists(heartbeat_key("w-proc"))
        time.sleep(1.2)  # the next heartbeat carries the finished step's statistics
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        )
        assert "maskserve_worker_steps" in metrics and "maskserve_cache_ram_hits" in metrics
    finally:
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=30)
        log.close()
    assert status == 0, (tmp_path / "worker.log").read_text()
    assert not redis_client.exists(heartbeat_key("w-proc"))


def test_the_heartbeat_stays_alive_while_the_loop_is_busy(service, redis_client):
    """A step longer than the TTL must not make a live worker look dead: a thread re-publishes."""
    import threading

    settings, worker, caches, _ = service
    heartbeat = Heartbeat(redis_client, worker, caches, settings)
    heartbeat.refresh(force=True)
    stop = threading.Event()
    heartbeat.start_publisher(stop)
    try:
        redis_client.delete(heartbeat_key("w-test"))  # as if the TTL ran out during a long step
        deadline = time.time() + 3
        while not redis_client.exists(heartbeat_key("w-test")) and time.time() < deadline:
            time.sleep(0.05)
        assert redis_client.exists(heartbeat_key("w-test"))
    finally:
        stop.set()


def test_the_worker_learns_its_finish_tail_from_the_records_and_plans_rows_before_it(
    service, redis_client, cpu_engine
):
    """A job handed on and then done (as post-processing records it) gives the worker its finish
    tail: the heartbeat and metrics publish it, and the next row is planned that much before its
    job's deadline."""
    settings, worker, caches, jobstate = service
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    params = make_params(worker.engine, size=(worker.engine.spec.default_resolution,) * 2)
    template = make_template(size=params.size[0])
    mask = MASK.resize(template.size)
    handed_after = time.time()
    first = make_prepared_job(cpu_engine, blobs, "tail-1", template, mask, seed=4, params=params)
    jobstate.create("tail-1")
    send_to_inbox(redis_client, "w-test", first)
    drain(worker, jobstate, "tail-1")
    handed_before = time.time()
    done_at = handed_before + 0.5
    for status in ("postprocessing", "done"):  # what the CPU worker records
        jobstate.record_event(protocol.JobEvent(job_id="tail-1", status=status, at=done_at))
    heartbeat = Heartbeat(redis_client, worker, caches, settings)
    heartbeat.refresh(force=True)
    beat = protocol.decode(redis_client.get(heartbeat_key("w-test")))
    assert 0.5 <= beat.finish_tail_s <= done_at - handed_after
    assert heartbeat.worker_stats["finish_tail_s"] == beat.finish_tail_s

    deadline = time.time() + 100.0
    second = make_prepared_job(cpu_engine, blobs, "tail-2", template, mask, seed=5, params=params)
    second = replace(second, service=ServiceLevel("interactive", deadline, 0))
    jobstate.create("tail-2")
    send_to_inbox(redis_client, "w-test", second)
    time.sleep(settings.deadlines.forecast_refresh_s)  # the next step runs a new forecast
    worker.iterate(0.01)
    (row,) = worker.scheduler.running.values()
    assert row.deadline == pytest.approx(deadline - beat.finish_tail_s)
    last_step_at = worker.forecasts.finish_of("tail-2")
    assert last_step_at > 0  # the finish users are told includes the tail
    assert jobstate.get("tail-2")["predicted_finish"] == pytest.approx(
        last_step_at + beat.finish_tail_s
    )


def test_without_the_finish_tail_rows_are_planned_against_their_deadlines(
    redis_url, redis_client, models_dir, tmp_path
):
    env = {"MASKSERVE_FINISH_TAIL": "false"}
    with built_worker(redis_url, redis_client, models_dir, tmp_path, "w-untailed", env) as built:
        settings, worker, caches = built
        assert worker.finish_tail is None and worker.finish_reserve_s() == 0.0
        Heartbeat(redis_client, worker, caches, settings).refresh(force=True)
        beat = protocol.decode(redis_client.get(heartbeat_key("w-untailed")))
        assert beat.finish_tail_s == 0.0

"""The engine worker outlives its Redis: writes made while Redis is away wait in order and land once
it is back (the real server killed with SIGKILL and restarted from its append-only file on the same
port), the running batch keeps stepping, and every job in flight is handed to post-processing
exactly once."""

from __future__ import annotations

import threading
import time

import pytest

from backend import protocol
from backend.blobs import BlobStore
from backend.config import load_settings
from backend.engine.factory import CPU_STAGES, build_engine
from backend.jobstate import JobStateStore
from backend.protocol.keys import WORKERS_KEY, heartbeat_key
from backend.services.redis_server import RedisServer
from backend.tasks.celery_app import make_celery
from backend.worker.redis_inbox import send_to_inbox
from backend.worker.service import REDIS_DOWN, Heartbeat, Outbox, Serving, build_worker, connect
from tests.factories import MASK, make_params, make_prepared_job, make_template, queued_raw

RUNNING = threading.Event()  # never set: the worker is not asked to stop


@pytest.fixture
def own_redis(tmp_path):
    """A Redis server of this test only (the test kills it), with its append-only file synced on
    every write: a killed Redis otherwise loses up to its last second of writes (``everysec``),
    a window these tests are not about (they test the worker's outbox and replay)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    connect(load_settings(env={}, redis={"url": server.url})).config_set("appendfsync", "always")
    yield server
    server.stop()


def kill(server: RedisServer) -> None:
    server.process.kill()
    server.process.wait()


def test_writes_made_while_redis_is_away_land_in_order_once_it_is_back(own_redis):
    url = own_redis.url
    client = connect(load_settings(env={}, redis={"url": url}))
    outbox = Outbox()
    outbox.do("first", lambda: client.rpush("writes", "1"))
    kill(own_redis)
    outbox.do("second", lambda: client.rpush("writes", "2"))
    outbox.do("third", lambda: client.rpush("writes", "3"))  # waits behind the second
    assert len(outbox) == 2
    with pytest.raises(REDIS_DOWN):
        outbox.flush()
    assert len(outbox) == 2  # nothing dropped by a failed flush
    assert own_redis.restart() == url  # same port: the client reconnects on its own
    outbox.flush()
    assert len(outbox) == 0
    # the first write survived SIGKILL (AOF), the others came in the order they were made
    assert client.lrange("writes", 0, -1) == [b"1", b"2", b"3"]


@pytest.mark.slow
def test_jobs_in_flight_finish_exactly_once_across_a_redis_restart(own_redis, models_dir, tmp_path):
    settings = load_settings(
        env={},
        paths={"data_dir": str(tmp_path / "data"), "models_dir": str(models_dir)},
        redis={"url": own_redis.url},
        worker={"worker_id": "w-reconnect"},
        cache={"ram_budget_mb": 64, "disk_budget_mb": 256},
        supervisor={"reconnect_initial_s": 0.05, "reconnect_max_s": 0.2},
    )
    client = connect(settings)
    worker, caches = build_worker(settings, client, make_celery(settings))
    jobstate = JobStateStore(client)
    cpu_engine = build_engine(settings, role=CPU_STAGES)
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    params = make_params(worker.engine, size=(worker.engine.spec.default_resolution,) * 2)
    template = make_template(size=params.size[0])
    job_ids = [f"rc-{index}" for index in range(3)]
    for seed, job_id in enumerate(job_ids):
        job = make_prepared_job(
            cpu_engine, blobs, job_id, template, MASK.resize(template.size), seed, params
        )
        jobstate.create(job_id)
        jobstate.record_event(
            protocol.JobEvent(job_id=job_id, status="preprocessing", at=time.time())
        )
        send_to_inbox(client, "w-reconnect", job)
    serving = Serving(settings, client, worker, Heartbeat(client, worker, caches, settings))
    serving.join()
    try:
        while not worker.scheduler.running:  # read and admitted: the batch runs
            serving.turn(RUNNING)
        kill(own_redis)
        turns = 0
        while not worker.scheduler.idle:  # the batch steps to its end with Redis away
            serving.turn(RUNNING)
            turns += 1
        outbox = worker.inbox.outbox
        assert turns > 0 and len(outbox) > 0 and not worker.inbox.online
        own_redis.restart()
        for _ in range(200):
            serving.turn(RUNNING)
            if len(outbox) == 0 and worker.inbox.online and worker.inbox.pending() == 0:
                break
        else:
            raise AssertionError(f"{len(outbox)} writes still waiting after Redis came back")
        queued = queued_raw(client, settings.celery.post_queue)
        for job_id in job_ids:
            assert sum(job_id.encode() in task for task in queued) == 1, job_id  # exactly once
            record = jobstate.get(job_id)
            assert record["step"] == record["num_steps"] == params.steps
        assert client.sismember(WORKERS_KEY, "w-reconnect")  # re-registered
        assert client.exists(heartbeat_key("w-reconnect"))
    finally:
        caches.close()

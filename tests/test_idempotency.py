"""A job delivered twice to an engine worker (real Redis inbox, real engine) is denoised once and
never crashes the loop; a job that stops its worker every time fails after a bounded number of
redeliveries."""

from __future__ import annotations

import pytest

from backend.blobs import BlobStore
from backend.config import load_settings
from backend.jobstate import JobStateStore
from backend.protocol import JobEvent, PreparedJob
from backend.protocol.keys import INBOX_GROUP, inbox_stream, job_key
from backend.tasks.celery_app import make_celery
from backend.worker.loop import EngineWorker
from backend.worker.redis_inbox import RedisInbox, send_to_inbox
from backend.worker.service import RedisSink
from tests.factories import (
    MASK,
    make_engine,
    make_params,
    make_prepared_job,
    make_template,
    queued_tasks,
)

MAX_REDELIVERIES = 2


@pytest.fixture(scope="module")
def sd2_engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("idempotency-cache"))


@pytest.fixture
def env(redis_url, redis_client, tmp_path):
    # the sink hands off as the worker its settings name (the record's worker_id fences the rest)
    settings = load_settings(env={}, redis={"url": redis_url}, worker={"worker_id": "w1"})
    return settings, redis_client, JobStateStore(redis_client), BlobStore(tmp_path / "blobs")


def make_worker(engine, env) -> EngineWorker:
    settings, client, jobstate, blobs = env
    sink = RedisSink(jobstate, make_celery(settings), settings)
    inbox = RedisInbox(client, "w1", fail_job=sink.fail, max_redeliveries=MAX_REDELIVERIES)
    return EngineWorker(engine, blobs, inbox, sink, worker_id="w1")


def new_job(engine, env, job_id: str):
    _settings, _client, jobstate, blobs = env
    jobstate.create(job_id)
    params = make_params(engine, steps=3)
    return make_prepared_job(engine, blobs, job_id, make_template(), MASK, 1, params)


def post_tasks(env) -> list[str]:
    """Job ids of the post-processing tasks queued in the broker."""
    settings, client, _jobstate, _blobs = env
    return [job.job_id for job in queued_tasks(client, settings.celery.post_queue)]


def run_until_idle(worker: EngineWorker, limit: int = 50) -> None:
    for _ in range(limit):
        worker.iterate()
        if worker.scheduler.idle and not worker.inbox.pending():
            return
    raise AssertionError("the worker did not drain its inbox")


def test_a_running_job_delivered_again_is_denoised_once(sd2_engine, env):
    _settings, client, jobstate, _blobs = env
    worker, job = make_worker(sd2_engine, env), new_job(sd2_engine, env, "twice")
    send_to_inbox(client, "w1", job)
    worker.iterate()
    worker.iterate()
    assert "twice" in worker.scheduler.running
    send_to_inbox(client, "w1", job)  # the same job again while it runs (a double dispatch)
    run_until_idle(worker)
    assert post_tasks(env) == ["twice"]
    assert jobstate.record("twice").denoised == 1
    assert client.xpending(inbox_stream("w1"), INBOX_GROUP)["pending"] == 0  # both entries acked


def test_a_finished_or_denoised_job_delivered_again_is_acked_and_dropped(sd2_engine, env):
    _settings, client, jobstate, _blobs = env
    worker = make_worker(sd2_engine, env)
    finished, denoised = new_job(sd2_engine, env, "fin"), new_job(sd2_engine, env, "den")
    jobstate.record_event(JobEvent(job_id="fin", status="done", at=1.0))
    client.hset(job_key("den"), "denoised", 1)  # denoised, its post task not started yet
    send_to_inbox(client, "w1", finished)
    send_to_inbox(client, "w1", denoised)
    worker.iterate()
    assert worker.scheduler.idle and post_tasks(env) == []
    assert jobstate.status("fin") == "done" and jobstate.record("den").denoised == 1
    assert client.xpending(inbox_stream("w1"), INBOX_GROUP)["pending"] == 0


def test_a_job_that_stops_its_worker_every_time_fails_after_the_bound(env):
    _settings, client, jobstate, _blobs = env
    failed: list[tuple[str, str]] = []

    def restarted_inbox() -> RedisInbox:  # the worker restarts and re-reads its pending entries
        return RedisInbox(
            client,
            "w1",
            fail_job=lambda job_id, why: failed.append((job_id, why)),
            max_redeliveries=MAX_REDELIVERIES,
        )

    jobstate.create("poison")
    jobstate.create("fine")
    send_to_inbox(client, "w1", new_job_message("poison"))
    assert [m.job_id for m in restarted_inbox().poll(0)] == ["poison"]  # read, then "crash"
    for attempt in range(MAX_REDELIVERIES):
        assert [m.job_id for m in restarted_inbox().poll(0)] == ["poison"], attempt
    last = restarted_inbox()
    assert last.poll(0) == [] and [job for job, _ in failed] == ["poison"]
    assert "stopped its worker 3 times" in failed[0][1]
    assert client.xpending(inbox_stream("w1"), INBOX_GROUP)["pending"] == 0  # nothing loops
    send_to_inbox(client, "w1", new_job_message("fine"))
    assert [m.job_id for m in last.poll(0)] == ["fine"]  # other jobs keep flowing


def test_entries_re_read_after_a_redis_outage_are_not_redeliveries(env):
    """The same worker process re-reads its pending entries when Redis comes back (a read's reply
    may have been lost): the jobs it holds are neither delivered again nor counted, however many
    outages they live through."""
    _settings, client, jobstate, _blobs = env
    inbox = RedisInbox(client, "w1", fail_job=lambda *_: None, max_redeliveries=MAX_REDELIVERIES)
    jobstate.create("held")
    send_to_inbox(client, "w1", new_job_message("held"))
    assert [m.job_id for m in inbox.poll(0)] == ["held"]
    for _outage in range(MAX_REDELIVERIES + 2):
        inbox.replay()
        assert inbox.poll(0) == []
    assert jobstate.record("held").redeliveries == 0 and jobstate.status("held") == "queued"
    inbox.ack("held")
    assert client.xpending(inbox_stream("w1"), INBOX_GROUP)["pending"] == 0


def new_job_message(job_id: str) -> PreparedJob:
    return PreparedJob(
        job_id=job_id,
        model_id="tiny-sd2-inpaint",
        prepared_ref=f"prepared/{job_id}.safetensors",
        template_ref="uploads/t.png",
        num_steps=3,
        mask_ratio=0.2,
        cache_digest="",
    )

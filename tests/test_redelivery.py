"""CPU-task leases on a real Redis: a task lost with its Celery worker is re-enqueued from its
durable message once its lease lapses (not after the broker's visibility timeout), a duplicate of a
running task does nothing, and a job whose task is lost too often fails."""

from __future__ import annotations

import time

import pytest

from backend import protocol
from backend.config import load_settings
from backend.jobstate import JobStateStore
from backend.protocol import JobEvent
from backend.protocol.keys import CPU_LEASES_KEY, cpu_queue_lists, cpu_task_key
from backend.tasks.celery_app import cpu_leases, make_celery, resend_lapsed, submit_postprocess
from backend.tasks.leases import CLAIMED, EXHAUSTED, HELD, lapse_verdict
from tests.factories import make_denoised_job, queued_tasks

LIMIT = 2


@pytest.mark.parametrize(
    "stage, status, redeliveries, verdict",
    [
        ("pre", "preprocessing", 0, "requeue"),
        ("pre", "queued", 1, "requeue"),
        ("pre", "waiting", 0, "forget"),  # handed off: the stage is over
        ("post", "running", 0, "requeue"),  # queued by the worker, lost before it started
        ("post", "postprocessing", LIMIT, "fail"),
        ("post", "done", 0, "forget"),
        ("post", None, 0, "forget"),  # the job expired
    ],
)
def test_what_a_lapsed_lease_leads_to(stage, status, redeliveries, verdict):
    assert lapse_verdict(stage, status, redeliveries, LIMIT) == verdict


@pytest.fixture
def env(redis_url, redis_client):
    settings = load_settings(
        env={}, redis={"url": redis_url}, dispatcher={"max_redeliveries": LIMIT}
    )
    return settings, redis_client, JobStateStore(redis_client), make_celery(settings)


def queued(settings, client, queue: str) -> list[str]:
    """Job ids of the tasks waiting in a broker queue."""
    return [job.job_id for job in queued_tasks(client, queue)]


def lose(client, job_id: str) -> None:
    """The holder's worker is gone: no renewal came, the deadline passed."""
    client.zadd(CPU_LEASES_KEY, {job_id: time.time() - 1})


def test_a_duplicate_of_a_running_task_does_nothing_and_its_release_ends_the_stage(env):
    settings, client, jobstate, _app = env
    leases = cpu_leases(client, settings)
    jobstate.create("j")
    assert leases.claim("j", "pre", "{}", "first", LIMIT) == CLAIMED
    assert leases.claim("j", "pre", "{}", "second", LIMIT) == HELD  # broker delivered it twice
    assert leases.renew("j", "first") and not leases.renew("j", "second")
    leases.release("j", "first", stage_over=True)
    assert not client.exists(cpu_task_key("j")) and client.zscore(CPU_LEASES_KEY, "j") is None
    assert leases.take_lapsed(time.time() + 3600) == []


def test_a_lost_post_task_is_re_enqueued_once_with_a_message(env):
    settings, client, jobstate, app = env
    jobstate.create("lost")
    jobstate.record_event(JobEvent(job_id="lost", status="running", at=time.time()))
    assert submit_postprocess(app, client, settings, make_denoised_job("lost"))
    assert not submit_postprocess(
        app, client, settings, make_denoised_job("lost")
    )  # denoised twice
    assert queued(settings, client, settings.celery.post_queue) == ["lost"]
    client.delete(*cpu_queue_lists(settings.celery.post_queue))  # taken by a worker that dies
    leases = cpu_leases(client, settings)
    assert (
        leases.claim("lost", "post", protocol.encode(make_denoised_job("lost")), "t1", LIMIT)
        == CLAIMED
    )
    jobstate.record_event(JobEvent(job_id="lost", status="postprocessing", at=time.time()))
    lose(client, "lost")
    assert resend_lapsed(app, client, settings, jobstate) == 1
    assert resend_lapsed(app, client, settings, jobstate) == 0  # taken once
    assert queued(settings, client, settings.celery.post_queue) == ["lost"]
    record = jobstate.record("lost")
    assert record.status == "postprocessing" and record.redeliveries == 1
    assert record.message == f"post-processing worker lost; retrying (redelivery 1 of {LIMIT})"
    assert record.denoised == 2  # both denoises are counted (a chaos check sees it); one task
    # the re-enqueued task starts: it claims without counting the loss again
    assert leases.claim("lost", "post", "{}", "t2", LIMIT) == CLAIMED
    assert jobstate.record("lost").redeliveries == 1


def test_a_worker_the_job_was_taken_from_does_not_hand_it_off(env):
    settings, client, jobstate, app = env
    jobstate.create("moved")
    assert jobstate.assign("moved", "w1")  # re-dispatched from w0, cut off past its heartbeat
    assert not submit_postprocess(app, client, settings, make_denoised_job("moved"), worker_id="w0")
    assert jobstate.record("moved").denoised == 0 and not client.exists(cpu_task_key("moved"))
    assert submit_postprocess(app, client, settings, make_denoised_job("moved"), worker_id="w1")
    assert jobstate.record("moved").denoised == 1
    assert queued(settings, client, settings.celery.post_queue) == ["moved"]


def test_a_task_lost_every_time_fails_its_job_after_the_bound(env):
    settings, client, jobstate, app = env
    leases = cpu_leases(client, settings)
    jobstate.create("poison")
    jobstate.create("fine")
    for attempt in range(LIMIT):
        assert leases.claim("poison", "pre", "{}", f"t{attempt}", LIMIT) == CLAIMED
        lose(client, "poison")
        assert resend_lapsed(app, client, settings, jobstate) == 1
    assert leases.claim("poison", "pre", "{}", "last", LIMIT) == CLAIMED
    lose(client, "poison")
    assert resend_lapsed(app, client, settings, jobstate) == 0
    record = jobstate.record("poison")
    assert record.status == "failed" and "giving up" in record.message
    assert not client.exists(cpu_task_key("poison"))
    assert leases.claim("fine", "pre", "{}", "t", LIMIT) == CLAIMED  # others keep flowing


def test_celery_redelivering_a_lost_task_itself_counts_and_is_bounded(env):
    settings, client, jobstate, _app = env
    leases = cpu_leases(client, settings)
    jobstate.create("crashy")
    for attempt in range(LIMIT + 1):  # each start dies before releasing; the broker redelivers
        lose(client, "crashy")
        verdict = leases.claim("crashy", "post", "{}", f"t{attempt}", LIMIT)
        assert verdict == CLAIMED, attempt
    lose(client, "crashy")
    assert leases.claim("crashy", "post", "{}", "again", LIMIT) == EXHAUSTED
    assert jobstate.record("crashy").redeliveries == LIMIT + 1

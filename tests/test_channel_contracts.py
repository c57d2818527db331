"""Contract suites: every implementation of the worker's channels behaves the same.

``Inbox`` (in-process ``LocalInbox``, Redis ``RedisInbox``) and ``JobSink`` (``LocalSink``,
``RedisSink``) are exercised by the same tests through small drivers that deliver and read back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from backend import protocol
from backend.config import load_settings
from backend.jobstate import JobStateStore
from backend.protocol import CancelJob, DenoisedJob, JobEvent, ServiceLevel
from backend.tasks.celery_app import make_celery
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.redis_inbox import RedisInbox, send_to_inbox
from backend.worker.service import RedisSink
from tests.factories import make_denoised_job, queued_tasks


def make_job_message(job_id: str) -> protocol.PreparedJob:
    return protocol.PreparedJob(
        job_id=job_id,
        model_id="tiny-sd2-inpaint",
        prepared_ref=f"prepared/{job_id}.safetensors",
        template_ref=f"uploads/{job_id}.png",
        num_steps=4,
        mask_ratio=0.2,
        cache_digest="",
    )


@dataclass
class InboxDriver:
    inbox: Any
    deliver: Any  # message -> None: what a dispatcher (or a test) does


def local_inbox(request) -> InboxDriver:
    inbox = LocalInbox()
    return InboxDriver(inbox, inbox.put)


def redis_inbox(request) -> InboxDriver:
    client = request.getfixturevalue("redis_client")
    return InboxDriver(
        RedisInbox(client, "w-contract"), lambda m: send_to_inbox(client, "w-contract", m)
    )


@pytest.fixture(params=[local_inbox, redis_inbox], ids=["local", "redis"])
def inbox(request) -> InboxDriver:
    return request.param(request)


def test_an_empty_inbox_polls_nothing(inbox):
    assert inbox.inbox.poll(0) == []
    inbox.deliver(make_job_message("late"))  # the empty poll consumed nothing that comes later
    assert inbox.inbox.poll(1.0) == [make_job_message("late")]


def test_messages_arrive_once_in_order_and_equal_to_what_was_sent(inbox):
    sent = [make_job_message("a"), CancelJob(job_id="a"), make_job_message("b")]
    for message in sent:
        inbox.deliver(message)
    received = inbox.inbox.poll(0.5)
    while len(received) < len(sent):
        more = inbox.inbox.poll(0.5)
        assert more, f"only {len(received)} of {len(sent)} messages arrived"
        received += more
    assert received == sent
    assert inbox.inbox.poll(0) == []  # nothing twice


def test_a_poll_with_a_timeout_returns_what_arrives_meanwhile(inbox):
    inbox.deliver(make_job_message("c"))
    assert inbox.inbox.poll(2.0) == [make_job_message("c")]
    inbox.inbox.ack("c")
    assert inbox.inbox.poll(0) == []


@dataclass
class SinkDriver:
    sink: Any
    statuses: Any  # job id -> the statuses recorded for it, in order
    denoised: Any  # () -> the DenoisedJobs handed to post-processing


def local_sink(request) -> SinkDriver:
    sink = LocalSink()
    return SinkDriver(sink, sink.statuses, lambda: list(sink.denoised_jobs))


def redis_sink(request) -> SinkDriver:
    client = request.getfixturevalue("redis_client")
    settings = load_settings(env={}, redis={"url": request.getfixturevalue("redis_url")})
    jobstate = JobStateStore(client)
    sink = RedisSink(jobstate, make_celery(settings), settings)

    def statuses(job_id: str) -> list[str]:
        return [event["status"] for _, event in jobstate.events(job_id)]

    def denoised() -> list[DenoisedJob]:
        return queued_tasks(client, settings.celery.post_queue)

    for job_id in ("s1", "s2"):
        jobstate.create(job_id)
    return SinkDriver(sink, statuses, denoised)


@pytest.fixture(params=[local_sink, redis_sink], ids=["local", "redis"])
def sink(request) -> SinkDriver:
    return request.param(request)


def test_events_are_recorded_per_job_in_order(sink):
    sink.sink.event(JobEvent(job_id="s1", status="running", at=1.0, step=1, num_steps=2))
    sink.sink.step_events(
        [
            JobEvent(job_id="s1", status="running", at=2.0, step=2, num_steps=2),
            JobEvent(job_id="s2", status="running", at=2.0, step=1, num_steps=4),
        ]
    )
    sink.sink.event(JobEvent(job_id="s1", status="failed", at=3.0, message="boom"))
    assert sink.statuses("s1") == ["running", "running", "failed"]
    assert sink.statuses("s2") == ["running"]


def test_a_finished_denoise_reaches_post_processing_unchanged(sink):
    job = DenoisedJob(
        job_id="s1",
        model_id="tiny-sd2-inpaint",
        latents_ref="latents/s1.safetensors",
        prepared_ref="prepared/s1.safetensors",
        template_ref="uploads/t.png",
        used_cache=True,
        paste=protocol.PastePlan(mask_ref="uploads/m.png", crop_box=[0, 0, 8, 8]),
        timings={"denoise_s": 0.5},
        service=ServiceLevel("interactive", deadline=12.5, priority=3),
    )
    sink.sink.denoised(job)
    assert sink.denoised() == [job]


@pytest.mark.parametrize(
    "service_order, taken",
    [(True, ["urgent", "studio", "bulk"]), (False, ["bulk", "studio", "urgent"])],
    ids=["by-service", "first-in-first-out"],
)
def test_post_processing_is_queued_in_service_order(redis_client, redis_url, service_order, taken):
    settings = load_settings(
        env={}, redis={"url": redis_url}, celery={"service_order": service_order}
    )
    jobstate = JobStateStore(redis_client)
    sink = RedisSink(jobstate, make_celery(settings), settings)
    levels = {
        "bulk": ServiceLevel("batch"),
        "studio": ServiceLevel("interactive"),
        "urgent": ServiceLevel("batch", priority=9),
    }
    for job_id, level in levels.items():  # denoised in this order
        jobstate.create(job_id)
        sink.denoised(make_denoised_job(job_id, service=level))
    queued = queued_tasks(redis_client, settings.celery.post_queue)
    assert [job.job_id for job in queued] == taken

"""Chaos on the real stack (``maskserve up``): one role killed -9 mid-load, recovered by the
stack's own supervision; every accepted job ends exactly once, done results are exact outside
their masks, nothing is denoised twice and new jobs finish (``tests.chaos.checker``)."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest

from backend import protocol
from backend.jobstate import JobStateStore
from backend.protocol import entry_fields, entry_message
from backend.protocol.keys import PREPARED_STREAM, inbox_stream
from tests.chaos import fixtures
from tests.chaos.checker import Submitted
from tests.chaos.harness import JobLoad, collect, kill, run_fault
from tests.chaos.sse import SseFollower

pytestmark = [pytest.mark.slow, pytest.mark.chaos]
shared_stacks, stack = fixtures.shared_stacks, fixtures.stack

KILLS = {
    "kill -9 engine worker": lambda s: kill(s.role("worker")),
    "kill -9 Celery child": lambda s: kill(s.celery_child()),
    "kill -9 Celery parent": lambda s: kill(s.role("cpu-worker")),
    "kill -9 dispatcher": lambda s: kill(s.role("dispatcher")),
    "kill -9 Redis": lambda s: kill(s.redis_process()),
}


@pytest.mark.parametrize("fault", list(KILLS))
def test_a_killed_role_is_recovered_and_every_job_ends_exactly_once(stack, fault):
    run_fault(stack, fault, lambda: KILLS[fault](stack))


def test_the_api_killed_with_event_streams_open_loses_no_terminal_event(stack):
    load, followers = JobLoad(stack), []

    def inject() -> float:
        load.wait_running()
        followers.extend(SseFollower(stack.url, job.job_id).start() for job in load.accepted[-4:])
        for follower in followers:
            follower.wait_first_event()
        return kill(stack.role("api"))

    run_fault(stack, "kill -9 API (SSE open)", inject, load=load)
    with stack.redis() as client:
        jobstate = JobStateStore(client)
        for follower in followers:
            follower.join()
            stored = [entry_id for entry_id, _ in jobstate.events(follower.job_id)]
            assert follower.ids == stored, (follower.job_id, follower.ids, stored, stack.logs())
            assert follower.statuses[-1] in ("done", "failed", "cancelled"), follower.statuses
    assert any(follower.reconnects for follower in followers), "no stream was cut by the kill"


def _inbox_entry(client, job_id: str) -> tuple[str, dict]:
    """The worker and inbox entry that carried ``job_id``'s prepared message."""
    worker = JobStateStore(client).get(job_id)["worker_id"]
    for _, fields in client.xrange(inbox_stream(worker)):
        message = protocol.decode(entry_message(fields))
        if getattr(message, "job_id", None) == job_id:
            return worker, fields
    raise AssertionError(f"{job_id} is not in the inbox of {worker}")


def test_a_duplicated_inbox_delivery_is_denoised_once(stack):
    load = JobLoad(stack)
    finished: dict = {}

    def inject() -> float:
        job_id = load.wait_running()
        with stack.redis() as client:
            worker, fields = _inbox_entry(client, job_id)
            at = time.time()
            client.xadd(inbox_stream(worker), fields)
            client.xadd(inbox_stream(worker), fields)
        return at

    def redeliver_a_finished_job(load: JobLoad) -> None:
        first = load.accepted[0]
        collect(stack, [first])
        with stack.redis() as client:
            jobstate = JobStateStore(client)
            worker, fields = _inbox_entry(client, first.job_id)
            finished["before"] = (jobstate.get(first.job_id), jobstate.events(first.job_id))
            client.xadd(inbox_stream(worker), fields)
        finished["job"] = first

    run_fault(stack, "duplicate inbox delivery", inject, load=load, extra=redeliver_a_finished_job)
    with stack.redis() as client:
        jobstate = JobStateStore(client)
        job_id = finished["job"].job_id
        after = (jobstate.get(job_id), jobstate.events(job_id))
    assert after == finished["before"], "a finished job's duplicate delivery changed it"


def test_a_job_that_always_fails_ends_failed_and_blocks_nothing(stack):
    load = JobLoad(stack)

    def inject() -> float:
        load.wait_running()
        job_id = f"poison-{uuid.uuid4().hex[:12]}"
        with stack.redis() as client:
            _, fields = client.xrange(PREPARED_STREAM)[-1]
            message = protocol.decode(entry_message(fields))
            path = stack.data_dir / "blobs" / "prepared" / f"{job_id}.safetensors"
            path.write_bytes(b"\x00not a safetensors file")  # corrupt on disk, every time
            poison = replace(message, job_id=job_id, prepared_ref=f"prepared/{job_id}.safetensors")
            JobStateStore(client).create(job_id, model_id=message.model_id, prompt="poison")
            at = time.time()
            client.xadd(PREPARED_STREAM, entry_fields(protocol.encode(poison)))
        template, mask = load.accepted[0].template, load.accepted[0].mask
        load.accepted.append(Submitted(job_id, at, template, mask, expect="failed"))
        return at

    run_fault(stack, "a job that always fails", inject, load=load)

"""The dispatcher on a real Redis: routing by heartbeat, cancelled jobs dropped, jobs kept until a
worker can take them, a dead dispatcher's entries taken over, a dead worker's jobs re-dispatched."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from backend import protocol
from backend.config import load_settings
from backend.dispatch.service import Dispatcher
from backend.jobstate import JobStateStore
from backend.protocol import (
    AdapterUse,
    CancelJob,
    JobEvent,
    PreparedJob,
    ServiceLevel,
    WorkerHeartbeat,
)
from backend.protocol.keys import DISPATCHER_GROUP as GROUP
from backend.protocol.keys import WORKERS_KEY, heartbeat_key, inbox_stream
from backend.tasks.celery_app import PREPARED_STREAM, hand_off
from backend.worker.redis_inbox import send_to_inbox
from backend.worker.service import HEARTBEAT_TTL_S

MODEL = "tiny-sd2-inpaint"


def beat(client, worker_id, model_id=MODEL, running=(), resident_ram=(), adapters_device=()):
    message = WorkerHeartbeat(
        worker_id=worker_id,
        model_id=model_id,
        device="cpu",
        at=time.time(),
        max_batch=8,
        batching="continuous",
        running=list(running),
        resident_ram=list(resident_ram),
        adapters_device=list(adapters_device),
    )
    client.set(heartbeat_key(worker_id), protocol.encode(message), ex=HEARTBEAT_TTL_S)
    client.sadd(WORKERS_KEY, worker_id)


def prepared(job_id, mask_ratio=0.1, template="t1", model_id=MODEL) -> PreparedJob:
    return PreparedJob(
        job_id=job_id,
        model_id=model_id,
        prepared_ref=f"prepared/{job_id}.safetensors",
        template_ref="uploads/t.png",
        num_steps=4,
        mask_ratio=mask_ratio,
        cache_digest=template,
    )


def inbox_jobs(client, worker_id) -> list[str]:
    return [
        protocol.decode(fields[b"msg"]).job_id
        for _, fields in client.xrange(inbox_stream(worker_id))
    ]


@pytest.fixture
def env(redis_url, redis_client):
    settings = load_settings(env={}, redis={"url": redis_url}, dispatcher={"check_every_s": 0.01})
    return settings, redis_client, JobStateStore(redis_client)


def submit(client, jobstate, job) -> None:
    jobstate.create(job.job_id)
    hand_off(client, job)


def run(dispatcher, times=3):
    for _ in range(times):
        time.sleep(0.011)  # let the worker check come due
        dispatcher.iterate(block_ms=10)


def test_a_job_goes_to_a_live_worker_and_is_acked(env):
    settings, client, jobstate = env
    beat(client, "w1")
    submit(client, jobstate, prepared("j1"))
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher)
    assert inbox_jobs(client, "w1") == ["j1"] and jobstate.get("j1")["worker_id"] == "w1"
    assert client.xpending(PREPARED_STREAM, GROUP)["pending"] == 0


def test_the_warm_worker_gets_the_job_and_a_burst_is_spread(env):
    settings, client, jobstate = env
    beat(client, "w1")
    beat(client, "w2", resident_ram=["hot"])
    submit(client, jobstate, prepared("hot-1", template="hot"))
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher)
    assert inbox_jobs(client, "w2") == ["hot-1"]
    for index in range(6):  # no new heartbeat: the dispatcher counts what it has just sent
        submit(client, jobstate, prepared(f"cold-{index}", template=f"c{index}"))
    run(dispatcher)
    assert len(inbox_jobs(client, "w1")) >= 3 and len(inbox_jobs(client, "w2")) >= 2


def test_a_job_goes_where_its_adapters_are_and_the_view_counts_them_until_the_next_beat(
    redis_url, redis_client
):
    client, jobstate = redis_client, JobStateStore(redis_client)
    settings = load_settings(
        env={},
        redis={"url": redis_url},
        dispatcher={"check_every_s": 0.01, "adapter_copy_gbps": 2.0},
        adapters={"join_by": 0.0},
    )
    beat(client, "w1")
    beat(client, "w2", adapters_device=["a" * 64])
    use = AdapterUse("style", "a" * 64, 0.8, 10**8)
    submit(client, jobstate, replace(prepared("lora-1"), adapters=[use]))
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher)
    assert inbox_jobs(client, "w2") == ["lora-1"]  # both idle: only the adapter tells them apart
    model = dispatcher.router.cost_model(MODEL, "cpu")
    assert model is not None and model.adapter_loads.copy_s_per_byte == pytest.approx(0.5e-9)
    assert model.adapter_loads.join_by == 0.0
    jobstate.create("lora-2")  # placed with no heartbeat since: the view counts its adapters
    assert dispatcher.place(replace(prepared("lora-2"), adapters=[use])) == "w2"
    assert dispatcher._views["w2"].waiting[-1].adapters == ("a" * 64,)


def test_a_cancelled_job_is_dropped(env):
    settings, client, jobstate = env
    beat(client, "w1")
    submit(client, jobstate, prepared("gone"))
    jobstate.record_event(JobEvent(job_id="gone", status="cancelled", at=time.time()))
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher)
    assert inbox_jobs(client, "w1") == [] and dispatcher.counts["dropped"] == 1
    assert client.xpending(PREPARED_STREAM, GROUP)["pending"] == 0


def test_a_job_waits_for_a_worker_of_its_model(env):
    settings, client, jobstate = env
    beat(client, "flux-worker", model_id="tiny-flux-fill")
    submit(client, jobstate, prepared("waits"))
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher)
    assert inbox_jobs(client, "flux-worker") == [] and len(dispatcher.backlog) == 1
    assert client.xpending(PREPARED_STREAM, GROUP)["pending"] == 1  # not lost if we die now
    beat(client, "sd2-worker")
    run(dispatcher)
    assert inbox_jobs(client, "sd2-worker") == ["waits"] and not dispatcher.backlog


def test_a_restarted_dispatcher_takes_over_what_the_dead_one_had_read(env):
    settings, client, jobstate = env
    beat(client, "w1")
    submit(client, jobstate, prepared("orphan"))
    crashed = Dispatcher(settings, client, consumer="old")
    crashed._read(block_ms=10)  # its own pending entries (none)
    assert [job.job_id for _, job in crashed._read(block_ms=10)] == ["orphan"]  # read, then "crash"
    assert client.xpending(PREPARED_STREAM, GROUP)["pending"] == 1
    successor = Dispatcher(settings, client, consumer="new", claim_idle_ms=0)
    run(successor)
    assert inbox_jobs(client, "w1") == ["orphan"]
    assert client.xpending(PREPARED_STREAM, GROUP)["pending"] == 0


def test_a_dead_workers_unfinished_jobs_are_redispatched_once(env):
    settings, client, jobstate = env
    beat(client, "alive")
    client.sadd(WORKERS_KEY, "dead")  # started once, its heartbeat is gone
    for job_id, status in (("mid-job", "running"), ("almost", "postprocessing"), ("over", "done")):
        jobstate.create(job_id)
        jobstate.record_event(
            JobEvent(
                job_id=job_id, status=status, at=time.time(), step=2, num_steps=4, worker_id="dead"
            )
        )
        send_to_inbox(client, "dead", prepared(job_id))
    send_to_inbox(client, "dead", CancelJob(job_id="mid-job"))
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher)
    assert inbox_jobs(client, "alive") == ["mid-job"]
    record = jobstate.get("mid-job")
    assert record["status"] == "waiting" and record["step"] == 0 and record["worker_id"] == "alive"
    assert jobstate.status("almost") == "postprocessing" and jobstate.status("over") == "done"
    assert not client.exists(inbox_stream("dead")) and not client.sismember(WORKERS_KEY, "dead")
    run(dispatcher)
    assert inbox_jobs(client, "alive") == ["mid-job"] and dispatcher.counts["redispatched"] == 1


@pytest.fixture
def late_binding(redis_url, redis_client):
    """Settings with late binding, the client, the job state and a full batch's running rows."""
    settings = load_settings(
        env={}, redis={"url": redis_url}, dispatcher={"check_every_s": 0.01, "late_binding": True}
    )
    rows = [
        protocol.RunningRow(job_id=f"r{i}", mask_ratio=0.1, remaining_steps=3, template="t1")
        for i in range(8)
    ]
    return settings, redis_client, JobStateStore(redis_client), rows


def test_late_binding_holds_a_job_until_a_worker_has_slack(late_binding):
    settings, client, jobstate, rows = late_binding
    beat(client, "w1", running=rows)  # max_batch 8, all 8 slots taken
    submit(client, jobstate, prepared("held"))
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher)
    assert inbox_jobs(client, "w1") == [] and [j.job_id for _, j in dispatcher.backlog] == ["held"]
    # still pending: not lost if we die now
    assert client.xpending(PREPARED_STREAM, GROUP)["pending"] == 1
    beat(client, "w1", running=rows[:7])  # a row finished: a free slot
    run(dispatcher)
    assert inbox_jobs(client, "w1") == ["held"] and not dispatcher.backlog


def test_late_binding_gives_a_freed_slot_to_the_tight_job_before_bulk_jobs_held_ahead(
    late_binding,
):
    settings, client, jobstate, rows = late_binding
    beat(client, "w1", running=rows)  # every slot taken
    now = time.time()
    levels = {
        "bulk-1": ServiceLevel("batch", now + 600.0),
        "plain": ServiceLevel("batch"),  # no deadline: after every job that has one
        "bulk-2": ServiceLevel("batch", now + 600.0),
        "studio": ServiceLevel("interactive", now + 30.0),
        "urgent": ServiceLevel("batch", now + 600.0, priority=9),
    }
    dispatcher = Dispatcher(settings, client, consumer="d")
    for job_id, level in levels.items():  # arriving in this order, all held
        submit(client, jobstate, replace(prepared(job_id), service=level))
        run(dispatcher, times=1)
    assert inbox_jobs(client, "w1") == [] and len(dispatcher.backlog) == len(levels)
    beat(client, "w1", running=rows[:6])  # two slots free
    run(dispatcher, times=1)
    assert inbox_jobs(client, "w1") == ["urgent", "studio"]
    beat(client, "w1", running=[])  # every slot free: the rest, in the same order
    run(dispatcher, times=1)
    assert inbox_jobs(client, "w1") == ["urgent", "studio", "bulk-1", "bulk-2", "plain"]


def test_a_prepared_job_read_twice_goes_to_one_worker_once(env):
    settings, client, jobstate = env
    beat(client, "w1")
    beat(client, "w2")
    submit(client, jobstate, prepared("dup"))
    client.xadd(PREPARED_STREAM, {"msg": protocol.encode(prepared("dup"))})  # handed off twice
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher)
    assert sorted(inbox_jobs(client, "w1") + inbox_jobs(client, "w2")) == ["dup"]
    assert dispatcher.counts["duplicates"] == 1
    assert client.xpending(PREPARED_STREAM, GROUP)["pending"] == 0


def test_a_dispatcher_dead_between_inbox_write_and_ack_does_not_route_twice(env):
    settings, client, jobstate = env
    beat(client, "w1")
    beat(client, "w2")
    submit(client, jobstate, prepared("once"))
    crashed = Dispatcher(settings, client, consumer="old")
    crashed.refresh_workers()
    crashed._read(block_ms=10)  # its own pending entries (none)
    ((_entry_id, job),) = crashed._read(block_ms=10)
    crashed.place(job)  # in an inbox, then "crash" before the ack
    successor = Dispatcher(settings, client, consumer="new", claim_idle_ms=0)
    run(successor)
    assert sorted(inbox_jobs(client, "w1") + inbox_jobs(client, "w2")) == ["once"]
    assert client.xpending(PREPARED_STREAM, GROUP)["pending"] == 0


def test_a_worker_routed_to_before_it_re_joined_is_recovered_when_it_dies(env):
    """After a Redis outage a worker's heartbeat thread may beat again before its loop re-joins
    the worker set; jobs routed to it then must be recovered if it dies in between."""
    settings, client, jobstate = env
    beat(client, "back")
    client.srem(WORKERS_KEY, "back")  # recovered as dead during the outage, not re-joined yet
    submit(client, jobstate, prepared("held"))
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher)
    assert inbox_jobs(client, "back") == ["held"]
    client.delete(heartbeat_key("back"))  # it dies before its loop re-joins
    beat(client, "other")
    run(dispatcher)
    assert inbox_jobs(client, "other") == ["held"]
    assert jobstate.get("held")["worker_id"] == "other"


def test_recovery_reads_only_the_dead_workers_unfinished_entries(env, caplog):
    settings, client, jobstate = env
    beat(client, "alive")
    client.sadd(WORKERS_KEY, "dead")
    stream = inbox_stream("dead")
    client.xgroup_create(stream, "workers", id="0", mkstream=True)
    for i in range(100):  # its history: read and acked (finished) jobs
        send_to_inbox(client, "dead", prepared(f"old-{i}"))
    for _, entries in client.xreadgroup("workers", "dead", {stream: ">"}, count=100):
        client.xack(stream, "workers", *[entry_id for entry_id, _ in entries])
    for job_id in ("read", "unread"):
        jobstate.create(job_id)
        jobstate.record_event(JobEvent(job_id=job_id, status="waiting", at=time.time()))
    send_to_inbox(client, "dead", prepared("read"))
    client.xreadgroup("workers", "dead", {stream: ">"}, count=1)  # pending: read, never acked
    send_to_inbox(client, "dead", prepared("unread"))  # never read
    dispatcher = Dispatcher(settings, client, consumer="d")
    with caplog.at_level("WARNING", logger="backend.dispatch.service"):
        run(dispatcher)
    assert sorted(inbox_jobs(client, "alive")) == ["read", "unread"]
    assert dispatcher.counts["redispatched"] == 2
    assert "worker dead is gone: 2 inbox entries recovered" in caplog.text
    record = jobstate.get("read")
    assert record["redeliveries"] == 1 and record["message"] == "worker dead stopped; re-dispatched"


def test_a_job_redispatched_too_often_fails_and_others_flow(env):
    settings, client, jobstate = env
    beat(client, "alive")
    jobstate.create("poison")
    limit = settings.dispatcher.max_redeliveries
    dispatcher = Dispatcher(settings, client, consumer="d")
    for attempt in range(limit + 1):  # each worker it reaches dies
        dead = f"dead-{attempt}"
        client.sadd(WORKERS_KEY, dead)
        jobstate.record_event(JobEvent(job_id="poison", status="running", at=time.time()))
        send_to_inbox(client, dead, prepared("poison"))
        run(dispatcher, times=1)
    record = jobstate.get("poison")
    assert record["status"] == "failed" and record["redeliveries"] == limit
    assert "giving up" in record["message"]
    submit(client, jobstate, prepared("next"))
    run(dispatcher)
    assert inbox_jobs(client, "alive")[-1] == "next"


def test_a_job_no_live_worker_serves_says_so_once_then_is_routed(env):
    settings, client, jobstate = env
    submit(client, jobstate, prepared("lonely"))
    dispatcher = Dispatcher(settings, client, consumer="d")
    run(dispatcher, times=5)
    alone = f"waiting for a worker that serves {MODEL} (no worker is live)"

    def told() -> list[str]:
        return [e["message"] for _, e in jobstate.events("lonely") if e.get("message")]

    assert told() == [alone]  # once, not at every retry
    record = jobstate.get("lonely")
    assert record["status"] == "waiting" and record["message"] == alone
    beat(client, "flux-worker", model_id="tiny-flux-fill")  # the live models changed: said again
    run(dispatcher, times=5)
    others = f"waiting for a worker that serves {MODEL} (live workers serve: tiny-flux-fill)"
    assert told() == [alone, others] and jobstate.get("lonely")["message"] == others
    beat(client, "late-worker")
    run(dispatcher)
    assert inbox_jobs(client, "late-worker") == ["lonely"]
    routed = f"routed to worker late-worker, which serves {MODEL}"
    assert told() == [alone, others, routed]  # the message says nothing stale
    assert jobstate.get("lonely")["message"] == routed

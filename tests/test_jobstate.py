"""Job state store against a real Redis: forward-only status, first terminal status wins, events."""

from __future__ import annotations

import time

import pytest

from backend.config_operations import MIN_JOB_RECORD_S, RetentionSettings
from backend.history import HistoryIndex
from backend.jobstate import (
    EXHAUSTED,
    NOTHING_TO_REDO,
    REQUEUED,
    JobNotFound,
    JobStateStore,
)
from backend.protocol import JobEvent
from backend.protocol.keys import history_key, job_key
from backend.protocol.keys import job_events_key as events_key


def event(job_id, status, **fields):
    return JobEvent(job_id=job_id, status=status, at=time.time(), **fields)


@pytest.fixture
def store(redis_client):
    return JobStateStore(redis_client)


def test_a_job_moves_through_its_states_with_steps_timings_and_refs(store):
    store.create("j1", model_id="tiny-sd2-inpaint", seed=42, prompt="a vase")
    assert store.get("j1")["status"] == "queued"
    for status in ("preprocessing", "waiting"):
        assert store.record_event(event("j1", status))
    for step in range(1, 4):
        assert store.record_event(event("j1", "running", step=step, num_steps=3, worker_id="w0"))
    store.record_event(event("j1", "postprocessing"))
    store.record_event(
        event(
            "j1",
            "done",
            result_ref="results/j1.png",
            thumbnail_ref="thumbnails/j1.webp",
            timings={"pre_s": 0.5, "denoise_s": 2.0, "post_s": 0.25},
        )
    )
    job = store.get("j1")
    assert (
        job["status"] == "done"
        and job["step"] == 3
        and job["num_steps"] == 3
        and job["worker_id"] == "w0"
    )
    assert job["seed"] == 42 and job["prompt"] == "a vase" and job["result_ref"] == "results/j1.png"
    assert job["timings"] == {"pre_s": 0.5, "denoise_s": 2.0, "post_s": 0.25}
    assert job["queued_at"] <= job["running_at"] <= job["done_at"]
    statuses = [e["status"] for _, e in store.events("j1")]
    assert statuses == [
        "preprocessing",
        "waiting",
        "running",
        "running",
        "running",
        "postprocessing",
        "done",
    ]


def test_a_late_event_of_an_earlier_stage_is_dropped(store):
    store.create("j2")
    store.record_event(event("j2", "running", step=2, num_steps=4))
    assert not store.record_event(event("j2", "preprocessing"))
    assert store.get("j2")["status"] == "running"


def test_the_first_terminal_status_wins(store):
    store.create("j3")
    assert store.record_event(event("j3", "cancelled", message="cancelled by the user"))
    assert not store.record_event(event("j3", "done", result_ref="results/j3.png"))
    assert not store.record_event(event("j3", "running", step=1, num_steps=2))
    job = store.get("j3")
    assert job["status"] == "cancelled" and job["result_ref"] == ""
    assert [e["status"] for _, e in store.events("j3")] == ["cancelled"]


def test_events_of_unknown_jobs_are_dropped(store):
    assert not store.record_event(event("ghost", "running", step=1, num_steps=2))
    with pytest.raises(JobNotFound):
        store.get("ghost")
    assert store.status("ghost") is None


def test_create_is_idempotent(store):
    store.create("j4", prompt="first")
    store.record_event(event("j4", "waiting"))
    store.create("j4", prompt="second")
    job = store.get("j4")
    assert job["status"] == "waiting" and job["prompt"] == "first"


def test_requeue_resets_an_unfinished_job_only(store):
    store.create("j5")
    store.record_event(event("j5", "running", step=3, num_steps=5, worker_id="w1"))
    assert store.requeue("j5", "worker w1 died", 3) == REQUEUED
    job = store.get("j5")
    assert job["status"] == "waiting" and job["step"] == 0 and job["message"] == "worker w1 died"
    assert job["redeliveries"] == 1
    # the way back is said on the event stream, so a client knows why status and step went back
    _, back = store.events("j5")[-1]
    assert back == {
        "status": "waiting",
        "at": back["at"],
        "message": "worker w1 died",
        "redelivered": True,
        "redeliveries": 1,
    }
    store.record_event(event("j5", "done"))
    assert store.requeue("j5", "too late", 3) == NOTHING_TO_REDO
    assert store.status("j5") == "done"


def test_requeue_stops_at_the_bound_and_never_redoes_a_denoised_job(store):
    store.create("poison")
    for _ in range(2):
        store.record_event(event("poison", "running", step=1, num_steps=5))
        assert store.requeue("poison", "worker died", 2) == REQUEUED
    assert store.requeue("poison", "worker died", 2) == EXHAUSTED
    assert store.fail("poison", "stopped its worker 3 times") and store.status("poison") == "failed"
    store.create("denoised")
    store.client.hincrby(job_key("denoised"), "denoised", 1)  # as register_post counts it
    assert store.requeue("denoised", "worker died", 2) == NOTHING_TO_REDO


def test_the_message_tells_the_latest_state(store):
    store.create("m1")
    store.record_event(event("m1", "running", step=1, num_steps=4))
    store.requeue("m1", "worker w1 stopped; re-dispatched", 3)
    assert store.get("m1")["message"] == "worker w1 stopped; re-dispatched"
    store.record_event(event("m1", "waiting"))  # same status, no message: the reason stays
    assert store.get("m1")["message"] == "worker w1 stopped; re-dispatched"
    store.record_event(event("m1", "running", step=1, num_steps=4))  # a new status clears it
    assert store.get("m1")["message"] == ""
    store.record_event(event("m1", "running", step=2, num_steps=4, message="cache unusable"))
    assert store.get("m1")["message"] == "cache unusable"
    store.record_event(event("m1", "done"))
    assert store.get("m1")["message"] == ""


def test_events_read_after_an_id_and_block_for_new_ones(store):
    store.create("j6")
    store.record_event(event("j6", "preprocessing"))
    ((last_id, _),) = store.events("j6")
    assert store.events("j6", after=last_id, block_ms=50) == []
    store.record_event(event("j6", "waiting"))
    assert [e["status"] for _, e in store.events("j6", after=last_id)] == ["waiting"]


def test_a_steps_events_go_in_one_round_trip_and_keep_the_rules(store):
    store.create("a")
    store.create("b")
    store.record_event(event("b", "done"))
    applied = store.record_events(
        [
            event("a", "running", step=1, num_steps=2),
            event("b", "running", step=1, num_steps=2),
            event("ghost", "running", step=1, num_steps=2),
        ]
    )
    assert applied == [True, False, False]
    assert store.get("a")["step"] == 1 and store.status("b") == "done"


def test_assign_records_the_worker_of_an_unfinished_job_only(store):
    store.create("as1")
    assert store.assign("as1", "w3", "routed") and store.get("as1")["worker_id"] == "w3"
    assert store.get("as1")["message"] == "routed"
    store.record_event(event("as1", "failed", message="boom"))
    assert not store.assign("as1", "w4") and store.get("as1")["worker_id"] == "w3"
    assert not store.assign("ghost", "w1")


def test_a_job_in_post_processing_is_not_requeued(store):
    store.create("pp")
    store.record_event(event("pp", "postprocessing"))
    assert store.requeue("pp", "worker died", 3) == NOTHING_TO_REDO
    assert store.status("pp") == "postprocessing"


@pytest.mark.parametrize(
    "results_hours, ttl_s", [(24.0, MIN_JOB_RECORD_S), (24.0 * 30, 30 * 24 * 3600), (0.0, 0)]
)
def test_a_finished_jobs_record_lives_as_long_as_its_results_are_kept(
    redis_client, results_hours, ttl_s
):
    retention = RetentionSettings(results_hours=results_hours)
    assert retention.job_record_s == ttl_s
    store = JobStateStore(redis_client, retention.job_record_s)
    store.create("kept")
    store.record_event(event("kept", "running", step=1, num_steps=2))
    assert redis_client.ttl(job_key("kept")) == -1  # a job in flight never expires
    store.record_event(event("kept", "done", result_ref="results/kept.png"))
    for key in (job_key("kept"), events_key("kept")):
        remaining = redis_client.ttl(key)
        assert remaining == -1 if ttl_s == 0 else ttl_s - 5 <= remaining <= ttl_s
    history = HistoryIndex(redis_client, limit=10, ttl_s=retention.job_record_s)
    history.add("alice", "kept", time.time())
    remaining = redis_client.ttl(history_key("alice"))
    assert remaining == -1 if ttl_s == 0 else ttl_s - 5 <= remaining <= ttl_s


def test_a_negative_record_ttl_is_refused(redis_client):
    with pytest.raises(ValueError, match="0 keeps records forever"):
        JobStateStore(redis_client, -1)


def test_the_record_gives_every_field_its_type(redis_client):
    """What the API shows of a job is typed once (``JobRecord``): numbers are numbers, flags are
    booleans, mask operations a dict, whatever the hash stores as text."""
    store = JobStateStore(redis_client)
    store.create(
        "typed",
        steps=20,
        seed=7,
        guidance=7.5,
        use_cache=False,
        mask_ops={"grow_px": 3},
        width=640,
    )
    job = store.get("typed")
    assert (job["steps"], job["seed"], job["guidance"], job["width"]) == (20, 7, 7.5, 640)
    assert job["use_cache"] is False and job["mask_ops"] == {"grow_px": 3}
    assert job["status"] == "queued" and job["queued_at"] == job["created_at"]
    with pytest.raises(TypeError):
        store.create("bad", no_such_field=1)


def test_a_worker_the_job_was_taken_from_writes_nothing_more(store):
    """A worker cut off past its heartbeat keeps stepping; what it writes when the link heals must
    not overwrite the state the job's new worker writes (the record's worker_id fences it)."""
    store.create("cut")
    assert store.assign("cut", "w0")
    assert store.record_event(event("cut", "running", step=1, num_steps=4, worker_id="w0"))
    assert store.requeue("cut", "worker w0 stopped; re-dispatched", 3) == REQUEUED
    assert not store.record_event(event("cut", "running", step=2, num_steps=4, worker_id="w0"))
    assert store.assign("cut", "w1")
    assert store.record_event(event("cut", "running", step=1, num_steps=4, worker_id="w1"))
    assert not store.record_event(event("cut", "postprocessing", worker_id="w0"))
    job = store.get("cut")
    assert job["status"] == "running" and job["step"] == 1 and job["worker_id"] == "w1"
    assert store.record_event(event("cut", "postprocessing"))  # CPU tasks name no worker
    statuses = [e.get("worker_id") for _, e in store.events("cut") if e["status"] == "running"]
    assert statuses == ["w0", "w1"]

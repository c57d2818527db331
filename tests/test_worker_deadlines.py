"""Deadline scheduling through the engine worker on the tiny SD2 model: a row parked at a step
boundary for a tighter one resumes from the same step with bit-identical latents; events carry
the forecast; a recording row is never parked."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from backend.blobs import BlobStore
from backend.protocol import ServiceLevel
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.deadlines import DeadlinePlan
from backend.worker.finish_tail import FinishTail
from backend.worker.loop import EngineWorker
from backend.worker.step_clock import StepClock
from tests.factories import MASK, make_engine, make_params, make_prepared_job, make_template
from tests.test_worker import final_latents

pytestmark = [pytest.mark.model, pytest.mark.slow]

STEPS = 8
STEP_S = 0.01  # the plan's predicted seconds per row and step (real steps are slower: no matter)


@pytest.fixture(scope="module")
def engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("deadline-cache"))


def make_worker(engine, tmp_path, plan=None, clock=None, forecast_refresh_s=0.0, tail=None):
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    worker = EngineWorker(
        engine,
        blobs,
        inbox,
        sink,
        max_batch=1,
        plan=plan,
        clock=clock,
        forecast_refresh_s=forecast_refresh_s,
        finish_tail=tail,
    )
    return worker, inbox, sink, blobs


def slack_plan(**overrides):
    fields = dict(
        scheduler="slack",
        round_steps=2,
        max_wait_s=1000.0,
        max_parks_per_round=1,
        step_time=lambda rows: STEP_S * len(rows),
    )
    return DeadlinePlan(**{**fields, **overrides})


def job(engine, blobs, job_id, seed, deadline_in_s, service_class="batch"):
    params = make_params(engine, steps=STEPS, use_cache=False)
    message = make_prepared_job(engine, blobs, job_id, make_template(), MASK, seed, params)
    level = ServiceLevel(service_class, time.time() + deadline_in_s, 0)
    return replace(message, service=level)


def drain(worker, limit=200):
    for _ in range(limit):
        worker.iterate()
        if worker.scheduler.idle:
            return
    raise AssertionError("the worker did not drain")


def messages_of(sink, job_id):
    return [e.message for e in sink.events if e.job_id == job_id and e.message]


def test_a_parked_row_resumes_from_its_step_with_bit_identical_latents(engine, tmp_path):
    alone, inbox, sink, blobs = make_worker(engine, tmp_path / "alone")
    inbox.put(job(engine, blobs, "loose", 11, 1000.0))
    drain(alone)
    reference = final_latents(blobs, sink, "loose")

    worker, inbox, sink, blobs = make_worker(engine, tmp_path / "parked", slack_plan())
    inbox.put(job(engine, blobs, "loose", 11, 1000.0))
    for _ in range(3):  # loose runs alone for a few steps
        worker.iterate()
    inbox.put(job(engine, blobs, "tight", 12, 0.05, "interactive"))
    drain(worker)
    assert worker.stats.parks == 1 and worker.stats.resumes == 1
    parked = [m for m in messages_of(sink, "loose") if m.startswith("parked at step")]
    resumed = [m for m in messages_of(sink, "loose") if m.startswith("resumed at step")]
    assert len(parked) == 1 and parked[0].split()[3].rstrip(":") == resumed[0].split()[-1]
    order = [j.job_id for j in sink.denoised_jobs]
    assert order == ["tight", "loose"]  # the tight row finished first
    # each hands its service level on, so post-processing queues it in the same order
    assert [j.service.service_class for j in sink.denoised_jobs] == ["interactive", "batch"]
    assert torch.equal(final_latents(blobs, sink, "loose"), reference)
    steps = [e.step for e in sink.events if e.job_id == "loose" and e.status == "running"]
    assert max(steps) == STEPS  # no step run twice, none skipped: it ended at its last step


def test_fifo_never_parks_and_the_tight_row_waits(engine, tmp_path):
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, slack_plan(scheduler="fifo"))
    inbox.put(job(engine, blobs, "loose", 11, 1000.0))
    worker.iterate()
    inbox.put(job(engine, blobs, "tight", 12, 0.05, "interactive"))
    drain(worker)
    assert worker.stats.parks == 0
    assert [j.job_id for j in sink.denoised_jobs] == ["loose", "tight"]


def test_events_carry_the_forecast(engine, tmp_path):
    clock = StepClock(None, initial_row_s=STEP_S)
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, slack_plan(step_time=clock), clock)
    inbox.put(job(engine, blobs, "first", 1, 1000.0))
    inbox.put(job(engine, blobs, "second", 2, 1000.0))
    worker.iterate()
    told = [e for e in sink.events if e.job_id == "second" and e.status == "waiting"]
    assert told[-1].queue_position == 1
    assert told[-1].predicted_finish > told[-1].predicted_start > time.time() - 1
    drain(worker)
    running = [e for e in sink.events if e.job_id == "first" and e.status == "running" and e.step]
    assert all(e.predicted_finish > 0 for e in running)
    assert clock.scale != 1.0 and clock.shape  # measured steps calibrated the clock
    assert worker.stats.snapshot()["parks_total"] == 0


@pytest.mark.parametrize("refresh_s", [0.0, 3600.0])
def test_the_worker_runs_its_forecast_once_per_refresh_interval(engine, tmp_path, refresh_s):
    clock = StepClock(None, initial_row_s=STEP_S)
    worker, inbox, sink, blobs = make_worker(
        engine, tmp_path, slack_plan(step_time=clock), clock, forecast_refresh_s=refresh_s
    )
    made_at = []
    forecast = worker.scheduler.forecast

    def counted(now, step_time=None):
        made_at.append(now)
        return forecast(now, step_time)

    worker.scheduler.forecast = counted
    inbox.put(job(engine, blobs, "first", 1, 1000.0))
    inbox.put(job(engine, blobs, "second", 2, 1000.0))
    iterations = 0
    while not worker.scheduler.idle or not iterations:
        worker.iterate()
        iterations += 1
    # every iteration, or once an hour: the first iteration's forecast serves the whole run
    assert len(made_at) == (iterations if refresh_s == 0 else 1)
    told = [e for e in sink.events if e.job_id == "second" and e.status == "waiting"]
    assert told and told[-1].queue_position == 1  # the waiting row heard its forecast either way
    assert {d.job_id for d in sink.denoised_jobs} == {"first", "second"}


def measured_tail(seconds: float) -> FinishTail:
    tail = FinishTail()
    tail.handed_on("earlier", 0.0)
    tail.resolve("earlier", seconds, ended=True)
    return tail


@pytest.mark.parametrize("tail_s", [None, 4.95])
def test_a_row_is_planned_to_end_its_finish_tail_before_its_deadline(engine, tmp_path, tail_s):
    """Due in 5 s, the tight row has seconds of slack at the deadline itself and waits for the
    loose row; with a measured tail of 4.95 s it must end its steps now, and the loose row is
    parked for it."""
    tail = None if tail_s is None else measured_tail(tail_s)
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, slack_plan(), tail=tail)
    inbox.put(job(engine, blobs, "loose", 11, 1000.0))
    for _ in range(3):  # a planning round is due
        worker.iterate()
    inbox.put(job(engine, blobs, "tight", 12, 5.0, "interactive"))
    drain(worker)
    order = [j.job_id for j in sink.denoised_jobs]
    assert order == (["loose", "tight"] if tail is None else ["tight", "loose"])
    assert worker.stats.parks == (0 if tail is None else 1)
    if tail is not None:  # and it went on measuring: both jobs were handed on
        assert set(tail.unresolved(time.time())) == {"loose", "tight"}


def test_a_row_recording_its_templates_cache_is_never_parked(engine, tmp_path):
    from backend.cache import TieredActivationCache

    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    caches = TieredActivationCache(tmp_path / "cache", 1 << 30, 1 << 30)
    worker = EngineWorker(engine, blobs, inbox, sink, max_batch=1, caches=caches, plan=slack_plan())
    params = make_params(engine, steps=STEPS, use_cache=True)
    first = make_prepared_job(engine, blobs, "records", make_template(3), MASK, 1, params)
    inbox.put(replace(first, service=ServiceLevel("batch", time.time() + 1000.0)))
    worker.iterate()
    assert worker.jobs["records"].state.writer is not None  # it records its template's cache
    inbox.put(job(engine, blobs, "tight", 12, 0.05, "interactive"))
    drain(worker)
    assert worker.stats.parks == 0
    assert [j.job_id for j in sink.denoised_jobs] == ["records", "tight"]

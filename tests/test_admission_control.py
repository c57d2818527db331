"""Admission control's pure decision (``backend.api.admission_control``): forecasts from workers'
rows under each step scheduler, the deadline and queue bounds, shedding vs accepting late, and an
honest Retry-After. No Redis, no clock: every input is a value."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from backend.api.admission_control import (
    DEFAULT_RETRY_S,
    MAX_RETRY_S,
    NewJob,
    Policy,
    Row,
    WorkerLoad,
    decide,
    drain_s,
    forecast,
)

NOW = 10_000.0
POLICY = Policy(late_factor=2.0, max_queue=100, shed_classes=("batch",), scheduler="slack")


def job(service_class="batch", deadline_s=60.0, priority=0, steps=10) -> NewJob:
    return NewJob(service_class, NOW + deadline_s, priority, steps)


def busy_worker(worker_id="w1", step_s=1.0, max_batch=2, deadline_s=30.0, rows=4) -> WorkerLoad:
    """Two running rows with 10 steps left, then ``rows - 2`` waiting rows of 10 steps, all due
    ``deadline_s`` from now."""
    running = tuple(Row(10, NOW + deadline_s, running=True) for _ in range(min(rows, 2)))
    waiting = tuple(Row(10, NOW + deadline_s) for _ in range(max(0, rows - 2)))
    return WorkerLoad(worker_id, max_batch, step_s, running + waiting)


# ----- within the bounds -----------------------------------------------------------------------
def test_an_idle_worker_starts_the_job_now_and_it_is_accepted_on_time():
    verdict = decide(job(), NOW, [WorkerLoad("w1", 4, 0.5)], [], 0, POLICY)
    assert verdict.accept and not verdict.late and verdict.reason == ""
    assert verdict.forecast.start == NOW and verdict.forecast.finish == NOW + 5.0
    assert verdict.retry_after_s == 0 and verdict.message == ""


def test_rows_due_earlier_go_first_and_the_job_waits_for_a_free_slot():
    # 4 rows due in 30 s, 2 slots: the slots free at 10 s and 20 s; the job (due in 60 s) waits
    predicted = forecast(job(deadline_s=60.0), NOW, [busy_worker()])
    assert predicted.ahead == 4
    assert predicted.start == pytest.approx(NOW + 20.0)
    assert predicted.finish == pytest.approx(NOW + 30.0)
    assert decide(job(deadline_s=60.0), NOW, [busy_worker()], [], 0, POLICY).accept


def test_rows_with_a_later_deadline_do_not_delay_it_under_the_slack_scheduler():
    relaxed = busy_worker(deadline_s=3600.0, rows=6)  # every row has slack to spare
    predicted = forecast(job(deadline_s=20.0), NOW, [relaxed])
    assert predicted.ahead == 0 and predicted.start == NOW  # a row is parked for it
    verdict = decide(job(deadline_s=20.0), NOW, [relaxed], [], 0, POLICY)
    assert verdict.accept and not verdict.late


def test_under_fifo_every_row_goes_first_and_under_edf_every_running_row():
    relaxed = busy_worker(deadline_s=3600.0, rows=6)
    fifo = forecast(job(deadline_s=20.0), NOW, [relaxed], policy=Policy(scheduler="fifo"))
    edf = forecast(job(deadline_s=20.0), NOW, [relaxed], policy=Policy(scheduler="edf"))
    assert fifo.ahead == 6 and fifo.start == pytest.approx(NOW + 30.0)
    assert edf.ahead == 2 and edf.start == pytest.approx(NOW + 10.0)  # running rows keep slots
    with pytest.raises(ValueError, match="scheduler"):
        forecast(job(), NOW, [relaxed], policy=Policy(scheduler="lifo"))


def test_a_higher_priority_row_goes_first_whatever_its_deadline():
    rows = (Row(10, NOW + 3600.0, priority=5, running=True),)
    worker = WorkerLoad("w1", 1, 1.0, rows)
    assert forecast(job(priority=0), NOW, [worker]).start == pytest.approx(NOW + 10.0)
    assert forecast(job(priority=5), NOW, [worker]).start == NOW  # same priority: less slack
    assert forecast(job(priority=9), NOW, [worker]).start == NOW


def test_a_row_without_deadline_never_delays_a_job_with_one():
    worker = WorkerLoad("w1", 1, 1.0, (Row(50, 0.0, running=True),))
    assert forecast(job(), NOW, [worker]).start == NOW


def test_a_parked_row_counts_its_remaining_steps():
    rows = (Row(4, NOW + 10.0),)  # waiting with 4 steps left (parked at step 6 of 10)
    predicted = forecast(job(deadline_s=60.0), NOW, [WorkerLoad("w1", 1, 1.0, rows)])
    assert predicted.start == pytest.approx(NOW + 4.0)


def test_the_forecast_is_the_worker_where_it_finishes_first():
    slow_idle = WorkerLoad("a", 2, 3.0)  # 10 steps x 3 s = 30 s
    fast_busy = busy_worker("b", step_s=1.0, rows=2)  # free at 10 s, then 10 s
    predicted = forecast(job(deadline_s=60.0), NOW, [slow_idle, fast_busy])
    assert predicted.worker_id == "b" and predicted.finish == pytest.approx(NOW + 20.0)


def test_a_workers_finish_tail_is_part_of_the_job_and_of_how_it_ranks_there():
    # idle: done after its 10 steps and the worker's tail
    tailed = WorkerLoad("w0", 4, 0.5, finish_tail_s=0.3)
    predicted = forecast(job(), NOW, [tailed])
    assert predicted.start == NOW and predicted.finish == pytest.approx(NOW + 5.3)
    # the tail decides between otherwise equal workers
    assert forecast(job(), NOW, [tailed, WorkerLoad("w1", 4, 0.5)]).worker_id == "w1"
    # the worker's rows carry deadlines its tail (2 s) before their jobs': a waiting row whose job
    # is due after the new job's (31 s against 30 s) goes after it, as the worker will rank them
    waiting = (Row(10, NOW + 31.0 - 2.0),)
    ranked = forecast(job(deadline_s=30.0), NOW, [WorkerLoad("w0", 1, 1.0, waiting, 2.0)])
    assert ranked.start == NOW and ranked.ahead == 0
    unranked = forecast(job(deadline_s=30.0), NOW, [WorkerLoad("w0", 1, 1.0, waiting, 0.0)])
    assert unranked.start == NOW + 10.0  # without the tail the job looks looser: the row first


def test_unplaced_jobs_that_precede_it_take_the_first_free_slots_on_any_worker():
    idle = [WorkerLoad("a", 1, 1.0), WorkerLoad("b", 1, 1.0)]
    earlier = [Row(10, NOW + 15.0), Row(10, NOW + 15.0), Row(10, NOW + 15.0)]
    later = [Row(10, NOW + 9_000.0)] * 5
    predicted = forecast(job(deadline_s=60.0), NOW, idle, earlier + later)
    # three earlier jobs on two slots: one slot frees at 10 s, the other at 20 s
    assert predicted.ahead == 3 and predicted.start == pytest.approx(NOW + 10.0)


def test_no_worker_or_no_step_time_means_no_forecast_and_no_refusal_on_prediction():
    assert forecast(job(), NOW, []) is None
    assert forecast(job(), NOW, [WorkerLoad("w1", 2, 0.0)]) is None
    verdict = decide(job(deadline_s=1.0, steps=150), NOW, [], [Row(150)] * 50, 0, POLICY)
    assert verdict.accept and not verdict.late and verdict.forecast is None


# ----- the starvation bound ----------------------------------------------------------------------
BOUNDED = Policy(scheduler="slack", round_steps=5, max_wait_s=60.0)


def loose_queue(waited_s=0.0, due=False) -> WorkerLoad:
    """One slot: a running row with 10 steps left and a waiting row of 10 steps, both due in an
    hour; the waiting row has waited ``waited_s`` (the worker found it ``due`` or not)."""
    rows = (Row(10, NOW + 3600.0, running=True), Row(10, NOW + 3600.0, due=due, waited_s=waited_s))
    return WorkerLoad("w1", 1, 1.0, rows)


@pytest.mark.parametrize("scheduler", ["slack", "edf"])
def test_a_row_due_for_the_starvation_bound_goes_before_a_tighter_job(scheduler):
    policy = replace(BOUNDED, scheduler=scheduler)
    start = 0.0 if scheduler == "slack" else 10.0  # slack parks the loose running row for it
    fresh = forecast(job(deadline_s=20.0), NOW, [loose_queue()], policy=policy)
    assert fresh.start == pytest.approx(NOW + start)
    # the worker reported the row due, or its wait passes the bound before the worker's next
    # round (slack: 5 steps, edf: its next step; one to spare; 1 s a step): it goes first,
    # whatever the job's slack
    for queue in (loose_queue(due=True), loose_queue(waited_s=59.0)):
        late = forecast(job(deadline_s=20.0), NOW, [queue], policy=policy)
        assert late.start == pytest.approx(NOW + start + 10.0) and late.ahead == fresh.ahead + 1
    within = forecast(job(deadline_s=20.0), NOW, [loose_queue(waited_s=53.0)], policy=policy)
    assert within.start == fresh.start
    # without a bound a long wait changes nothing
    unbounded = replace(policy, max_wait_s=math.inf)
    assert forecast(job(deadline_s=20.0), NOW, [loose_queue(1e6)], policy=unbounded) == fresh


def test_the_rows_a_heartbeat_reports_wait_on_until_the_decision():
    from backend.api.admission import worker_load
    from backend.protocol import RunningRow, WaitingRow, WorkerHeartbeat

    beat = WorkerHeartbeat(
        "w1",
        "tiny-sd2-inpaint",
        "cpu",
        at=NOW - 5.0,
        max_batch=1,
        batching="continuous",
        running=[RunningRow("a", 0.1, 10, deadline=NOW + 3600.0, due=True)],
        waiting=[WaitingRow("b", 0.1, 10, deadline=NOW + 3600.0, waited_s=50.0, step=4)],
    )
    running, waiting = worker_load(beat, 1.0, NOW).rows
    assert running.running and running.due
    assert waiting.waited_s == pytest.approx(55.0) and not waiting.due
    assert waiting.remaining_steps == 6
    # 55 s by now, within a round of the 60 s bound: it goes before a tight job
    predicted = forecast(job(deadline_s=20.0), NOW, [worker_load(beat, 1.0, NOW)], policy=BOUNDED)
    assert predicted.start == pytest.approx(NOW + 16.0)


def test_a_step_estimate_copies_no_cache_of_a_template_on_the_workers_device():
    """The step time admission forecasts with reads the rows whose templates a worker holds on
    its device as routing does (``RoutingCostModel.step_latency``): masked, with no copy."""
    from backend.api.admission import NEW_JOB_TEMPLATE, StepTimes
    from backend.config import load_settings
    from backend.protocol import RunningRow, WorkerHeartbeat

    def beat(**tiers) -> WorkerHeartbeat:
        rows = [RunningRow("a", 0.1, 10, "t0"), RunningRow("b", 0.2, 10, "t1")]
        return WorkerHeartbeat(
            "w1", "small-flux-fill", "cpu", NOW, 4, "continuous", running=rows, **tiers
        )

    steps, new = StepTimes(load_settings(env={})), (0.1, NEW_JOB_TEMPLATE, True)
    in_ram = steps.step_s(beat(resident_ram=["t0", "t1"]), new)
    on_device = steps.step_s(beat(resident_device=["t0", "t1"]), new)
    model = steps.cost_model("small-flux-fill", "cpu")
    rows = [(0.1, "t0", True), (0.2, "t1", True), new]
    assert on_device == model.step_latency(rows, frozenset({"t0", "t1"})) and on_device < in_ram


# ----- the deadline bound ------------------------------------------------------------------------
def test_far_past_its_deadline_a_shed_class_is_refused_with_reason_and_retry_after():
    crowded = busy_worker(deadline_s=5.0, rows=8)  # 8 rows due in 5 s: 40 s of work on 2 slots
    verdict = decide(job(deadline_s=10.0), NOW, [crowded], [], 3, POLICY)
    assert not verdict.accept and not verdict.late and verdict.reason == "deadline"
    assert verdict.forecast.start == pytest.approx(NOW + 40.0)
    assert verdict.forecast.finish == pytest.approx(NOW + 50.0)
    # a job submitted once the 40 s ahead drained to 10 s meets 2 x its 10 s
    assert verdict.retry_after_s == 30
    for words in ("predicted to finish in 50 s", "2 x the 10 s", "Retry in 30 s", "interactive"):
        assert words in verdict.message, (words, verdict.message)


def test_a_class_not_shed_is_accepted_late_with_the_reason():
    crowded = busy_worker(deadline_s=5.0, rows=8)
    verdict = decide(job("interactive", deadline_s=10.0), NOW, [crowded], [], 3, POLICY)
    assert verdict.accept and verdict.late and verdict.reason == "deadline"
    assert verdict.retry_after_s == 0 and verdict.message.startswith("accepted late")


def test_just_within_the_late_factor_is_accepted_on_time():
    worker = WorkerLoad("w1", 1, 1.0, (Row(10, NOW + 5.0, running=True),))
    verdict = decide(job(deadline_s=10.0), NOW, [worker], [], 0, POLICY)  # finishes at 20 s
    assert verdict.accept and not verdict.late
    tighter = Policy(late_factor=1.5, max_queue=100, shed_classes=("batch",))
    assert not decide(job(deadline_s=10.0), NOW, [worker], [], 0, tighter).accept


def test_a_job_too_long_for_its_own_deadline_is_told_to_give_a_longer_one():
    verdict = decide(job(deadline_s=2.0, steps=50), NOW, [WorkerLoad("w1", 4, 1.0)], [], 0, POLICY)
    assert not verdict.accept and verdict.reason == "deadline"
    assert "give deadline_s of at least 25" in verdict.message
    assert verdict.retry_after_s == 1  # nothing ahead: waiting does not help, a longer deadline


def test_every_class_shed_suggests_no_other_class():
    crowded = busy_worker(deadline_s=5.0, rows=8)
    both = Policy(2.0, 100, ("interactive", "batch"))
    verdict = decide(job("interactive", deadline_s=10.0), NOW, [crowded], [], 0, both)
    assert not verdict.accept and "class" not in verdict.message.split("Retry")[1]


# ----- the queue bound ---------------------------------------------------------------------------
def test_a_full_queue_refuses_a_shed_class_and_says_when_it_drains():
    workers = [WorkerLoad("a", 4, 0.5), WorkerLoad("b", 4, 0.5)]
    verdict = decide(job(), NOW, workers, [], 105, POLICY)
    assert not verdict.accept and verdict.reason == "queue"
    # 6 jobs over the bound; 2 workers x 4 slots start 8 jobs per 10 steps x 0.5 s
    assert verdict.retry_after_s == 4  # ceil(6 / 1.6)
    assert "105 jobs are accepted and not running yet, the bound is 100" in verdict.message


def test_the_queue_bound_applies_without_workers_and_to_any_class():
    refused = decide(job(), NOW, [], [], 100, POLICY)
    assert not refused.accept and refused.retry_after_s == DEFAULT_RETRY_S
    late = decide(job("interactive"), NOW, [], [], 100, POLICY)
    assert late.accept and late.late and late.reason == "queue"
    assert decide(job(), NOW, [], [], 99, POLICY).accept


def test_retry_after_is_bounded_and_whole():
    assert drain_s(5, 10, []) is None
    huge = decide(job(), NOW, [WorkerLoad("w1", 1, 1e9)], [], 10_000, POLICY)
    assert huge.retry_after_s == MAX_RETRY_S


def test_the_module_is_pure():
    """No Redis, no model library: the import guard's probe, in a fresh interpreter."""
    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys, backend.api.admission_control; "
        "print([m for m in ('redis', 'torch', 'fastapi') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"

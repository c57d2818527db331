"""The slack scheduler sizing its batch (a row kept out of a free slot while joining would make a
tighter running row late) and shrinking it (rows with slack to spare parked so that a late running
row is on time): pure scenarios, no torch, no clock. The rest of the scheduler:
``test_deadlines.py``."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from backend.worker.batch_rows import Row
from backend.worker.batching import BatchScheduler
from tests.deadline_factory import (
    KEY,
    by_size,
    constant,
    make_plan,
    make_row,
    sizing_scheduler,
)


# ----- slack: batch sizing ---------------------------------------------------------------------
def test_a_loose_row_waits_while_joining_would_make_a_tighter_running_row_late():
    s = sizing_scheduler()
    s.add(make_row("loose", steps=10, deadline=1000.0))
    now, deferred, joined, tight_ended = 0.0, 0, None, None
    while s.running:
        now += 1.0 + len(s.running)  # this step's time
        if "tight" in [r.job_id for r in s.update_from_output(list(s.running))]:
            tight_ended = now
        out = s.schedule(now)
        deferred += out.deferred == ["loose"]
        joined = now if "loose" in out.admitted else joined
    # alone for 9 steps (2 s each); at 18 one step is left, and 3 s beside "loose" still ends at 21
    assert deferred == 8 and joined == pytest.approx(18.0)
    assert tight_ended == pytest.approx(21.0)  # by its deadline


def test_without_sizing_the_free_slot_is_filled_and_the_tight_row_is_late():
    s = sizing_scheduler(size_batches=False)
    s.add(make_row("loose", steps=10, deadline=1000.0))
    out = s.schedule(0.0)
    assert out.admitted == ["loose"] and out.deferred == []


@pytest.mark.parametrize("plan_quantile, joins", [(0.0, True), (0.9, False)])
def test_on_a_noisy_machine_the_plan_keeps_the_headroom_the_noise_needs(plan_quantile, joins):
    from backend.worker.step_clock import StepClock

    clock = StepClock(None, initial_row_s=0.1, plan_quantile=plan_quantile)
    for i in range(300):  # three steps in ten run 1.6 x slower: a machine whose speed moves
        clock.observe([make_row("seen")], 0.1 * (1.6 if i % 10 < 3 else 1.0))
    s = BatchScheduler(4, plan=make_plan(step_time=clock.planned))
    pair = [make_row("tight", steps=10), make_row("loose", steps=10)]
    # on time beside one more row at the predicted step time, with 10% to spare
    tight_deadline = 10 * clock(pair) * 1.1
    s.add(make_row("tight", steps=10, deadline=tight_deadline))
    assert s.schedule(0.0).admitted == ["tight"]
    s.add(make_row("loose", steps=10, deadline=1000.0))
    out = s.schedule(0.0)
    # planned on the prediction the loose row joins, and a step 10% slower than predicted (three
    # in ten here) makes the tight row late; with the margin it waits
    assert (out.admitted == ["loose"]) is joins and (out.deferred == ["loose"]) is not joins


def test_a_cheaper_row_behind_a_deferred_one_takes_the_slot():
    # the step time is the rows' mask ratios summed: the tight row (0.2) is on time at 0.2 s a
    # step with 1 s to spare, not beside a 0.9 row (2.2 s), but beside a 0.05 row (0.25 s)
    s = BatchScheduler(4, plan=make_plan(step_time=lambda rows: sum(r.mask_ratio for r in rows)))
    s.add(Row("tight", 10, KEY, 0.2, 0.0, deadline=3.0))
    s.schedule(0.0)
    s.add(Row("big", 10, KEY, 0.9, 0.0, deadline=500.0))
    s.add(Row("small", 10, KEY, 0.05, 1.0, deadline=1000.0))
    out = s.schedule(0.0)
    assert out.deferred == ["big"] and out.admitted == ["small"]


@pytest.mark.parametrize(
    "waiting",
    [
        make_row("urgent", steps=10, deadline=45.0),  # under 2 rounds (2 x 3 steps x 3 s) to spare
        make_row("vip", steps=10, deadline=1000.0, priority=1),  # goes before the tight row
        make_row("no-deadline", steps=10),  # infinite slack: waits for the tight row
    ],
    ids=lambda row: row.job_id,
)
def test_who_joins_beside_a_tight_row(waiting):
    s = sizing_scheduler()
    s.add(waiting)
    out = s.schedule(0.0)
    joins = waiting.job_id in ("urgent", "vip")
    assert (out.admitted == [waiting.job_id]) is joins and (out.deferred == []) is joins


def test_a_row_that_would_be_late_beside_the_batch_stays_out_though_its_slack_is_short():
    # "doomed" (10 steps, due at 25) would end at 30 beside "tight" (steps of 3 s), which it
    # cannot displace: joining saves neither, so it waits although it must join now to be on time
    s = sizing_scheduler()
    s.add(make_row("doomed", steps=10, deadline=25.0))
    assert s.schedule(0.0).deferred == ["doomed"]


@pytest.mark.parametrize("deadline, kept_out", [(25.0, True), (19.0, False)])
def test_a_late_running_row_is_not_made_later_while_it_can_still_be_on_time(deadline, kept_out):
    # "tight" (10 steps) ends at 30 beside "loose" (steps of 3 s): late for 25, but on time alone
    # (20 s), so a looser row stays out rather than stretch its steps to 4 s; past saving (due at
    # 19, after 20 s even alone) it protects nothing and the slot is filled
    s = BatchScheduler(
        4, plan=make_plan(step_time=by_size(1.0, 1.0), shrink_batches=False, max_parks=0)
    )
    s.add(make_row("loose", steps=10, deadline=1000.0))
    s.schedule(0.0)
    s.add(make_row("tight", steps=10, deadline=deadline))
    assert s.schedule(0.0).admitted == ["tight"]
    s.add(make_row("looser", steps=10, deadline=2000.0))
    out = s.schedule(0.0)
    assert (out.deferred == ["looser"]) is kept_out and (out.admitted == ["looser"]) is not kept_out


@pytest.mark.parametrize("waited", [25.0, 12.0])
def test_a_row_due_for_the_starvation_bound_joins_beside_a_tight_row(waited):
    # waited 25 s: past the 20 s bound; 12 s: not yet, but it would be by the next round and a
    # step (3 steps of 3 s)
    s = sizing_scheduler(max_wait_s=20.0)
    s.add(make_row("old", steps=10, deadline=1000.0, at=-waited))
    assert s.schedule(0.0).admitted == ["old"]
    s.add(make_row("young", steps=10, deadline=1000.0))  # kept out: it can wait
    assert s.schedule(0.0).deferred == ["young"]


def test_a_step_that_does_not_grow_with_rows_keeps_no_one_out():
    # a launch-bound device: the batch's step time is the same for one row or four
    s = BatchScheduler(4, plan=make_plan(step_time=constant(2.0)))
    s.add(make_row("tight", steps=10, deadline=20.5))
    s.schedule(0.0)
    s.add(make_row("loose", steps=10, deadline=1000.0))
    assert s.schedule(0.0).admitted == ["loose"]


def test_edf_never_keeps_a_slot_free():
    s = sizing_scheduler(scheduler="edf")
    s.add(make_row("loose", steps=10, deadline=1000.0))
    assert s.schedule(0.0).admitted == ["loose"]


# ----- slack: shrinking the batch for a late running row ---------------------------------------
# A step costs 1 s plus 1 s per row. Two loose rows run; a tight row (10 steps, due at 31) joins:
# beside both, steps of 4 s end it at 40; beside one, steps of 3 s end it at 30.
def shrinking_scheduler(max_parks: int = 2, **plan) -> BatchScheduler:
    s = BatchScheduler(4, plan=make_plan(step_time=by_size(1.0, 1.0), max_parks=max_parks, **plan))
    s.add(make_row("loose", steps=10, deadline=2000.0))
    s.add(make_row("loosest", steps=10, deadline=3000.0))
    assert s.schedule(0.0).admitted == ["loose", "loosest"]
    s.add(make_row("tight", steps=10, deadline=31.0))
    return s


def run_to_the_end(s: BatchScheduler, now: float) -> dict[str, float]:
    """Step the batch at ``by_size(1, 1)``'s step times until every row ended; their end times."""
    ended: dict[str, float] = {}
    while s.running or s.waiting:
        now += 1.0 + len(s.running)
        ended.update((r.job_id, now) for r in s.update_from_output(list(s.running)))
        s.schedule(now)
    return ended


def test_the_loosest_row_is_parked_so_a_late_running_row_is_on_time():
    s = shrinking_scheduler()
    out = s.schedule(0.0)
    assert out.admitted == ["tight"] and out.parked == ["loosest"]
    ended = run_to_the_end(s, 0.0)
    assert ended["tight"] <= 31.0  # steps of 3 s beside "loose"; alone in the batch it would be 40
    assert s.parks == s.resumes == 1 and ended["loosest"] <= 3000.0  # it resumed and ended in time


def test_without_shrinking_the_tight_row_ends_late():
    s = shrinking_scheduler(shrink_batches=False)
    assert s.schedule(0.0).parked == []
    assert run_to_the_end(s, 0.0)["tight"] == pytest.approx(40.0)


@pytest.mark.parametrize("max_parks, parked", [(1, []), (2, ["loosest", "loose"])])
def test_as_many_rows_are_parked_as_it_takes_within_the_round_budget(max_parks, parked):
    s = shrinking_scheduler(max_parks=max_parks)
    s.add(make_row("alone", steps=10, deadline=21.0))  # on time only alone: steps of 2 s
    out = s.schedule(0.0)
    # "alone" cannot be saved ("tight" may not sit out for it), so no park is spent on it; beside
    # "alone", "tight" needs both loose rows out: with a budget of one, nobody is parked
    assert out.parked == parked and s._parks_left == max_parks - len(parked)


def test_no_row_is_parked_when_the_tight_row_cannot_be_saved():
    s = shrinking_scheduler()
    s.running["tight"] = s.waiting.pop("tight")  # already running, with a deadline out of reach
    s.running["tight"].deadline = 19.0  # 10 steps alone take 20 s
    s.running["tight"].waiting_since = None
    assert s.schedule(0.0).parked == []


@pytest.mark.parametrize(
    "protect",
    [
        lambda row: setattr(row, "parkable", False),  # recording its template's cache
        lambda row: setattr(row, "wait_s", 400.0),  # starved: never parked again
        lambda row: setattr(row, "priority", 1),  # goes before the tight row
        lambda row: setattr(row, "deadline", 60.0),  # would be late after sitting out
    ],
    ids=["recording", "starved", "priority", "short-slack"],
)
def test_a_row_that_may_not_be_parked_is_passed_over_for_the_next_loosest(protect):
    s = shrinking_scheduler()
    protect(s.running["loosest"])
    assert s.schedule(0.0).parked == ["loose"]


@pytest.mark.parametrize("resumed", [False, True])
def test_a_row_resumed_since_the_last_round_is_not_parked_again(resumed):
    s = shrinking_scheduler()
    s.schedule(0.0)  # parks "loosest" for "tight"
    if resumed:
        s._resumed_since_round.add("loose")  # as if it had resumed in this round
    s.add(make_row("tighter", steps=5, deadline=16.0))  # steps of 4 s beside two, 3 s beside one
    out = s.schedule(0.0)
    # joining, "tighter" makes "tight" late: "loose" is parked for it unless it just resumed; then
    # "loosest" stays out, as it would make "tight" late again (without the park "tight" is late,
    # but on time alone it can still be saved: "loosest" stays out rather than make it later)
    assert out.admitted[0] == "tighter"
    assert (out.parked, out.deferred) == ([] if resumed else ["loose"], ["loosest"])


def test_a_row_that_adds_nothing_to_the_step_is_not_parked():
    # a step costs 1 s plus 2 s per unit of masked area: "loosest" (nothing masked) adds nothing,
    # "loose" and "tight" 1 s each; "tight" (10 steps, due at 25) ends at 30 beside both, at 20
    # beside "loosest" alone: parking "loosest" would cost a park and save no time
    def mask_sum(rows: Sequence[Row]) -> float:
        return 1.0 + 2.0 * sum(row.mask_ratio for row in rows)

    s = BatchScheduler(4, plan=make_plan(step_time=mask_sum))
    s.add(Row("loose", 10, KEY, 0.5, deadline=2000.0))
    s.add(Row("loosest", 10, KEY, 0.0, deadline=3000.0))
    assert s.schedule(0.0).admitted == ["loose", "loosest"]
    s.add(Row("tight", 10, KEY, 0.5, deadline=25.0))
    out = s.schedule(0.0)
    assert out.admitted == ["tight"] and out.parked == ["loose"]
    assert set(s.running) == {"tight", "loosest"}

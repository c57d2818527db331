"""Parks go by deadline (``deadlines.park_by_deadline``): a running row gives its slot up only to a
row due before it, in the worker's planning rounds, its urgent parks and its shrinking, and in
the router's replay of them (pure: no torch, no clock)."""

from __future__ import annotations

import math

import pytest

from backend.config import load_settings
from backend.costmodel.slack import NO_DEADLINE, parks_for
from backend.dispatch.deadline_cost import RowOrder, replay
from backend.worker.batching import BatchScheduler
from backend.worker.deadlines import DeadlinePlan, gives_way, rows_to_park_for
from tests.deadline_factory import by_size, constant, make_plan, make_row


@pytest.mark.parametrize(
    "victim, tight, parks",
    [
        (20.0, 10.0, True),  # due later: gives way
        (10.0, 20.0, False),  # due sooner: keeps its slot
        (10.0, 10.0, False),  # the same deadline: no reason to swap
        (NO_DEADLINE, 10.0, True),  # a row without a deadline is due last
        (10.0, NO_DEADLINE, False),
        (NO_DEADLINE, NO_DEADLINE, False),
    ],
)
def test_a_row_gives_way_only_to_an_earlier_deadline(victim, tight, parks):
    assert parks_for(victim, tight) is parks


def test_without_park_by_deadline_every_row_may_give_way():
    early, late = make_row("early", deadline=10.0), make_row("late", deadline=20.0)
    assert not gives_way(make_plan(), early, late) and gives_way(make_plan(), late, early)
    anyway = make_plan(park_by_deadline=False)
    assert gives_way(anyway, early, late) and gives_way(anyway, late, early)


def urgent_fresh_row(park_by_deadline: bool, fresh_deadline: float) -> list[str]:
    """One slot. ``early`` (10 steps, due at 14) runs from 0; at the round at t=3 (7 steps left,
    slack 4 s) ``fresh`` arrives with 10 steps: due at 15 it has 2 s of slack, less than
    ``early``'s and under two rounds, and no slot frees in time. The rows ``schedule`` parks."""
    s = BatchScheduler(1, plan=make_plan(round_steps=3, park_by_deadline=park_by_deadline))
    s.add(make_row("early", steps=10, deadline=14.0))
    s.schedule(0.0)
    for t in (1.0, 2.0, 3.0):
        s.update_from_output(list(s.running))
        if t < 3.0:
            s.schedule(t)
    s.add(make_row("fresh", steps=10, deadline=fresh_deadline, at=3.0))
    return s.schedule(3.0).parked


def test_a_running_row_keeps_its_slot_from_a_fresher_row_due_after_it():
    assert urgent_fresh_row(park_by_deadline=True, fresh_deadline=15.0) == []
    # parked by slack alone: the fresh row has more steps left, hence less slack
    assert urgent_fresh_row(park_by_deadline=False, fresh_deadline=15.0) == ["early"]


def test_a_running_row_still_gives_way_to_a_row_due_before_it():
    # due at 13.5, before "early" (14): slack 0.5 s, and "early" keeps 4 - 3 >= 0 after a round
    assert urgent_fresh_row(park_by_deadline=True, fresh_deadline=13.5) == ["early"]


@pytest.mark.parametrize(
    "park_by_deadline, victim_deadline, parked",
    [
        (True, 190.0, []),  # due before "tight": it keeps its slot
        (False, 190.0, ["victim"]),  # by precedence alone it sits out safely, so it is parked
        (True, 250.0, ["victim"]),  # due after "tight": parked either way
    ],
)
def test_shrinking_parks_only_rows_due_after_the_late_row(
    park_by_deadline, victim_deadline, parked
):
    """A step costs 1 s plus 10 s per row: running ``tight`` (10 steps, due at 200) ends at 210
    beside ``victim`` (1 step left), at 110 alone; ``victim`` keeps two rounds of slack after
    sitting out tight's steps (190 - 21 - 110 >= 2 x 21), so only the deadlines decide."""
    plan = make_plan(round_steps=1, step_time=by_size(1.0, 10.0), park_by_deadline=park_by_deadline)
    tight = make_row("tight", steps=10, deadline=200.0)
    victim = make_row("victim", steps=1, deadline=victim_deadline)
    chosen = rows_to_park_for(plan, [victim, tight], tight, 0.0, lambda r: True, 2)
    assert [r.job_id for r in chosen] == parked


def test_a_burst_of_rows_with_one_target_ends_more_of_them_on_time_when_parks_go_by_deadline():
    """Rows of one class (10 steps, due 30 s after arrival) arrive two every 3 s, more than a
    worker of 2 slots and 1 s steps serves. By slack alone fresh rows park running rows that were
    on time, which the next arrivals push back until they are late; by deadline nobody is parked
    and the arrival order holds."""

    def on_time(park_by_deadline: bool) -> tuple[int, int]:
        plan = make_plan(
            round_steps=2, max_parks=8, step_time=constant(1.0), park_by_deadline=park_by_deadline
        )
        s = BatchScheduler(2, plan=plan)
        arrivals = {float(t): [f"r{t}-{k}" for k in range(2)] for t in range(0, 18, 3)}
        ended: dict[str, float] = {}
        deadline: dict[str, float] = {}
        now = 0.0
        while now < 200.0 and (now <= max(arrivals) or s.running or s.waiting):
            for job_id in arrivals.get(now, []):
                deadline[job_id] = now + 30.0
                s.add(make_row(job_id, steps=10, deadline=deadline[job_id], at=now))
            s.schedule(now)
            now += 1.0
            ended.update((r.job_id, now) for r in s.update_from_output(list(s.running)))
        assert set(ended) == set(deadline)  # every row ran to its end
        return sum(ended[j] <= deadline[j] for j in ended), s.parks

    assert on_time(True) == (6, 0)  # of 12
    assert on_time(False) == (4, 6)


def test_the_router_replays_parks_by_deadline():
    """J (6 steps, slack 2 s) would park the last ranked running row at the next boundary; with
    the rows' deadlines given, not a row due before J."""
    order = RowOrder("slack", round_steps=4, max_parks_per_round=2, urgent_parks=False)
    slack = {0: 3600.0, 1: 3600.0, 2: 3600.0, -1: -1.0}
    ranked = [-1, 0, 1, 2]
    assert replay([10, 10, 10], 3, ranked, 6, 3, order, slack, 1.0).parked == 1
    sooner = {0: 50.0, 1: 50.0, 2: 50.0, -1: 100.0}  # every running row is due before J
    kept = replay([10, 10, 10], 3, ranked, 6, 3, order, slack, 1.0, deadlines=sooner)
    assert kept.parked == 0 and kept.admit == 10
    one_later = {**sooner, 1: 500.0}  # row 1 is due after J: it is the one parked
    r = replay([10, 10, 10], 3, ranked, 6, 3, order, slack, 1.0, deadlines=one_later)
    assert r.parked == 1 and 1 not in {k for _, k in r.co_runners}
    anyway = RowOrder(
        "slack", round_steps=4, max_parks_per_round=2, urgent_parks=False, park_by_deadline=False
    )
    assert replay([10, 10, 10], 3, ranked, 6, 3, anyway, slack, 1.0, deadlines=sooner).parked == 1


def test_the_setting_reaches_the_plan():
    assert load_settings({}).deadlines.park_by_deadline is True
    settings = load_settings({"MASKSERVE_PARK_BY_DEADLINE": "false"})
    assert settings.deadlines.park_by_deadline is False
    plan = DeadlinePlan.from_settings(settings.deadlines, constant(1.0))
    assert plan.park_by_deadline is False and not math.isnan(plan.step_s([]))

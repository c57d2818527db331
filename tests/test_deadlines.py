"""The deadline-aware step scheduler: fifo unchanged, edf order, slack rounds (parking, resuming,
churn and starvation bounds) and a burst on a fake clock (pure: no torch, no clock). Batch sizing
and shrinking: ``test_batch_sizing.py``; forecasts: ``test_deadline_forecast.py``."""

from __future__ import annotations

import random

import pytest

from backend.config_deadlines import DeadlineSettings
from backend.worker.batch_rows import Row
from backend.worker.batching import BatchScheduler
from backend.worker.deadlines import DeadlinePlan, planned_step_s
from tests.deadline_factory import (
    KEY,
    Harness,
    by_size,
    constant,
    make_plan,
    make_row,
)


# ----- fifo ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fifo_plan_and_no_plan_schedule_alike(seed):
    rng = random.Random(seed)
    plain = BatchScheduler(3)
    fifo = BatchScheduler(3, plan=make_plan("fifo", max_parks=5))
    for tick in range(300):
        if rng.random() < 0.5:
            name, steps = f"j{tick}", rng.randint(1, 6)
            deadline, priority = rng.choice([0.0, tick + 3.0]), rng.randint(0, 3)
            plain.add(make_row(name, steps, at=float(tick)))
            fifo.add(make_row(name, steps, deadline, priority, at=float(tick)))
        if rng.random() < 0.05 and plain.running:
            victim = rng.choice(sorted(plain.running))
            plain.cancel(victim)
            fifo.cancel(victim)
        blocked = {j for j in plain.waiting if rng.random() < 0.2}

        def ready(row, blocked=blocked):
            return row.job_id not in blocked

        a, b = plain.schedule(float(tick), ready), fifo.schedule(float(tick), ready)
        assert (a.admitted, a.groups, a.cancelled, a.held) == (
            b.admitted,
            b.groups,
            b.cancelled,
            b.held,
        )
        assert b.parked == b.resumed == []
        stepped = [j for g in a.groups for j in g]
        assert [r.job_id for r in plain.update_from_output(stepped)] == [
            r.job_id for r in fifo.update_from_output(stepped)
        ]
    assert fifo.counters() == {"parks": 0, "resumes": 0, "rounds": 0}


# ----- edf -------------------------------------------------------------------------------------
def test_edf_admits_by_priority_then_deadline_and_never_displaces_a_running_row():
    h = Harness(BatchScheduler(1, plan=make_plan("edf")))
    h.s.add(make_row("loose", steps=3, deadline=1000.0))
    h.tick(0.0)
    h.s.add(make_row("late", steps=1, deadline=50.0, at=1.0))
    h.s.add(make_row("none", steps=1, at=1.0))
    h.s.add(make_row("tight", steps=1, deadline=5.0, at=1.0))
    h.s.add(make_row("vip", steps=1, deadline=900.0, priority=1, at=1.0))
    admitted = []
    for t in range(1, 9):
        out = h.tick(float(t))
        assert out.parked == []  # the running row keeps its slot, however tight the queue
        admitted += out.admitted
    assert admitted == ["vip", "tight", "late", "none"]
    assert h.finished_at["loose"] == 3.0


# ----- slack: ordering -------------------------------------------------------------------------
def test_slack_order_uses_the_step_time_of_the_batch_as_it_would_be():
    # x: 10 steps left, due 100; y: parked with 2 steps left, due 95. At 1 s a step x has less
    # slack (90 < 93); at 0.1 s y has (94.8 < 99). The step time depends on the batch's size.
    calls = []

    def step_time(rows):
        calls.append(len(rows))
        return 1.0 if len(rows) >= 2 else 0.1

    for max_batch, first in ((1, "y"), (2, "x")):
        s = BatchScheduler(max_batch, plan=make_plan("edf", step_time=step_time))
        if max_batch == 2:
            s.add(make_row("z", steps=50))
            s.schedule(0.0)  # z takes one slot: x and y compete for the other
        s.add(make_row("x", steps=10, deadline=100.0))
        s.add(make_row("y", steps=10, deadline=95.0, step=8))
        calls.clear()
        out = s.schedule(0.0)
        assert out.admitted == [first]
        assert len(calls) == 2  # a first guess, then the batch the order chooses
        assert s.live_state(0.0)["waiting"][0].job_id == ({"x", "y"} - {first}).pop()


def test_planned_step_s_prices_the_max_batch_rows_of_highest_precedence():
    plan = make_plan(step_time=lambda rows: sum(r.mask_ratio for r in rows))
    tight = Row("t", 5, KEY, 0.9, 0.0, deadline=10.0)
    loose = [Row(f"l{i}", 5, KEY, 0.1, 0.0, deadline=1000.0) for i in range(3)]
    # FIFO's guess would price l0..l1; precedence puts t in the batch
    assert planned_step_s(plan, [], [*loose, tight], 2, 0.0) == pytest.approx(1.0)


# ----- slack: parking and resuming -------------------------------------------------------------
def test_a_slack_rich_row_is_parked_for_a_tight_one_at_a_round_boundary_only():
    h = Harness(BatchScheduler(2, plan=make_plan(round_steps=3)))
    h.s.add(make_row("a", steps=20, deadline=1000.0))
    h.s.add(make_row("b", steps=20, deadline=1000.0, at=0.5))
    h.tick(0.0)
    h.s.add(make_row("t", steps=4, deadline=10.0, at=1.0))  # slack 5 at t=1: under two rounds
    assert h.tick(1.0).parked == [] and h.tick(2.0).parked == []  # not a round boundary yet
    out = h.tick(3.0)  # three steps ran: a planning round
    assert out.parked == ["b"] and out.admitted == ["t"] and out.resumed == []
    assert h.s.waiting["b"].step == 3 and h.s.waiting["b"].parked
    for t in range(4, 7):
        assert h.tick(float(t)).parked == []
    assert h.finished_at["t"] == 7.0 <= 10.0
    out = h.tick(7.0)  # t's slot frees: b resumes from its step
    assert out.admitted == ["b"] and out.resumed == ["b"] and h.s.running["b"].step == 3 + 1
    while not h.s.idle:
        h.tick(float(len(h.outs)))
    assert h.steps_run == {"a": 20, "b": 20, "t": 4}
    assert h.s.counters() == {"parks": 1, "resumes": 1, "rounds": h.s.rounds}
    assert h.s.rounds >= 2


@pytest.mark.parametrize("urgent_parks", [False, True])
def test_a_row_that_cannot_wait_for_the_round_has_a_row_parked_for_it_at_once(urgent_parks):
    """t arrives one step into a round of three with 1.5 s of slack: waiting the two steps to the
    round (1 s each) would make it late, so it is urgent; with urgent parks b is parked for it at
    once and t is on time, else b is parked at the round and t ends half a second late."""
    h = Harness(BatchScheduler(2, plan=make_plan(round_steps=3, urgent_parks=urgent_parks)))
    h.s.add(make_row("a", steps=20, deadline=1000.0))
    h.s.add(make_row("b", steps=20, deadline=1000.0, at=0.5))
    h.tick(0.0)
    h.s.add(make_row("t", steps=4, deadline=6.5, at=1.0))  # slack 1.5 at t=1: under 2 steps
    out = h.tick(1.0)
    assert out.parked == (["b"] if urgent_parks else [])
    if not urgent_parks:
        assert h.tick(2.0).parked == []
        out = h.tick(3.0)  # the round
        assert out.parked == ["b"]
    assert out.admitted == ["t"]
    while not h.s.idle:
        h.tick(float(len(h.outs)))
    assert h.finished_at["t"] == (5.0 if urgent_parks else 7.0)
    assert h.s.parks == h.s.resumes == 1


@pytest.mark.parametrize("urgent_parks", [False, True])
def test_a_resumed_row_is_not_parked_again_in_the_round_it_resumed(urgent_parks):
    h = Harness(BatchScheduler(1, plan=make_plan(round_steps=2, urgent_parks=urgent_parks)))
    h.s.add(make_row("a", steps=30, deadline=1000.0))
    h.tick(0.0)
    h.tick(1.0)
    h.s.add(make_row("t1", steps=1, deadline=4.0, at=2.0))
    assert h.tick(2.0).parked == ["a"]  # round at t=2
    out = h.tick(3.0)
    assert out.resumed == ["a"]  # t1 ended: a resumes mid-round
    h.s.add(make_row("t2", steps=1, deadline=6.0, at=4.0))
    out = h.tick(4.0)  # the next round: a resumed since the last one, so it keeps its slot
    assert out.parked == [] and list(h.s.waiting) == ["t2"]
    # a may be parked again from that round on: t2 (slack 0 at t=5) would be late if it waited
    # for the next round, so with urgent parks it takes a's slot at once
    out = h.tick(5.0)
    assert out.parked == (["a"] if urgent_parks else [])
    if not urgent_parks:
        out = h.tick(6.0)  # the round after
        assert out.parked == ["a"]
    assert out.admitted == ["t2"]


def test_a_row_whose_own_slack_would_go_negative_is_not_parked():
    for victim_deadline, parked in ((6.5, []), (20.0, ["v"])):
        h = Harness(BatchScheduler(1, plan=make_plan(round_steps=3)))
        h.s.add(make_row("v", steps=5, deadline=victim_deadline))
        for t in range(3):
            h.tick(float(t))
        # at t=3: v has 2 steps left (slack 1.5 or 15); w needs 2 (slack 1). A round is 3 s.
        h.s.add(make_row("w", steps=2, deadline=6.0, at=3.0))
        assert h.tick(3.0).parked == parked


def test_a_row_the_worker_marks_unparkable_is_never_parked():
    for parkable, parked in ((False, []), (True, ["v"])):
        h = Harness(BatchScheduler(1, plan=make_plan(round_steps=3)))
        h.s.add(make_row("v", steps=5, deadline=20.0))
        h.s.add(make_row("x", steps=1, deadline=0.0, at=0.5))  # keeps the queue non-empty
        for t in range(3):
            h.tick(float(t))
        h.s.running["v"].parkable = parkable  # e.g. it records its template's cache
        h.s.add(make_row("w", steps=2, deadline=6.0, at=3.0))
        assert h.tick(3.0).parked == parked


def test_a_waiting_row_that_is_not_ready_never_causes_a_park():
    h = Harness(BatchScheduler(2, plan=make_plan(round_steps=3)))
    h.s.add(make_row("a", steps=20, deadline=1000.0))
    h.s.add(make_row("b", steps=20, deadline=1000.0, at=0.5))
    asked = []

    def not_yet(row):
        asked.append(row.job_id)
        return row.job_id != "t"

    for t in range(3):
        h.tick(float(t), not_yet)
    h.s.add(make_row("t", steps=2, deadline=10.0, at=3.0))
    asked.clear()
    out = h.tick(3.0, not_yet)
    assert out.parked == [] and out.admitted == [] and out.held == ["t"]
    assert set(h.s.running) == {"a", "b"} and asked == ["t"]
    for t in range(4, 6):
        assert h.tick(float(t), not_yet).held == []  # no round: t is not even asked
    out = h.tick(6.0)  # the next round, t's cache landed: it takes b's slot
    assert out.parked == ["b"] and out.admitted == ["t"]


@pytest.mark.parametrize("urgent_parks", [False, True])
@pytest.mark.parametrize("bound", [1, 3])
def test_parks_per_round_stay_within_the_bound_under_many_tight_arrivals(bound, urgent_parks):
    plan = make_plan(round_steps=2, max_parks=bound, urgent_parks=urgent_parks)
    h = Harness(BatchScheduler(4, plan=plan))
    for i in range(4):
        h.s.add(make_row(f"batch{i}", steps=40, deadline=10_000.0, at=i * 0.1))
    parks, per_round = [], [0]  # parks per schedule; per round, from one round to the next
    off_round_parks = 0
    for t in range(100):
        if t < 30 and t % 3 == 1:  # four tight rows at once, every third step
            for k in range(4):
                h.s.add(make_row(f"tight{t}.{k}", steps=2, deadline=t + 4.0, at=float(t)))
        rounds = h.s.rounds
        out = h.tick(float(t))
        if h.s.rounds > rounds:
            per_round.append(0)
        else:
            off_round_parks += len(out.parked)
        parks.append(len(out.parked))
        per_round[-1] += len(out.parked)
    assert max(per_round) == bound  # the bound binds: four rows wanted a slot at once
    assert h.s.idle and h.s.parks == sum(parks) == h.s.resumes
    # without urgent parks, parks happen at round boundaries only; with them, tight rows that
    # arrived between rounds were let in before the next one
    assert (off_round_parks > 0) == urgent_parks


def test_a_batch_row_is_not_starved_by_tight_rows_arriving_at_every_step():
    max_wait_s, round_steps = 8.0, 2
    h = Harness(BatchScheduler(2, plan=make_plan(round_steps=round_steps, max_wait_s=max_wait_s)))
    h.s.add(make_row("bulk", steps=3, deadline=500.0))
    admitted_at = None
    for t in range(40):
        # two tight rows a step: always tighter than bulk, and more than the two slots can serve
        for k in range(2):
            h.s.add(make_row(f"t{t}.{k}", steps=3, deadline=t + 5.0, at=float(t)))
        out = h.tick(float(t))
        assert "bulk" not in out.parked  # a starved row is never parked
        if "bulk" in out.admitted:
            admitted_at = float(t)
    assert admitted_at is not None and "bulk" in h.finished_at
    assert admitted_at <= max_wait_s  # it waited no longer than the bound


def test_a_row_due_to_starve_takes_a_slot_at_the_last_round_before_the_bound_whatever_its_slack():
    # w has no deadline: it never displaces anyone, until it would wait past max_wait_s; rounds
    # at t=3 and t=6: waiting for the second would take it past the bound at t=5
    h = Harness(BatchScheduler(1, plan=make_plan(round_steps=3, max_wait_s=4.0)))
    h.s.add(make_row("long", steps=30, deadline=1000.0))
    h.tick(0.0)
    w = make_row("w", steps=2, at=1.0)
    h.s.add(w)
    parked_at = None
    for t in range(1, 12):
        out = h.tick(float(t))
        if out.parked:
            parked_at = t
            assert out.parked == ["long"] and out.admitted == ["w"]
    assert parked_at == 3 and w.wait_s == 2.0  # at the round: 2 s + a round and a step > 4 s
    assert h.finished_at["w"] == 5.0 and h.s.running["long"].step == 12 - 2  # sat out two steps


def test_the_starvation_bound_goes_before_a_deadline():
    # one slot, held for 20 steps by a tight row that is late if it sits out a step: the batch row
    # behind it would wait 19 s; it takes the slot with a step to spare before its 4 s bound
    h = Harness(BatchScheduler(1, plan=make_plan(round_steps=1, max_wait_s=4.0)))
    tight = make_row("tight", steps=20, deadline=21.0)
    h.s.add(tight)
    h.tick(0.0)
    bulk = make_row("bulk", steps=2, at=1.0)
    h.s.add(bulk)
    parked_at = [t for t in range(1, 30) if h.tick(float(t)).parked]
    assert parked_at == [4] and bulk.wait_s == 3.0  # a step before the bound: 3 s + 2 steps > 4
    assert h.finished_at == {"bulk": 6.0, "tight": 22.0}  # late by the two steps it sat out
    assert tight.parks == 1 and bulk.parks == 0


def test_a_burst_of_rows_comes_due_early_enough_for_the_last_of_them():
    # six batch rows at once behind two slots held by tight rows: were each due only when its own
    # wait ran short, all six would come due together and the last two would start 10 s late
    h = Harness(BatchScheduler(2, plan=make_plan(round_steps=1, max_wait_s=20.0, max_parks=2)))
    tight = [make_row(f"tight{k}", steps=40, deadline=41.0) for k in range(2)]
    for row in tight:
        h.s.add(row)
    assert h.tick(0.0).admitted == ["tight0", "tight1"] and not any(r.due for r in tight)
    burst = [make_row(f"b{k}", steps=5, at=1.0) for k in range(6)]
    for row in burst:
        h.s.add(row)
    for t in range(1, 80):
        h.tick(float(t))
    assert set(h.finished_at) == {r.job_id for r in tight + burst}
    waits = [row.wait_s for row in burst]
    assert max(waits) <= 20.0  # every one of them kept the bound ...
    assert min(waits) > 8.0  # ... none went long before it had to
    assert max(row.wait_s for row in tight) <= 20.0  # nor did the rows parked for them


def test_rows_due_together_are_let_in_beyond_the_parks_a_round_allows():
    # four rows come due together behind four long running rows, one park a round: held to the
    # churn bound they would be let in a round (5 s) apart, the last ones past their 6 s bound
    h = Harness(BatchScheduler(4, plan=make_plan(round_steps=5, max_wait_s=6.0, max_parks=1)))
    for k in range(4):
        h.s.add(make_row(f"long{k}", steps=40, deadline=1000.0))
    h.tick(0.0)
    burst = [make_row(f"b{k}", steps=2, at=0.5) for k in range(4)]
    for row in burst:
        h.s.add(row)
    parks_at = {}
    for t in range(1, 60):
        out = h.tick(float(t))
        if out.parked:
            parks_at[t] = sorted(out.parked)
    assert [row.wait_s for row in burst] == [4.5] * 4  # each kept the bound, none went early
    assert parks_at[5] == [f"long{k}" for k in range(4)]  # all four parked at once
    assert set(h.finished_at) == {f"long{k}" for k in range(4)} | {r.job_id for r in burst}


def test_a_plan_that_never_parks_keeps_a_due_row_waiting_for_a_slot_to_free():
    h = Harness(BatchScheduler(1, plan=make_plan(round_steps=1, max_wait_s=2.0, max_parks=0)))
    h.s.add(make_row("long", steps=10, deadline=1000.0))
    h.tick(0.0)
    late = make_row("late", steps=2, at=0.5)
    h.s.add(late)
    assert not any(h.tick(float(t)).parked for t in range(1, 20))
    assert late.due and late.wait_s == 9.5  # past its bound: 0 parks a round means none
    assert h.finished_at == {"long": 10.0, "late": 12.0}


def test_a_backlog_deeper_than_the_bound_is_served_first_come_first_served():
    # ten rows of 10 steps on one slot: 100 s of work against a 20 s bound, which no order keeps
    # for all; every row comes due (even a fresh tight one) and the longest wait goes first
    s = BatchScheduler(1, plan=make_plan(round_steps=1, max_wait_s=20.0))
    for k in range(10):
        s.add(make_row(f"b{k}", steps=10, deadline=1000.0, at=float(k) / 10))
    s.update_from_output(s.schedule(1.0).admitted)
    s.add(make_row("tight", steps=10, deadline=15.0, at=1.0))
    s.schedule(1.0)
    assert all(row.due for row in s.waiting.values())
    assert [r.job_id for r in s.queue_order()] == [*(f"b{k}" for k in range(1, 10)), "tight"]
    # the heartbeat says so: routing and admission then rank these rows before any other
    live = s.live_state(3.0)
    assert live["running"][0].due and all(row.due for row in live["waiting"])
    assert [round(row.waited_s, 6) for row in live["waiting"]] == [
        *(round(3.0 - k / 10, 6) for k in range(1, 10)),
        2.0,
    ]


def test_a_tight_row_of_lower_priority_never_parks_a_row_of_higher_priority():
    h = Harness(BatchScheduler(1, plan=make_plan(round_steps=1)))
    h.s.add(make_row("vip", steps=10, deadline=1000.0, priority=3))
    h.tick(0.0)
    h.s.add(make_row("tight", steps=2, deadline=4.0, at=1.0))
    assert all(h.tick(float(t)).parked == [] for t in range(1, 10))


def test_rows_without_deadlines_keep_fifo_and_never_displace_rows_with_deadlines():
    h = Harness(BatchScheduler(1, plan=make_plan(round_steps=1)))
    h.s.add(make_row("d", steps=6, deadline=100.0))
    h.tick(0.0)
    for i, name in enumerate(("n1", "n2", "n3")):
        h.s.add(make_row(name, steps=1, at=1.0 + i))
    order = []
    for t in range(1, 12):
        out = h.tick(float(t))
        assert out.parked == []  # infinite slack never displaces anyone
        order += out.admitted
    assert order == ["n1", "n2", "n3"] and h.finished_at["d"] == 6.0
    # a row with a deadline that needs the slot does displace a row without one
    h.s.add(make_row("bulk", steps=50))
    h.tick(12.0)
    h.s.add(make_row("due", steps=2, deadline=16.0, at=13.0))
    assert h.tick(13.0).parked == ["bulk"]


def test_cancel_of_a_parked_row():
    h = Harness(BatchScheduler(1, plan=make_plan(round_steps=1)))
    h.s.add(make_row("a", steps=10, deadline=1000.0))
    h.tick(0.0)
    h.s.add(make_row("t", steps=3, deadline=4.0, at=1.0))
    assert h.tick(1.0).parked == ["a"]
    assert h.s.cancel("a")
    out = h.tick(2.0)
    assert out.cancelled == ["a"] and "a" not in h.s.waiting and out.resumed == []
    while not h.s.idle:
        assert "a" not in h.tick(float(len(h.outs))).admitted
    assert h.s.counters()["resumes"] == 0 and h.steps_run["a"] == 1


def test_live_state_reports_deadlines_priorities_and_parked_steps():
    h = Harness(BatchScheduler(1, plan=make_plan(round_steps=1)))
    h.s.add(make_row("a", steps=10, deadline=1000.0, priority=2))
    h.tick(0.0)
    h.s.add(make_row("t", steps=3, deadline=4.0, priority=2, at=1.0))
    h.tick(1.0)
    live = h.s.live_state(3.5)
    assert live["scheduler"] == "slack"
    (running,) = live["running"]
    assert (running.job_id, running.deadline, running.priority) == ("t", 4.0, 2)
    (waiting,) = live["waiting"]
    assert (waiting.job_id, waiting.step, waiting.num_steps, waiting.deadline) == (
        "a",
        1,
        10,
        1000.0,
    )
    # parked at 1.0: it has waited since (its first wait ended when it was admitted at 0.0)
    assert waiting.waited_s == pytest.approx(2.5) and not waiting.due and not running.due


# ----- plan ------------------------------------------------------------------------------------
def test_plan_from_settings_and_validation():
    settings = DeadlineSettings(scheduler="edf", round_steps=4, max_wait_s=60.0)
    plan = DeadlinePlan.from_settings(settings, constant(0.2))
    assert (plan.scheduler, plan.round_steps, plan.max_wait_s, plan.max_parks_per_round) == (
        "edf",
        4,
        60.0,
        settings.max_parks_per_round,
    )
    assert plan.step_time([]) == 0.2
    with pytest.raises(ValueError, match="step scheduler"):
        make_plan("lifo")
    with pytest.raises(ValueError, match="round_steps"):
        make_plan(round_steps=0)
    # static and baseline batches stay FIFO whatever the plan
    assert BatchScheduler(2, "static", plan=make_plan()).policy == "fifo"
    assert BatchScheduler(2, "inline", plan=make_plan()).policy == "slack"


# ----- a burst on a fake clock -----------------------------------------------------------------
BURST_STEP = by_size(0.1, 0.05)  # 0.3 s for a full batch of 4


def serve_burst(scheduler: str) -> tuple[dict[str, float], dict[str, float], BatchScheduler]:
    """30 batch rows at t=0 (due in 120 s), 5 interactive rows inside the burst (due 5 s after
    arrival; 10 steps take 3 s in a full batch). Returns deadlines, finish times, the scheduler."""
    arrivals = [(0.0, make_row(f"batch{i}", deadline=120.0, at=i * 1e-3)) for i in range(30)]
    for k, at in enumerate((0.2, 3.3, 6.4, 9.5, 12.6)):  # each just after a wave began
        arrivals.append((at, make_row(f"inter{k}", deadline=at + 5.0, at=at)))
    deadlines = {row.job_id: row.deadline for _, row in arrivals}
    s = BatchScheduler(4, plan=make_plan(scheduler, round_steps=5, step_time=BURST_STEP))
    pending = sorted(arrivals, key=lambda a: a[0])
    finish: dict[str, float] = {}
    steps_run: dict[str, int] = {}
    clock = 0.0
    while pending or not s.idle:
        while pending and pending[0][0] <= clock:
            s.add(pending.pop(0)[1])
        if s.idle:
            clock = pending[0][0]
            continue
        out = s.schedule(clock)
        batch = [s.running[j] for g in out.groups for j in g]
        clock += BURST_STEP(batch)
        for row in batch:
            steps_run[row.job_id] = steps_run.get(row.job_id, 0) + 1
        for row in s.update_from_output([r.job_id for r in batch]):
            finish[row.job_id] = clock
    assert steps_run == {job_id: 10 for job_id in deadlines}  # every row, exactly its steps
    return deadlines, finish, s


def test_a_burst_the_slack_scheduler_meets_interactive_deadlines_that_fifo_misses():
    met = {}
    makespan = {}
    for scheduler in ("fifo", "edf", "slack"):
        deadlines, finish, s = serve_burst(scheduler)
        on_time = {j for j, at in finish.items() if at <= deadlines[j] + 1e-9}
        met[scheduler] = (
            sum(j.startswith("inter") for j in on_time),
            sum(j.startswith("batch") for j in on_time),
        )
        makespan[scheduler] = max(finish.values())
        if scheduler == "slack":
            assert s.parks in range(1, 6) and s.resumes == s.parks
    # fifo serves every interactive row after the burst; edf only at the next free slot (a wave
    # of the burst ends every 3 s, too late); slack parks a batch row at the next round
    assert met["fifo"][0] == 0 and met["edf"][0] < 5 and met["slack"][0] == 5
    assert met["slack"][1] == met["fifo"][1] == 30  # no batch row pays with its deadline
    assert makespan["slack"] <= makespan["fifo"] * 1.05  # nor with throughput

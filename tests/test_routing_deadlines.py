"""Routing with deadlines (pure): the predicted finish per worker, the rows that precede a job under
each step scheduler, and the choice (on time at least cost, else least late)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from backend import protocol
from backend.costmodel.costs import CostProfile
from backend.dispatch.deadline_cost import RowOrder, placing_order, replay
from backend.dispatch.router import (
    JobRequest,
    Router,
    RoutingCostModel,
    RowState,
    WorkerView,
    view_from_heartbeat,
)

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
MODEL = "small-flux-fill"
NOW = 1000.0
SLACK, EDF, FIFO = RowOrder("slack"), RowOrder("edf"), RowOrder("fifo")
ROUNDS_ONLY = RowOrder("slack", urgent_parks=False)  # parks for waiting rows at rounds only


@pytest.fixture(scope="module")
def cm() -> RoutingCostModel:
    return RoutingCostModel.from_profile(
        CostProfile.from_json((PROFILES / f"{MODEL}__cpu__kv.json").read_text())
    )


def rows(spec, prefix="r", deadline=0.0, priority=0) -> tuple[RowState, ...]:
    return tuple(
        RowState(f"{prefix}{i}", m, s, t, deadline=deadline, priority=priority)
        for i, (m, s, t) in enumerate(spec)
    )


def worker(wid, running=(), waiting=(), ram=(), order=FIFO, max_batch=8) -> WorkerView:
    return WorkerView(
        wid, MODEL, "cpu", max_batch, running, waiting, frozenset(ram), frozenset(), order=order
    )


def job(deadline=0.0, template="t0", priority=0, steps=20) -> JobRequest:
    return JobRequest(
        "j", MODEL, 0.1, steps, template, deadline=deadline, priority=priority, now=NOW
    )


def choose(cm, j, views):
    return Router("mask_aware", {(MODEL, "cpu"): cm}).choose(j, views)


def cheap_but_slow(cm):
    """Two full workers (batch 2). w0: J's template in RAM, but it waits 30 steps of two large
    masks (cheap: it slows no one, yet finishes late); w1: J records its template densely after 2
    steps (it finishes sooner, yet costs more: its dense row slows its co-runner)."""
    w0 = worker("w0", rows([(0.5, 30, "a")] * 2), ram={"a", "t0"}, max_batch=2)
    w1 = worker("w1", rows([(0.1, 2, "b"), (0.1, 20, "b")]), ram={"b"}, max_batch=2)
    e0, e1 = cm.estimate(job(), w0), cm.estimate(job(), w1)
    assert e0["total"] < e1["total"] and e0["finish_s"] > e1["finish_s"] + 5
    return w0, w1, e0, e1


# ----- the choice -------------------------------------------------------------------------------
def test_the_router_prefers_the_worker_that_meets_the_deadline_over_a_cheaper_one(cm):
    w0, w1, e0, e1 = cheap_but_slow(cm)
    assert choose(cm, job(), [w0, w1]).worker_id == "w0"  # no deadline: the least cost
    deadline = NOW + (e0["finish_s"] + e1["finish_s"]) / 2  # w1 meets it, w0 does not
    d = choose(cm, job(deadline), [w0, w1])
    assert d.worker_id == "w1" and "meets its deadline on 1 of 2" in d.reason
    assert d.costs["w1"] < d.costs["w0"]  # the least cost still wins
    assert d.terms["w0"]["late_s"] == pytest.approx(e0["finish_s"] - (deadline - NOW))
    assert d.terms["w1"]["late_s"] == 0.0
    assert d.terms["w1"]["finish_at"] == pytest.approx(NOW + e1["finish_s"])
    # a deadline both meet: the cheaper one, as without a deadline
    assert choose(cm, job(NOW + e0["finish_s"] + 5), [w0, w1]).worker_id == "w0"


def test_when_no_worker_meets_the_deadline_the_least_late_one_wins(cm):
    w0, w1, e0, e1 = cheap_but_slow(cm)
    d = choose(cm, job(NOW + 1.0), [w0, w1])
    assert d.worker_id == "w1" and "late on every worker" in d.reason
    assert d.terms["w1"]["late_s"] == pytest.approx(e1["finish_s"] - 1.0)
    assert d.costs["w1"] < d.costs["w0"]


def test_a_job_already_past_its_deadline_goes_where_it_finishes_first(cm):
    w0, w1, _, _ = cheap_but_slow(cm)
    assert choose(cm, job(NOW - 60.0), [w0, w1]).worker_id == "w1"


def test_a_workers_finish_tail_counts_against_the_deadline(cm):
    """Two equal workers: J's last step ends in time on both, but on w0 its job is done that much
    later (w0's post-processing takes longer): it goes to w1, and on w0 it is late by the
    difference."""
    idle = worker("w1", order=SLACK)
    e = cm.estimate(job(), idle)
    deadline = NOW + e["finish_s"] + 0.5
    slow_tail = replace(idle, worker_id="w0", finish_tail_s=0.8)
    d = choose(cm, job(deadline), [slow_tail, idle])
    assert d.worker_id == "w1" and "meets its deadline on 1 of 2" in d.reason
    assert d.terms["w0"]["late_s"] == pytest.approx(0.3)
    shorter = replace(slow_tail, finish_tail_s=0.4)  # on time on both: the tie goes to w0
    assert choose(cm, job(deadline), [shorter, idle]).worker_id == "w0"


# ----- the rows ahead of a job ------------------------------------------------------------------
def test_a_tight_job_is_not_charged_for_the_slack_rich_queue_ahead_of_it(cm):
    """A full batch (20 steps left) and 8 queued rows, all with an hour of slack: under FIFO J waits
    for the queue (40 steps), under EDF only for the running batch (20), under the slack scheduler
    not at all: it would be late by the next round boundary, so a running row is parked for it at
    once (at that boundary without urgent parks)."""
    loose = NOW + 3600
    running = rows([(0.1, 20, "a")] * 8, "r", loose)
    waiting = rows([(0.1, 20, "a")] * 8, "q", loose)
    tight = job(NOW + 10)
    est = {
        order.scheduler: cm.estimate(
            tight, worker("w", running, waiting, ram={"a", "t0"}, order=order)
        )
        for order in (FIFO, EDF, SLACK)
    }
    assert est["fifo"]["admit_step"] == 40 and est["fifo"]["ahead"] == 16
    assert est["edf"]["admit_step"] == 20 and est["edf"]["ahead"] == 8
    assert est["slack"]["admit_step"] == 0 and est["slack"]["parked"] == 1
    assert est["slack"]["ahead"] == 0
    rounds_only = worker("w", running, waiting, ram={"a", "t0"}, order=ROUNDS_ONLY)
    at_round = cm.estimate(tight, rounds_only)
    assert at_round["admit_step"] == SLACK.round_steps // 2 and at_round["parked"] == 1
    assert est["slack"]["wait"] < est["edf"]["wait"] < est["fifo"]["wait"]
    assert est["slack"]["finish_s"] < est["edf"]["finish_s"] < est["fifo"]["finish_s"]
    # no parking allowed (churn bound 0): the slack scheduler is EDF
    no_parks = cm.estimate(
        tight,
        worker("w", running, waiting, ram={"a", "t0"}, order=RowOrder("slack", 5, 0)),
    )
    assert no_parks["admit_step"] == 20 and no_parks["parked"] == 0


def test_rows_with_less_slack_still_precede_the_job(cm):
    """Queued rows tighter than J (or of a higher priority) stay ahead of it; looser ones do not.
    (Under slack the tighter rows also park running rows; rows of a higher priority with slack to
    spare do not: they only precede J.)"""
    running = rows([(0.1, 10, "a")] * 8, "r")
    tighter = rows([(0.1, 20, "a")] * 8, "q", NOW + 5)
    looser = rows([(0.1, 20, "a")] * 8, "q", NOW + 3600)
    urgent = rows([(0.1, 20, "a")] * 8, "q", NOW + 3600, priority=5)
    j = job(NOW + 60)
    for order in (EDF, SLACK):

        def admit(waiting, order=order):
            view = worker("w", running, waiting, ram={"a", "t0"}, order=order)
            return cm.estimate(j, view)["admit_step"]

        assert admit(tighter) > admit(looser) and admit(urgent) > admit(looser)


def test_the_routed_choice_follows_the_workers_scheduler(cm):
    """Every worker is full. w0 queues 16 slack-rich batch rows, w1 8 rows tighter than J: under
    FIFO J goes to w1 (fewer rows ahead); under EDF to w0, where it passes the whole queue (late
    everywhere, least late there); under the slack scheduler to w0 too, where it also parks a
    running row at the next round boundary and is on time. Without a deadline J would only be
    offered the least loaded worker, w1."""
    loose, tighter = NOW + 3600, NOW + 1

    def views(order):
        return [
            worker(
                "w0",
                rows([(0.1, 20, "a")] * 8, "r", loose),
                rows([(0.1, 20, "a")] * 16, "q", loose),
                ram={"a", "t0"},
                order=order,
            ),
            worker(
                "w1",
                rows([(0.1, 16, "b")] * 8, "r", tighter),
                rows([(0.1, 20, "b")] * 8, "q", tighter),
                ram={"b", "t0"},
                order=order,
            ),
        ]

    j = job(NOW + 20)
    fifo = choose(cm, j, views(FIFO))
    assert fifo.worker_id == "w1" and fifo.terms["w0"]["admit_step"] == 60
    edf = choose(cm, j, views(EDF))
    assert edf.worker_id == "w0" and edf.terms["w0"]["admit_step"] == 20
    assert edf.terms["w1"]["admit_step"] == 36
    slack = choose(cm, j, views(SLACK))
    assert slack.worker_id == "w0" and slack.terms["w0"]["parked"] == 1
    assert slack.terms["w0"]["admit_step"] == 2 and slack.terms["w0"]["late_s"] == 0
    assert edf.terms["w0"]["late_s"] > 0 and "least late" in edf.reason
    assert set(choose(cm, job(), views(SLACK)).costs) == {"w1"}


def test_the_slack_replay_parks_only_for_rows_that_would_be_late_within_the_churn_bound():
    """Queued rows (and J) ranked before running rows displace them at round boundaries, only when
    waiting for a free slot would make them late, at most ``max_parks_per_round`` a round; a parked
    row resumes its remaining steps when its turn comes and a slot frees."""
    order = RowOrder("slack", round_steps=4, max_parks_per_round=2, urgent_parks=False)
    steps, ranked = [20, 20, 20, 5, 5, 5, 5], [3, 4, 5, 6, -1, 0, 1, 2]
    # 3 running rows (20 steps left, indexes 0-2, an hour of slack), 4 waiting (5 steps, 3-6) and J
    # (6 steps) already late (negative slack): they rank first; steps of 1 s, max batch 3
    slack = {0: 3600.0, 1: 3600.0, 2: 3600.0, 3: -1.0, 4: -1.0, 5: -1.0, 6: -1.0, -1: -1.0}
    r = replay(steps, 3, ranked, 6, 3, order, slack, 1.0)
    # rows 3 and 4 displace at the first boundary (step 4 // 2 = 2) and run to 7; row 5 at the next
    # one (6: the churn bound); row 6 and J take the slots rows 3 and 4 free at 7. Rows 0 and 1
    # (parked at 2) resume at 11 and 12, when rows 5 and 6 finish: they overlap J's 7..13
    assert r.admit == 7 and r.parked == 0 and r.ahead == 4
    assert dict((k, o) for o, k in r.co_runners) == {5: 4, 6: 5, 0: 2, 1: 1}
    assert set(r.first) == {0, 1, 2}  # the parked rows run until their boundary
    # max batch 8: 5 free slots, nobody displaced, everything from step 0
    roomy = replay(steps, 3, ranked, 6, 8, order, slack, 1.0)
    assert roomy.admit == 0 and roomy.parked == 0 and set(roomy.first) == set(range(7))
    # a full batch, J ranks first: it parks the last ranked running row at the next boundary
    tight = replay([10, 10, 10], 3, [-1, 0, 1, 2], 6, 3, order, slack, 1.0)
    assert tight.admit == 2 and tight.parked == 1 and tight.ahead == 0
    # ... but not when the first slot to free (10 steps) comes in time, nor for a row that would
    # be late after sitting out a round (slack under one round: 4 s)
    on_time = replay([10, 10, 10], 3, [-1, 0, 1, 2], 6, 3, order, {**slack, -1: 10.0}, 1.0)
    assert on_time.admit == 10 and on_time.parked == 0
    fragile = replay([10, 10, 10], 3, [-1, 0, 1, 2], 6, 3, order, {**slack, 2: 3.0}, 1.0)
    assert fragile.admit == 2 and fragile.parked == 1  # row 1 is parked instead of row 2
    assert 2 in {k for _, k in fragile.co_runners} and 1 not in {k for _, k in fragile.co_runners}
    # J has 30 s of slack and the first slot frees at 40: J becomes urgent (under 2 rounds: 8 s)
    # after 22 steps, and 22 is a boundary (2 + 5 rounds)
    loose = replay([40, 40, 40], 3, [-1, 0, 1, 2], 6, 3, order, {**slack, -1: 30.0}, 1.0)
    assert loose.admit == 22 and loose.parked == 1


def test_with_urgent_parks_a_row_late_by_the_next_boundary_is_let_in_at_once():
    """As above, with urgent parks: rows 3 and 4 (late already) park rows 2 and 1 (ranked last) at
    once, the parks left before the first boundary; row 5 parks row 0 at that boundary (step 2);
    row 6 and J take the slots rows 3 and 4 free at 5, two steps sooner."""
    order = RowOrder("slack", round_steps=4, max_parks_per_round=2, urgent_parks=True)
    slack = {0: 3600.0, 1: 3600.0, 2: 3600.0, 3: -1.0, 4: -1.0, 5: -1.0, 6: -1.0, -1: -1.0}
    r = replay([20, 20, 20, 5, 5, 5, 5], 3, [3, 4, 5, 6, -1, 0, 1, 2], 6, 3, order, slack, 1.0)
    assert r.first == (0, 3, 4)  # rows 1 and 2 parked before any step, row 0 ran until 2
    assert r.admit == 5 and r.parked == 0
    tight = replay([10, 10, 10], 3, [-1, 0, 1, 2], 6, 3, order, slack, 1.0)
    assert tight.admit == 0 and tight.parked == 1
    # 3 s of slack: on time at the boundary (step 2), so parked for there, not at once
    spare = replay([10, 10, 10], 3, [-1, 0, 1, 2], 6, 3, order, {**slack, -1: 3.0}, 1.0)
    assert spare.admit == 2 and spare.parked == 1


def test_a_running_row_recording_its_template_is_not_counted_as_parkable(cm):
    """The worker never parks a recording (its template's other rows wait for it): a tight job
    on a batch of recordings waits for a slot; with one cached row among them, it parks that one."""
    loose = NOW + 3600
    recordings = rows([(0.1, 20, f"new{i}") for i in range(8)], "r", loose)  # in no tier: dense
    tight = job(NOW + 10)
    est = cm.estimate(tight, worker("w", recordings, ram={"t0"}, order=SLACK))
    assert est["parked"] == 0 and est["admit_step"] == 20
    one_cached = recordings[:7] + rows([(0.1, 20, "a")], "c", loose)
    est = cm.estimate(tight, worker("w", one_cached, ram={"a", "t0"}, order=SLACK))
    assert est["parked"] == 1 and est["admit_step"] == 0


# ----- the starvation bound ----------------------------------------------------------------------
def bounded(max_wait_s=60.0, scheduler="slack") -> RowOrder:
    return RowOrder(scheduler, max_wait_s=max_wait_s)


def starving_queue(waited_s=0.0, due=False, seen_at=0.0, order=None):
    """A full batch (20 steps left, an hour of slack) and 8 queued rows as loose, which have
    waited ``waited_s`` (reported ``due`` or not) when W reported them at ``seen_at``."""
    loose = NOW + 3600
    running = rows([(0.1, 20, "a")] * 8, "r", loose)
    waiting = tuple(
        replace(r, waited_s=waited_s, due=due) for r in rows([(0.1, 20, "a")] * 8, "q", loose)
    )
    view = worker("w", running, waiting, ram={"a", "t0"}, order=order or bounded())
    return replace(view, seen_at=seen_at)


@pytest.mark.parametrize("scheduler, admit_unbounded", [("slack", 0), ("edf", 20)])
def test_rows_due_for_the_bound_go_before_a_tight_job(cm, scheduler, admit_unbounded):
    """A loose queue does not delay a tight job (previous tests) until its rows come due for the
    starvation bound: then they take the slots first, whatever the job's slack."""
    tight = job(NOW + 10)
    fresh = cm.estimate(tight, starving_queue(order=bounded(scheduler=scheduler)))
    assert fresh["admit_step"] == admit_unbounded and fresh["ahead"] <= 8
    reported = cm.estimate(tight, starving_queue(due=True, order=bounded(scheduler=scheduler)))
    assert reported["admit_step"] == 40 and reported["ahead"] >= 8  # the 8 due rows first
    assert reported["finish_s"] > fresh["finish_s"]


def test_a_row_comes_due_when_its_wait_passes_the_bound_by_the_workers_next_round(cm):
    """W reported the rows' waits, not yet due; the router counts on from the report: 59 s waited
    against a 60 s bound is due within the next round of steps, 40 s is not, and neither is 59 s
    under a bound of 10 minutes."""
    tight = job(NOW + 10)
    assert cm.estimate(tight, starving_queue(waited_s=40.0))["admit_step"] == 0
    assert cm.estimate(tight, starving_queue(waited_s=59.0))["admit_step"] == 40
    roomy = starving_queue(waited_s=59.0, order=bounded(max_wait_s=600.0))
    assert cm.estimate(tight, roomy)["admit_step"] == 0
    # reported 45 s ago with 15 s waited: 60 s by now
    later = starving_queue(waited_s=15.0, seen_at=NOW - 45.0)
    assert cm.estimate(tight, later)["admit_step"] == 40


def test_a_running_row_let_in_for_the_bound_is_never_parked(cm):
    """The worker never parks a due row: a tight job on a batch of them waits for a slot; with one
    row not due among them, that one is parked for it."""
    loose = NOW + 3600
    due_rows = tuple(replace(r, due=True) for r in rows([(0.1, 20, "a")] * 8, "r", loose))
    tight = job(NOW + 10)
    est = cm.estimate(tight, worker("w", due_rows, ram={"a", "t0"}, order=bounded()))
    assert est["parked"] == 0 and est["admit_step"] == 20
    one_not_due = due_rows[:7] + rows([(0.1, 20, "a")], "c", loose)
    est = cm.estimate(tight, worker("w", one_not_due, ram={"a", "t0"}, order=bounded()))
    assert est["parked"] == 1 and est["admit_step"] == 0


def test_the_router_sends_a_tight_job_away_from_a_worker_whose_queue_is_due(cm):
    tight = job(NOW + 10)
    starving = replace(starving_queue(due=True), worker_id="w0")
    calm = replace(starving_queue(), worker_id="w1")
    assert choose(cm, tight, [starving, calm]).worker_id == "w1"


def test_row_order_refuses_a_bound_that_is_not_positive():
    with pytest.raises(ValueError, match="max_wait_s"):
        RowOrder("slack", max_wait_s=0.0)


# ----- batch sizing -----------------------------------------------------------------------------
def sized_worker(cm, order, wid="w"):
    """A worker whose one running row "t" (10 steps left) is on time alone but late beside J."""
    alone = cm.step_latency([(0.1, "a", True)])
    beside = cm.step_latency([(0.1, "a", True), (0.1, "t0", True)])
    assert beside > alone
    deadline = NOW + 10 * (alone + beside) / 2
    return worker(wid, rows([(0.1, 10, "a")], "t", deadline=deadline), ram={"a", "t0"}, order=order)


@pytest.mark.parametrize(
    "order, held",
    [
        (SLACK, True),
        (RowOrder("slack", max_parks_per_round=0), True),  # sizing without parking
        (RowOrder("slack", size_batches=False), False),
        (EDF, False),
    ],
    ids=["slack", "slack-noparks", "slack-nosize", "edf"],
)
def test_a_loose_job_waits_while_it_would_make_a_tighter_running_row_late(cm, order, held):
    estimate = cm.estimate(job(NOW + 10_000), sized_worker(cm, order))
    assert estimate["admit_step"] == (10.0 if held else 0.0)
    assert (estimate["wait"] > 0) is held


def test_a_job_that_must_join_now_or_goes_first_is_not_held(cm):
    view = sized_worker(cm, SLACK)
    tight = view.running[0].deadline
    assert cm.estimate(job(NOW + 10_000, priority=1), view)["admit_step"] == 0.0  # goes first
    urgent = job(tight + 1.0)  # its own slack is under two rounds: the worker lets it in
    assert cm.estimate(urgent, view)["admit_step"] == 0.0


def test_a_running_row_that_cannot_be_on_time_even_alone_holds_no_one(cm):
    view = sized_worker(cm, SLACK)
    lost = replace(view.running[0], deadline=NOW + 0.001)  # late even alone: nothing to protect
    view = replace(view, running=(lost,))
    assert cm.estimate(job(NOW + 10_000), view)["admit_step"] == 0.0


def test_the_router_sends_a_loose_job_where_sizing_does_not_hold_it(cm):
    held = sized_worker(cm, SLACK, "w0")
    free = worker("w1", rows([(0.1, 10, "a")], "u", deadline=NOW + 10_000), ram={"a", "t0"})
    free = replace(free, order=SLACK)
    assert choose(cm, job(NOW + 10_000), [held, free]).worker_id == "w1"
    # with sizing off both workers run J at once, beside one row each: the smaller id wins
    no_sizing = RowOrder("slack", size_batches=False)
    views = [replace(held, order=no_sizing), replace(free, order=no_sizing)]
    assert choose(cm, job(NOW + 10_000), views).worker_id == "w0"


# ----- no deadlines: as before ------------------------------------------------------------------
def test_without_deadlines_every_scheduler_gives_the_old_estimates_and_choices(cm):
    rng = random.Random(7)
    for trial in range(150):
        spec = [
            (
                [(rng.random() * 0.9, rng.randint(0, 25), f"t{rng.randint(0, 5)}")]
                * rng.randint(0, 8),
                [(rng.random() * 0.9, rng.randint(1, 25), f"t{rng.randint(0, 5)}")]
                * rng.randint(0, 6),
                {f"t{rng.randint(0, 5)}" for _ in range(3)},
            )
            for _ in range(rng.randint(1, 4))
        ]
        j = JobRequest(f"j{trial}", MODEL, rng.random(), 20, f"t{rng.randint(0, 6)}", now=NOW)
        picks = {}
        for order in (FIFO, EDF, SLACK):
            views = [
                worker(f"w{i}", rows(run), rows(wait, "q"), ram, order)
                for i, (run, wait, ram) in enumerate(spec)
            ]
            d = choose(cm, j, views)
            picks[order.scheduler] = (d.worker_id, d.costs)
        assert picks["fifo"] == picks["edf"] == picks["slack"]


def test_a_deadline_job_on_fifo_workers_costs_what_it_did(cm):
    """FIFO workers admit in arrival order whatever the deadlines: the estimate is the same with or
    without one; only the choice rule changes."""
    view = worker(
        "w",
        rows([(0.2, 3, "a"), (0.1, 30, "b")], "r", NOW + 5),
        rows([(0.3, 20, "c")] * 2, "q", NOW + 2),
        ram={"a", "b", "c", "t0"},
        max_batch=4,
    )
    plain, timed = cm.estimate(job(), view), cm.estimate(job(NOW + 1), view)
    for key in ("wait", "run", "residency", "imposed", "adapters", "total", "admit_step"):
        assert plain[key] == timed[key]
    assert timed["late_s"] > 0 and plain["late_s"] == 0.0
    assert all(v >= 0 for v in timed.values())


def test_a_job_without_a_deadline_ranks_after_rows_with_one(cm):
    """On a slack worker, rows with deadlines precede a job without one (infinite slack), as do
    rows without one that arrived before it: it waits for the whole queue, as under FIFO."""
    view = worker(
        "w",
        rows([(0.1, 10, "a")] * 8, "r", NOW + 100),
        rows([(0.1, 20, "a")] * 4, "q", NOW + 3600),
        ram={"a", "t0"},
        order=SLACK,
    )
    est = cm.estimate(job(), view)
    assert est["admit_step"] == 10 and est["parked"] == 0 and est["ahead"] == 12
    fifo = cm.estimate(job(), replace(view, order=FIFO))
    assert all(est[k] == fifo[k] for k in ("wait", "run", "total", "admit_step", "ahead"))


# ----- heartbeats -------------------------------------------------------------------------------
def test_views_carry_deadlines_priorities_and_the_steps_a_parked_row_has_left():
    beat = protocol.WorkerHeartbeat(
        worker_id="w1",
        model_id=MODEL,
        device="cpu",
        at=1.0,
        max_batch=4,
        batching="continuous",
        running=[protocol.RunningRow("a", 0.1, 7, "t", deadline=50.0, priority=2, due=True)],
        waiting=[
            protocol.WaitingRow(
                "b", 0.2, 20, "u", deadline=60.0, priority=1, step=8, waited_s=12.5, due=True
            )
        ],
        finish_tail_s=0.25,
    )
    view = view_from_heartbeat(protocol.decode(protocol.encode(beat)), SLACK)
    assert view.finish_tail_s == 0.25 and view.seen_at == 1.0
    (run,), (wait,) = view.running, view.waiting
    assert (run.deadline, run.priority, run.remaining_steps, run.due) == (50.0, 2, 7, True)
    assert (wait.deadline, wait.priority, wait.step, wait.remaining_steps) == (60.0, 1, 8, 12)
    assert wait.due and view.waited_s(wait, 3.0) == 14.5  # it waited on after the report
    assert view.order == SLACK and view_from_heartbeat(beat).order == FIFO


def test_row_order_refuses_an_unknown_scheduler():
    with pytest.raises(ValueError, match="scheduler must be one of"):
        RowOrder("lifo")


def test_held_jobs_are_placed_by_priority_then_deadline_then_arrival():
    now = 1000.0
    levels = [
        (0, now + 600.0),  # 0: bulk
        (0, 0.0),  # 1: no deadline
        (0, now + 30.0),  # 2: tight
        (0, now + 600.0),  # 3: bulk, later
        (5, 0.0),  # 4: higher priority, no deadline
        (0, now - 5.0),  # 5: past its deadline already
    ]
    assert placing_order(levels, now) == [4, 5, 2, 0, 3, 1]
    assert placing_order([], now) == []

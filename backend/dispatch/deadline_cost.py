"""Routing with deadlines (pure): in what order a worker gives its slots to its rows and to the job
being placed, and which worker a job with a deadline goes to.

The router's cost of a job J on worker W (``RoutingCostModel.estimate``) replays W's slots at step
granularity. Which rows are ahead of J depends on how W orders its rows (``RowOrder.scheduler``,
the deployment's ``deadlines.scheduler``); the order between two rows is
``backend.costmodel.slack.precedence`` (priority, then least slack, then arrival), with each row's
slack ``slack_s(deadline, now, remaining steps, T)`` and T the cost model's step latency of W's
batch with J in it (a row without a deadline has infinite slack):

* ``fifo``: running rows keep their slots; waiting rows take freed slots in arrival order; J last.
  Exactly the replay the router made before deadlines.
* ``edf``: running rows keep their slots; the waiting rows and J take freed slots in precedence
  order. Rows ranked behind J are admitted after it (and may then run beside it).
* ``slack``: as ``edf``, and running rows join the order: a waiting row (or J) ranked before a
  running row displaces it as the worker's planning round would (``backend.worker.batching``):
  only when waiting for the first slot to free would make it late, at the first round boundary at
  which its slack (shrinking while it waits) is under ``URGENT_ROUNDS`` rounds and the round has
  parks left (``max_parks_per_round``), if that comes sooner than the free slot. The running row
  parked is the last ranked one with more slack that stays on time after sitting out a round and
  is not recording its template's cache (the worker never parks a recording); it
  resumes its remaining steps when its turn in the order comes and a slot frees. Round boundaries
  are at ``round_steps // 2 + m * round_steps`` steps (m = 0, 1, ...): the router does not know
  the round's phase, so the next one is expected half a round away. With ``urgent_parks``, a
  row that would be late at that boundary is let in at once instead, within the parks left
  before it (taken as a whole round's). With ``max_parks_per_round`` 0 nothing is parked: ``edf``.

So under ``edf`` and ``slack`` a tight job is not charged for the rows with more slack queued
ahead of it, and under ``slack`` the running row it displaces when it would otherwise be late
(``parked``: 1) no longer runs beside it.

Batch sizing (``slack`` with ``size_batches``, ``sizing_hold``): W keeps J out of a free slot while
a running row that goes before J, late in the batch with J in it (its slack at T < 0) and on time
were it alone, would be made late; the replay then gives J no slot before the last such row ends
(``not_before``), and the slot J will take is not lent to rows behind it meanwhile. J is not held
when it must join now to be on time (under ``URGENT_ROUNDS`` rounds of slack): the worker then
lets it in if it can be on time, which the router does not tell apart. The worker may let J in a
little sooner (once the protected row has few enough steps left that J no longer makes it late);
the router takes the row's end.

The starvation bound (``max_wait_s``, edf and slack): a heartbeat reports each waiting row's wait
so far and the rows the worker found due. A row due there, or whose wait (counted on to the
decision) passes the bound within the worker's next round and ``DUE_MARGIN_STEPS`` steps, goes
before every other row, longest wait first, as on the worker; a due running row is never parked.
Rows that come due later, while J waits, are not modelled.

Not modelled: the worker parking rows to shrink a batch for a late running row
(``shrink_batches``), rows that arrive after J, and pre/post-processing after the last step.

The choice (``choose_by_deadline``) for a job with a deadline: among the workers where its
predicted finish (now + wait + run + residency + adapters) is by its deadline, the least
mask-aware cost (``total``: so template and adapter residency still matter); when none is, the
worker where it is least late (ties: the least total, then the smallest id). A job without a
deadline is ranked by ``total`` alone, as before.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.costmodel.slack import (
    DEFAULT_MAX_PARKS_PER_ROUND,
    NO_DEADLINE,
    SCHEDULERS,
    URGENT_ROUNDS,
    comes_due,
    due_within_s,
    parks_for,
    precedence,
    slack_s,
)

if TYPE_CHECKING:
    from backend.dispatch.views import JobRequest, RowState, WorkerView

JOB = -1  # the job's index in an order of rows


@dataclass(frozen=True)
class RowOrder:
    """How a worker orders its rows, as the router models it (module docstring); the worker's
    ``deadlines`` settings."""

    scheduler: str = "fifo"
    round_steps: int = 5
    max_parks_per_round: int = DEFAULT_MAX_PARKS_PER_ROUND
    size_batches: bool = True
    urgent_parks: bool = True
    max_wait_s: float = math.inf  # the starvation bound (``deadlines.max_wait_s``)
    park_by_deadline: bool = True  # a row parked only for an earlier deadline (``parks_for``)

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.round_steps < 1 or self.max_parks_per_round < 0:
            raise ValueError("round_steps must be >= 1 and max_parks_per_round >= 0")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")

    @property
    def parks(self) -> bool:
        return self.scheduler == "slack" and self.max_parks_per_round > 0

    @property
    def sizes(self) -> bool:
        """W keeps a row out of a free slot to keep a tighter running row on time."""
        return self.scheduler == "slack" and self.size_batches


FIFO = RowOrder()
BEFORE_ROUND = -1  # the replay's "round" of urgent parks, before the next boundary


@dataclass(frozen=True)
class Replay:
    """J's place in a worker's slot replay."""

    admit: float  # the step at which J takes a slot
    first: tuple[int, ...]  # rows (index into running + waiting) in the batch of the next step
    co_runners: tuple[tuple[float, int], ...]  # (steps overlapping J's, row index)
    ahead: int  # rows that take a slot before J (running rows that keep theirs included)
    parked: int  # running rows W parks for J (0 or 1)


def deadlines_matter(job: JobRequest, view: WorkerView) -> bool:
    """Whether W's order can differ from arrival order: it schedules by deadline and J or one of
    W's rows has a deadline or a priority."""
    if view.order.scheduler == "fifo":
        return False
    rows = (*view.running, *view.waiting)
    return bool(job.deadline != NO_DEADLINE or job.priority) or any(
        r.deadline != NO_DEADLINE or r.priority for r in rows
    )


def row_order(
    job: JobRequest, view: WorkerView, step_s: float
) -> tuple[list[int], dict[int, float]]:
    """The rows that compete for slots, J (``JOB``) among them, in W's order (fifo and edf list
    only the waiting rows and J: running rows keep their slots; slack lists every row), and the
    slack of every row and of J now, in a batch stepping every ``step_s`` seconds."""
    num_running = len(view.running)
    rows: list[tuple[int, RowState]] = list(enumerate(view.waiting, start=num_running))
    if view.order.parks:
        rows = list(enumerate(view.running)) + rows
    slack = {i: slack_s(r.deadline, job.now, r.remaining_steps, step_s) for i, r in rows}
    slack[JOB] = own = slack_s(job.deadline, job.now, job.num_steps, step_s)
    if view.order.scheduler == "fifo":
        return [i for i, _ in rows] + [JOB], slack
    by = view.order
    within_s = due_within_s(by.scheduler, by.round_steps, step_s)
    keys = []
    for i, r in rows:
        waited = view.waited_s(r, job.now)
        due = comes_due(r.due, waited, within_s, by.max_wait_s)
        keys.append((_rank(r.priority, slack[i], float(i), due, waited), i))
    keys.append((_rank(job.priority, own, math.inf), JOB))
    keys.sort()
    return [i for _, i in keys], slack


def _rank(
    priority: int, slack: float, enqueued_at: float, due: bool = False, waited_s: float = 0.0
) -> tuple[int, float, int, float, float]:
    """A row's ``precedence`` as the router sees it: a row's arrival is its index (J: after every
    row of W, and never due: it has not waited)."""
    return precedence(
        starved=due, waited_s=waited_s, priority=priority, slack=slack, enqueued_at=enqueued_at
    )


def placing_order(levels: Sequence[tuple[int, float]], now: float) -> list[int]:
    """The order in which the dispatcher places jobs waiting for a worker, as indices into
    ``levels`` ((priority, deadline) of each job, in arrival order): ``_rank`` with no steps
    counted, so higher priority first, then the earliest deadline (a job without one last), then
    arrival. A late-binding backlog thus gives a freed slot to a tight job before the bulk jobs
    held ahead of it, as the workers would."""
    return sorted(
        range(len(levels)),
        key=lambda i: _rank(levels[i][0], slack_s(levels[i][1], now, 0, 0.0), float(i)),
    )


def sizing_hold(
    job: JobRequest, view: WorkerView, step_s: float, alone_s: Callable[[int], float]
) -> int:
    """Steps J is kept out of a free slot by W's batch sizing (module docstring); 0 when W does not
    size batches or nothing holds J. ``step_s``: the step time of W's batch with J in it;
    ``alone_s(i)``: that of running row i alone (asked only of rows late beside J)."""
    if not view.order.sizes or step_s <= 0.0:
        return 0
    own = slack_s(job.deadline, job.now, job.num_steps, step_s)
    if own < URGENT_ROUNDS * view.order.round_steps * step_s:
        return 0  # it must join now to be on time: the worker lets it in
    key = _rank(job.priority, own, math.inf)
    return max(
        (
            max(0, r.remaining_steps)
            for i, r in enumerate(view.running)
            if r.deadline != NO_DEADLINE
            and (late := slack_s(r.deadline, job.now, r.remaining_steps, step_s)) < 0
            and _rank(r.priority, late, float(i)) < key
            and slack_s(r.deadline, job.now, r.remaining_steps, alone_s(i)) >= 0
        ),
        default=0,
    )


def replay(
    steps: Sequence[int],
    num_running: int,
    order: Sequence[int],
    n: int,
    cap: int,
    row: RowOrder,
    slack: Mapping[int, float] | None = None,
    step_s: float = 0.0,
    unparkable: Collection[int] = (),
    not_before: int = 0,
    deadlines: Mapping[int, float] | None = None,
) -> Replay:
    """Replay W's slots (module docstring): ``steps`` the remaining steps of the running rows then
    the waiting rows, ``order`` and ``slack`` what ``row_order`` gives, ``n`` J's steps, ``cap``
    W's max batch, ``step_s`` its step time, ``unparkable`` the running rows W never parks (those
    recording their template's cache), ``not_before`` the step before which J takes no slot
    (``sizing_hold``), ``deadlines`` every row's and J's (with ``row.park_by_deadline`` a row is
    parked only for an earlier one; None: parks by precedence alone). Each row in turn takes the
    slot that frees first; under fifo (and ``not_before`` 0) this is the router's replay from before
    deadlines, operation for operation.
    """
    if row.parks and slack is not None and step_s > 0:
        return _replay_parking(
            steps, num_running, order, n, cap, row, slack, step_s, unparkable, not_before, deadlines
        )
    heap = [(steps[i], i) for i in range(num_running)]  # running rows keep their slots
    heapq.heapify(heap)
    first = list(range(num_running))  # rows that hold a slot from the next step
    admit, ahead, placed = 0, num_running, False
    co_runners: list[tuple[float, int]] = []
    after: list[tuple[int, int, int]] = []  # rows placed after J: (start, end, row)
    for i in order:
        if i == JOB:
            admit = max(not_before, heap[0][0] if len(heap) >= cap else 0)
            # the rows in slots when J takes one: each overlaps J until it ends (or J does)
            co_runners = [(min(f - admit, n), k) for f, k in heap if f > admit]
            if len(heap) >= cap:
                heapq.heappop(heap)
            heapq.heappush(heap, (admit + n, JOB))
            placed = True
            continue
        s = steps[i]
        if len(heap) < cap:
            start = 0
            heapq.heappush(heap, (s, i))
            first.append(i)
        else:
            start = heapq.heappop(heap)[0]
            heapq.heappush(heap, (start + s, i))
        if placed:
            after.append((start, start + s, i))
        else:
            ahead += 1
    end = admit + n  # a row placed after J starts no sooner than J
    co_runners += [(min(e, end) - s0, k) for s0, e, k in after if min(e, end) > s0]
    return Replay(admit, tuple(first), tuple(co_runners), ahead, 0)


def _replay_parking(
    steps: Sequence[int],
    num_running: int,
    order: Sequence[int],
    n: int,
    cap: int,
    row: RowOrder,
    slack: Mapping[int, float],
    step_s: float,
    unparkable: Collection[int] = (),
    not_before: int = 0,
    deadlines: Mapping[int, float] | None = None,
) -> Replay:
    """The slack scheduler's replay (module docstring): every row in ``order``, running ones
    included. A running row keeps its slot unless a row ranked before it displaces it; it is then
    parked and, when its turn in ``order`` comes, resumes its remaining steps in the first slot to
    free. A waiting row (or J) displaces one only as the worker's planning round would
    (``backend.worker.batching``): when waiting for the first slot to free would make it late, at
    the first round boundary at which its slack is under ``URGENT_ROUNDS`` rounds and the round
    has parks left, if that is sooner; the running row parked is the last ranked one that has
    more slack, stays on time after sitting out a round, is not ``unparkable`` and (with
    ``deadlines`` and ``park_by_deadline``) is due after the row that parks it."""
    rank = {i: pos for pos, i in enumerate(order)}
    round_s = row.round_steps * step_s
    slots: list[tuple[float, int | None]] = [(float(steps[i]), i) for i in range(num_running)]
    slots += [(0.0, None)] * max(0, cap - num_running)  # (when it frees, its holder)
    spans: dict[int, list[tuple[float, float]]] = {
        i: [(0.0, float(steps[i]))] for i in range(num_running)
    }
    left = list(steps)  # steps each row has left to run
    holding = set(range(num_running))  # running rows still in their slot, not yet reached
    parkable = holding - set(unparkable)

    def gives_way(victim: int, row_index: int) -> bool:
        if deadlines is None or not row.park_by_deadline:
            return True
        return parks_for(deadlines[victim], deadlines[row_index])

    # round (0: the next; BEFORE_ROUND: before it, urgent parks) -> parks it made
    used: dict[int, int] = {}
    admit, ahead, parked = 0.0, 0, 0
    for pos, i in enumerate(order):
        if i in holding:  # its turn: it keeps its slot
            holding.discard(i)
            continue
        k = min(range(len(slots)), key=lambda j: (slots[j][0], j))
        start = slots[k][0]
        own = slack[i]
        if start > 0.0 and i not in spans and start * step_s > own:  # it would be late: park?
            # the first round at which it is urgent, with parks left
            m = max(
                0,
                math.ceil(
                    ((own - URGENT_ROUNDS * round_s) / step_s - row.round_steps // 2)
                    / row.round_steps
                ),
            )
            limit = row.max_parks_per_round
            while used.get(m, 0) >= limit:
                m += 1
            boundary = row.round_steps // 2 + m * row.round_steps
            if row.urgent_parks and own < boundary * step_s and used.get(BEFORE_ROUND, 0) < limit:
                m, boundary = BEFORE_ROUND, 0  # late by that round: the worker parks for it at once
            then = own - boundary * step_s  # its slack at that boundary (it waited meanwhile)
            victims = [
                j
                for j, (_, h) in enumerate(slots)
                if h in holding
                and h in parkable
                and slack[h] - round_s >= 0
                and slack[h] > then
                and gives_way(h, i)
            ]
            if boundary < start and victims:
                k = max(victims, key=lambda j: rank[slots[j][1]])  # type: ignore[index]
                victim = slots[k][1]
                assert victim is not None
                holding.discard(victim)
                left[victim] -= boundary
                spans[victim] = [(0.0, float(boundary))] if boundary else []  # ran until then
                start, used[m], parked = float(boundary), used.get(m, 0) + 1, parked + (i == JOB)
        if i == JOB:
            start = max(start, float(not_before))
        end = start + (n if i == JOB else left[i])
        slots[k] = (end, i)
        if i == JOB:
            admit, ahead = start, pos
        else:
            spans.setdefault(i, []).append((start, end))
    end = admit + n
    co_runners = []
    for k, intervals in sorted(spans.items()):
        overlap = sum(max(0.0, min(e, end) - max(s0, admit)) for s0, e in intervals)
        if overlap > 0:
            co_runners.append((overlap, k))
    first = tuple(sorted(k for k, iv in spans.items() if iv and iv[0][0] == 0.0))
    return Replay(admit, first, tuple(co_runners), ahead, parked)


def finish_terms(job: JobRequest, terms: Mapping[str, float]) -> dict[str, float]:
    """``finish_s`` (now -> J's last step: wait + run + residency + adapters; ``imposed`` is what
    J costs its co-runners, not its own time), ``finish_at`` (on the deadlines' clock) and
    ``late_s`` (past the deadline, 0 without one)."""
    own = terms["wait"] + terms["run"] + terms["residency"] + terms["adapters"]
    at = job.now + own
    late = max(0.0, at - job.deadline) if job.deadline != NO_DEADLINE else 0.0
    return {"finish_s": own, "finish_at": at, "late_s": late}


def choose_by_deadline(
    job: JobRequest, candidates: Sequence[WorkerView], estimates: Mapping[str, Mapping[str, float]]
) -> tuple[str, dict[str, float], str]:
    """(worker id, cost per candidate, why) for a job with a deadline (module docstring). The cost
    of a worker where J is on time is its ``total``; where it is late, the largest total of any
    candidate plus its lateness, so every late worker ranks after every on-time one and the least
    late first: the least cost still wins, ties to the smallest id."""
    ceiling = max(e["total"] for e in estimates.values())
    costs = {
        w: e["total"] if e["late_s"] <= 0.0 else ceiling + e["late_s"] for w, e in estimates.items()
    }
    best = min(candidates, key=lambda w: (costs[w.worker_id], w.worker_id)).worker_id
    terms, on_time = estimates[best], sum(1 for e in estimates.values() if e["late_s"] <= 0.0)
    if terms["late_s"] <= 0.0:
        why = (
            f"meets its deadline on {on_time} of {len(estimates)}: min estimated completion "
            f"{terms['total']:.3f} s, finishing {job.deadline - terms['finish_at']:.3f} s early"
        )
    else:
        why = f"late on every worker: least late, by {terms['late_s']:.3f} s"
    parks = f", parks {int(terms.get('parked', 0))} row" if terms.get("parked") else ""
    return best, costs, why + parks

"""Deadline-aware step scheduling: the plan ``BatchScheduler`` follows and its pure helpers (no
torch, no redis, no clock: ``now`` is always an argument).

A ``DeadlinePlan`` picks one of three step schedulers (``Settings.deadlines.scheduler``):

* ``fifo``: arrival order, exactly the scheduler MaskServe had before deadlines;
* ``edf``: waiting rows take free slots in ``precedence`` order (starved first, then priority, then
  least slack, then arrival); a running row keeps its slot;
* ``slack`` (after TetriServe): as ``edf`` at every step, and every ``round_steps`` steps a planning
  round may park running rows with slack to spare so that tighter waiting rows get their slots;
  with ``size_batches``, a free slot stays empty while filling it would make a running row late
  that goes before the waiting row (``delays_a_tighter_row``): a batch's step time grows with its
  rows, and a tight row needs short steps more than the loose row needs to start now; with
  ``shrink_batches``, at any step a running row late at the batch's step time may have rows with
  slack to spare parked (``rows_to_park_for``) so that it is on time in the smaller batch; with
  ``urgent_parks``, a waiting row that would be late if it waited for the next planning round
  may have a row parked for it at any step, by the round's rules. All park kinds share the churn
  bound, ``max_parks_per_round`` parks per round; with ``park_by_deadline`` a row is parked only
  for a row due before it (``costmodel.slack.parks_for``).

In ``edf`` and ``slack``, with ``keep_slot_while_reading``, a waiting row passed over for a free
slot while its template's cache is read into RAM keeps that slot from the rows due after it
(``slots_kept_from``) when no running row ends in time for it: otherwise a looser row behind it
takes the slot and holds it for all its steps, and the tight row finds the batch full once its
read lands.

Slack and precedence have one definition, ``backend.costmodel.slack``: this module only says which
step time they use, that of the batch as it would be (``planned_step_s``), and how long a row has
waited (``waited_s``: queued or parked, summed over every wait).

``backend.worker.forecast_run`` predicts, for every row of a worker, its queue position and the
epochs of its next and last steps, by running the scheduler's own order forward on the predicted
step times.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.costmodel.slack import (
    DEFAULT_MAX_PARKS_PER_ROUND,
    NO_DEADLINE,
    SCHEDULERS,
    URGENT_ROUNDS,
    parks_for,
    precedence,
    slack_s,
)

if TYPE_CHECKING:  # batching imports this module: the row type is only needed for annotations
    from backend.config_deadlines import DeadlineSettings
    from backend.worker.batch_rows import Row

StepTime = Callable[[Sequence["Row"]], float]


@dataclass(frozen=True, kw_only=True)
class DeadlinePlan:
    """How a worker's ``BatchScheduler`` orders and parks rows (``Settings.deadlines``).

    ``step_time(rows)``: predicted seconds of one step of a batch made of ``rows`` (the worker
    answers from its fitted cost model; it is called O(rows) times per schedule or forecast).
    """

    scheduler: str = "slack"
    round_steps: int = 5
    max_wait_s: float = 300.0
    max_parks_per_round: int = DEFAULT_MAX_PARKS_PER_ROUND
    size_batches: bool = True
    shrink_batches: bool = True
    urgent_parks: bool = True
    park_by_deadline: bool = True
    keep_slot_while_reading: bool = True
    step_time: StepTime

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"step scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}"
            )
        if self.round_steps < 1:
            raise ValueError(f"round_steps must be at least 1, got {self.round_steps}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be positive, got {self.max_wait_s}")
        if self.max_parks_per_round < 0:
            raise ValueError(f"max_parks_per_round must be >= 0, got {self.max_parks_per_round}")

    @classmethod
    def from_settings(cls, settings: DeadlineSettings, step_time: StepTime) -> DeadlinePlan:
        """The plan of ``Settings.deadlines``, with the worker's step-time prediction."""
        return cls(
            scheduler=settings.scheduler,
            round_steps=settings.round_steps,
            max_wait_s=settings.max_wait_s,
            max_parks_per_round=settings.max_parks_per_round,
            size_batches=settings.size_batches,
            shrink_batches=settings.shrink_batches,
            urgent_parks=settings.urgent_parks,
            park_by_deadline=settings.park_by_deadline,
            keep_slot_while_reading=settings.keep_slot_while_reading,
            step_time=step_time,
        )

    def step_s(self, rows: Sequence[Row]) -> float:
        """Predicted step time of a batch of ``rows``; 0 for no rows, never negative."""
        return max(0.0, float(self.step_time(rows))) if rows else 0.0


@dataclass(frozen=True)
class RowForecast:
    """Where a row stands on a worker: ``position`` in the queue (1 = next to join; 0 = running),
    ``start`` the predicted epoch of its next step (its first, for a row that has not run) and
    ``finish`` the predicted epoch at which its last step ends."""

    position: int
    start: float
    finish: float


# ----- per row ---------------------------------------------------------------------------------
def waited_s(row: Row, now: float) -> float:
    """Seconds ``row`` has waited, queued or parked, over all its waits up to ``now``."""
    open_wait = now - row.waiting_since if row.waiting_since is not None else 0.0
    return row.wait_s + max(0.0, open_wait)


def starved(row: Row, now: float, plan: DeadlinePlan) -> bool:
    """Past the starvation bound: the row goes first and is never parked again."""
    return due(row, now, plan, 0.0)


def due(row: Row, now: float, plan: DeadlinePlan, within_s: float) -> bool:
    """Whether ``row`` would be past the starvation bound if it waited ``within_s`` more seconds:
    to keep the bound it must have a slot within them. Starved rows are due at any ``within_s``."""
    return waited_s(row, now) + within_s > plan.max_wait_s


def row_slack(row: Row, now: float, step_s: float) -> float:
    """``slack_s`` of the row at ``now`` in a batch stepping every ``step_s`` seconds."""
    return slack_s(row.deadline, now, row.remaining_steps, step_s)


def row_key(
    row: Row, now: float, step_s: float, plan: DeadlinePlan
) -> tuple[int, float, int, float, float]:
    """The row's ``precedence`` (smaller goes first)."""
    return precedence(
        starved=starved(row, now, plan),
        waited_s=waited_s(row, now),
        priority=row.priority,
        slack=row_slack(row, now, step_s),
        enqueued_at=row.enqueued_at,
    )


# ----- per batch -------------------------------------------------------------------------------
def planned_step_s(
    plan: DeadlinePlan, running: Sequence[Row], waiting: Sequence[Row], max_batch: int, now: float
) -> float:
    """Step time of the batch as it would be: the ``max_batch`` rows of highest precedence among
    ``running`` and ``waiting``. Precedence needs a step time and the step time needs the batch, so
    a first guess (the running rows topped up from the queue in its order) orders the rows once and
    the batch they choose is priced again: two ``step_time`` calls."""
    if not running and not waiting:
        return 0.0
    guess = plan.step_s([*running, *waiting][:max_batch])
    rows = sorted([*running, *waiting], key=lambda r: row_key(r, now, guess, plan))
    return plan.step_s(rows[:max_batch])


def on_time_alone(row: Row, now: float, plan: DeadlinePlan) -> bool:
    """Whether ``row`` can still meet its deadline: on time were it alone in the batch (the
    shortest step there is; TetriServe's test for a request that is not yet "definitely late").
    Turns one way: while the row runs beside others or waits, its slack alone only shrinks."""
    return row_slack(row, now, plan.step_s([row])) >= 0


def must_join_now(plan: DeadlinePlan, running: Sequence[Row], row: Row, now: float) -> bool:
    """Whether waiting ``row`` has under ``URGENT_ROUNDS`` rounds of slack beside ``running``: it
    must join now to be on time. Turns one way: a waiting row's slack only shrinks."""
    return _short_of_slack(plan, row, now, plan.step_s([*running, row]))


def _short_of_slack(plan: DeadlinePlan, row: Row, now: float, with_row: float) -> bool:
    return row_slack(row, now, with_row) < URGENT_ROUNDS * plan.round_steps * with_row


def gives_way(plan: DeadlinePlan, victim: Row, row: Row) -> bool:
    """Whether running ``victim`` may be parked for ``row`` as far as deadlines go: always when the
    plan parks by precedence alone, else only for an earlier deadline (``parks_for``)."""
    return not plan.park_by_deadline or parks_for(victim.deadline, row.deadline)


def slots_kept_from(plan: DeadlinePlan, row: Row, kept: Sequence[Row]) -> int:
    """How many free slots ``row`` may not take: one for each row of ``kept`` (rows before it in
    this schedule's order that keep a slot while their cache is read: the scheduler lists them
    only with ``keep_slot_while_reading``) that is due before it (``parks_for``; by precedence
    alone, every one of them). The scheduler never keeps out a row due for the starvation
    bound."""
    if not plan.park_by_deadline:
        return len(kept)
    return sum(1 for before in kept if parks_for(row.deadline, before.deadline))


def sits_out_safely(
    plan: DeadlinePlan, victim: Row, tight: Row, now: float, step_s: float, rest_step_s: float
) -> bool:
    """Whether running ``victim`` (slack at ``step_s``) keeps ``URGENT_ROUNDS`` rounds of slack
    after sitting out ``tight``'s remaining steps (at ``rest_step_s``): parked, it neither rushes
    back at once nor is made late."""
    slack_after = row_slack(victim, now, step_s) - tight.remaining_steps * rest_step_s
    return slack_after >= URGENT_ROUNDS * plan.round_steps * step_s


def on_time_if_it_joins(plan: DeadlinePlan, running: Sequence[Row], row: Row, now: float) -> bool:
    """Whether waiting ``row`` would be on time beside ``running`` once shrinking (when the plan
    shrinks) parked for it the running rows it may: those it precedes that may leave the batch
    (``parkable``, not starved) and sit out its steps safely. The round's park budget is not
    counted: the answer is whether joining can work, not a plan of parks."""
    step_s = plan.step_s([*running, row])
    key = row_key(row, now, step_s, plan)

    def stays(r: Row) -> bool:
        return not (
            plan.shrink_batches
            and r.parkable
            and not starved(r, now, plan)
            and row_key(r, now, step_s, plan) > key
            and gives_way(plan, r, row)
            and sits_out_safely(plan, r, row, now, step_s, step_s)
        )

    return row_slack(row, now, plan.step_s([*(r for r in running if stays(r)), row])) >= 0


def delays_a_tighter_row(
    plan: DeadlinePlan, running: Sequence[Row], row: Row, now: float, without: float
) -> bool:
    """Whether waiting ``row`` should stay out of the ``running`` batch although a slot is free:
    adding it lengthens the batch's step (from ``without``, the step time of ``running``: the
    caller prices it once per batch) so that a running row that precedes it, and can still be on
    time (``on_time_alone``), is late (slack < 0 at the step time with ``row``): on time now and
    made late, or late already and made later when shrinking might still save it.

    Never for a starved row, nor for a row that must join now to be on time itself
    (``must_join_now``) and can be on time if it joins (``on_time_if_it_joins``: shrinking may
    park rows for it): it joins, and the order between the two is the planning rounds' business.
    A row that would be late beside the batch anyway stays out: its joining would cost the
    running row its deadline and save neither (TetriServe counts rows on time). A row kept out
    waits at most until that row ends or cannot be on time any more, or until its own slack runs
    short while it can still be on time, or until it starves."""
    if not running or starved(row, now, plan):
        return False
    with_row = plan.step_s([*running, row])
    if not with_row > without:
        return False  # a step that does not grow (a launch-bound device): nobody is delayed
    if _short_of_slack(plan, row, now, with_row) and on_time_if_it_joins(plan, running, row, now):
        return False
    key = row_key(row, now, with_row, plan)
    return any(
        r.deadline != NO_DEADLINE
        and row_slack(r, now, with_row) < 0
        and row_key(r, now, with_row, plan) < key
        and on_time_alone(r, now, plan)
        for r in running
    )


def rows_to_park_for(
    plan: DeadlinePlan,
    running: Sequence[Row],
    tight: Row,
    now: float,
    may_park: Callable[[Row], bool],
    budget: int,
) -> list[Row]:
    """The running rows to park now so that running row ``tight``, late at the step time of the
    whole ``running`` batch, is on time in the smaller batch left; [] when it is on time already,
    when no set of at most ``budget`` rows does it (a park that does not save the row only costs
    throughput), or when steps do not grow with rows.

    Candidates are the rows ``may_park`` allows (the scheduler's churn rules) that ``tight``
    precedes and that give way to it (``gives_way``), taken loosest first (last in precedence): each
    must still have ``URGENT_ROUNDS`` rounds of slack after sitting out ``tight``'s remaining steps,
    so that it does not rush back in at once and is not made late itself; it rejoins when
    ``delays_a_tighter_row`` lets it."""
    if budget < 1 or tight.deadline == NO_DEADLINE:
        return []
    step_now = plan.step_s(running)
    if row_slack(tight, now, step_now) >= 0:
        return []
    key = row_key(tight, now, step_now, plan)
    candidates = [
        r for r in running if r is not tight and may_park(r) and gives_way(plan, r, tight)
    ]
    loosest_first = sorted(
        (r for r in candidates if row_key(r, now, step_now, plan) > key),
        key=lambda r: row_key(r, now, step_now, plan),
        reverse=True,
    )
    kept, parked, kept_step = list(running), [], step_now
    for victim in loosest_first:
        rest = [r for r in kept if r is not victim]
        rest_step = plan.step_s(rest)
        if not rest_step < kept_step:
            continue  # this row adds nothing to the step time: parking it saves no one
        if not sits_out_safely(plan, victim, tight, now, step_now, rest_step):
            continue
        kept, kept_step = rest, rest_step
        parked.append(victim)
        if row_slack(tight, now, kept_step) >= 0:
            return parked
        if len(parked) == budget:
            break
    return []


def ordered(rows: Iterable[Row], now: float, step_s: float, plan: DeadlinePlan) -> list[Row]:
    """``rows`` in precedence order (stable: FIFO among equals)."""
    return sorted(rows, key=lambda r: row_key(r, now, step_s, plan))


def slot_order(rows: Iterable[Row], now: float, step_s: float, plan: DeadlinePlan) -> list[Row]:
    """Waiting ``rows`` in the order they take slots: the due ones (``Row.due``) first, longest
    wait first (the order ``mark_due`` counts them in), then the others in precedence order."""
    in_precedence = ordered(rows, now, step_s, plan)
    due = sorted((r for r in in_precedence if r.due), key=lambda r: -waited_s(r, now))
    return due + [r for r in in_precedence if not r.due]


def mark_due(
    running: Iterable[Row],
    waiting: Iterable[Row],
    max_batch: int,
    now: float,
    step_s: float,
    plan: DeadlinePlan,
    within_s: float,
) -> None:
    """Mark (``Row.due``) the ``waiting`` rows that must take a slot now to keep the starvation
    bound, counting the rows that come due before them. Taken longest wait first, each is placed
    in the slot that frees first (slots held by due ``running`` rows free as their steps end,
    ``step_s`` each; the others are free now: due rows may park their rows); a row that would pass
    the bound by the time it starts there and within ``within_s`` more (the next round, with its
    margin) is due, and so is every row that waited longer (the placement put them first). A
    burst's rows come due early enough for the last of them, instead of all at once with more rows
    than slots."""
    running, waiting = list(running), list(waiting)
    # no row starts later than after every step left here: when even the longest wait stays
    # inside the bound by then (the usual case), nothing is due and no sort is needed
    latest_s = within_s + step_s * sum(r.remaining_steps for r in (*running, *waiting))
    if max((waited_s(r, now) for r in waiting), default=-latest_s) <= plan.max_wait_s - latest_s:
        return
    busy_s = [r.remaining_steps * step_s for r in running if r.due]
    slots_free_at = busy_s + [0.0] * max(0, max_batch - len(busy_s))
    heapq.heapify(slots_free_at)
    longest_first = sorted(waiting, key=lambda r: -waited_s(r, now))
    last_due = -1
    for i, row in enumerate(longest_first):
        start_s = heapq.heappop(slots_free_at)
        if due(row, now, plan, within_s + start_s):
            last_due = i
        heapq.heappush(slots_free_at, start_s + row.remaining_steps * step_s)
    for row in longest_first[: last_due + 1]:
        row.due = True

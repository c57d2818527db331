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
  slack to spare parked (``rows_to_park_for``) so that it is on time in the smaller batch. Both
  park kinds share the churn bound, ``max_parks_per_round`` parks per round.

Slack and precedence have one definition, ``backend.costmodel.slack``: this module only says which
step time they use, that of the batch as it would be (``planned_step_s``), and how long a row has
waited (``waited_s``: queued or parked, summed over every wait).

``forecast`` predicts, for every row of a worker, its queue position and the epochs of its next and
last steps, by running the scheduler's own order forward on the predicted step times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from backend.costmodel.slack import NO_DEADLINE, precedence, slack_s

if TYPE_CHECKING:  # batching imports this module: the row type is only needed for annotations
    from backend.config_deadlines import DeadlineSettings
    from backend.worker.batching import Row

SCHEDULERS = ("fifo", "edf", "slack")
# A waiting row asks for a park only when fewer than this many rounds of slack are left: a row with
# more can wait for a later round (or a slot that frees by itself) and still be on time. Without
# this, least-slack-first parks running rows for fresh rows of the same deadline (a fresh row has
# more steps left, hence less slack) and the batch thrashes; two rounds leave one round of margin
# for step times that come out longer than predicted.
URGENT_ROUNDS = 2

StepTime = Callable[[Sequence["Row"]], float]
# keeps_out(batch, row, now, batch_step_s): batch sizing's answer (``delays_a_tighter_row``)
KeepsOut = Callable[[Sequence["Row"], "Row", float, float], bool]


@dataclass(frozen=True, kw_only=True)
class DeadlinePlan:
    """How a worker's ``BatchScheduler`` orders and parks rows (``Settings.deadlines``).

    ``step_time(rows)``: predicted seconds of one step of a batch made of ``rows`` (the worker
    answers from its fitted cost model; it is called O(rows) times per schedule or forecast).
    """

    scheduler: str = "slack"
    round_steps: int = 5
    max_wait_s: float = 300.0
    max_parks_per_round: int = 2
    size_batches: bool = True
    shrink_batches: bool = True
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
    return waited_s(row, now) > plan.max_wait_s


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


def delays_a_tighter_row(
    plan: DeadlinePlan, running: Sequence[Row], row: Row, now: float, without: float
) -> bool:
    """Whether waiting ``row`` should stay out of the ``running`` batch although a slot is free:
    adding it lengthens the batch's step so that a running row that precedes it and is on time
    without it (slack >= 0 at ``without``, the step time of ``running``: the caller prices it once
    per batch) would be late (slack < 0 at the step time with ``row``). Never for a starved row,
    nor for a row that must join now to be on time itself (under ``URGENT_ROUNDS`` rounds of slack
    left): it joins, and the order between the two is the planning rounds' business. A row kept
    out waits at most until that row ends, or until its own slack runs short, or until it
    starves."""
    if not running or starved(row, now, plan):
        return False
    with_row = plan.step_s([*running, row])
    if not with_row > without:
        return False  # a step that does not grow (a launch-bound device): nobody is delayed
    if row_slack(row, now, with_row) < URGENT_ROUNDS * plan.round_steps * with_row:
        return False
    key = row_key(row, now, with_row, plan)
    return any(
        r.deadline != NO_DEADLINE
        and row_slack(r, now, with_row) < 0 <= row_slack(r, now, without)
        and row_key(r, now, with_row, plan) < key
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
    precedes, taken loosest first (last in precedence): each must still have ``URGENT_ROUNDS``
    rounds of slack after sitting out ``tight``'s remaining steps, so that it does not rush back in
    at once and is not made late itself; it rejoins when ``delays_a_tighter_row`` lets it."""
    if budget < 1 or tight.deadline == NO_DEADLINE:
        return []
    step_now = plan.step_s(running)
    if row_slack(tight, now, step_now) >= 0:
        return []
    key = row_key(tight, now, step_now, plan)
    candidates = [r for r in running if r is not tight and may_park(r)]
    loosest_first = sorted(
        (r for r in candidates if row_key(r, now, step_now, plan) > key),
        key=lambda r: row_key(r, now, step_now, plan),
        reverse=True,
    )
    margin = URGENT_ROUNDS * plan.round_steps * step_now
    kept, parked, kept_step = list(running), [], step_now
    for victim in loosest_first:
        rest = [r for r in kept if r is not victim]
        rest_step = plan.step_s(rest)
        if not rest_step < kept_step:
            continue  # this row adds nothing to the step time: parking it saves no one
        if row_slack(victim, now, step_now) - tight.remaining_steps * rest_step < margin:
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


def simulate(
    now: float,
    running: Sequence[Row],
    queue: Sequence[Row],
    max_batch: int,
    step_s: Callable[[Sequence[Row]], float],
    join_when_empty: bool = False,
    keeps_out: KeepsOut | None = None,
) -> dict[str, RowForecast]:
    """Run the batch forward on predicted step times: each running row ends after its remaining
    steps; queued rows, in ``queue``'s order, take slots as they free (``join_when_empty``: only
    once the whole batch has ended, as static batching does). The batch changes only when a row
    ends or joins, so ``step_s`` is called once per change (and per question to ``keeps_out``).

    ``keeps_out(batch, row, clock, batch_step_s)`` (the slack scheduler's batch sizing,
    ``delays_a_tighter_row``): a queued row it holds back stays queued, in its place, while later
    rows take the free slots; an empty batch always takes the next row. ``batch`` holds the
    running rows as they will be then (their steps advanced). The scheduler asks again after every
    step; the forecast skips to the first step at which some held row would be let in
    (``first_let_in``), which gives the same answer because, while the batch is unchanged, a
    held row's answer only turns one way: the running rows' slack beside it grows every step, its
    own shrinks and its wait grows, each of which only lets it in sooner. So a forecast costs
    O(held rows + log steps) step-time predictions per change of the batch, not one per row per
    step.

    Future parks are not simulated: a tight queued row may join sooner than forecast (by a park),
    and the running rows it displaces (or that shrinking parks) end later."""
    position = {row.job_id: i + 1 for i, row in enumerate(queue)}
    start = {row.job_id: now for row in running}
    finish: dict[str, float] = {}
    left = {row.job_id: row.remaining_steps for row in running}  # steps left, per batch row
    batch = list(running)
    pending = list(reversed(queue))  # pop() takes the next to join
    clock = now

    def fill() -> bool:
        """Queued rows take the free slots; True when one was kept out of a free slot."""
        if join_when_empty and batch:
            return False
        kept: list[Row] = []
        then: tuple[list[Row], float] | None = None  # priced when first asked, per batch
        while pending and len(batch) < max_batch:
            row = pending.pop()
            if keeps_out is not None and batch:
                then = then or as_then()
                if keeps_out(then[0], row, clock, then[1]):
                    kept.append(row)
                    continue
            start[row.job_id] = clock
            left[row.job_id] = row.remaining_steps
            batch.append(row)
            then = None
        pending.extend(reversed(kept))  # back at the head of the queue, in order
        return bool(kept)

    def as_then() -> tuple[list[Row], float]:
        """The batch with each row's steps advanced to ``clock``, and its step time."""
        return [replace(r, step=r.num_steps - left[r.job_id]) for r in batch], step_s(batch)

    def first_let_in(limit: int, ask: KeepsOut) -> int:
        """The first step (1..``limit``) after which ``fill`` lets a held row in; ``limit`` when
        none is let in sooner. Each held row is asked once at the best step found so far and,
        only when it is let in by then, searched by halving (its answer turns once: docstring)."""
        batch_step = max(0.0, step_s(batch))

        def kept(row: Row, steps: int) -> bool:
            then = [replace(r, step=r.num_steps - left[r.job_id] + steps) for r in batch]
            return ask(then, row, clock + steps * batch_step, batch_step)

        best = limit
        for row in reversed(pending):  # fill's order
            if best <= 1:
                break
            if kept(row, best - 1):
                continue
            low, high = 1, best - 1  # let in after ``high`` steps, kept after ``low - 1``
            while low < high:
                mid = (low + high) // 2
                low, high = (mid + 1, high) if kept(row, mid) else (low, mid)
            best = high
        return best

    held = fill()
    while batch:
        steps = max(0, min(left[row.job_id] for row in batch))
        if held and keeps_out is not None and len(batch) < max_batch and steps > 1:
            steps = first_let_in(steps, keeps_out)
        clock += steps * max(0.0, step_s(batch))
        for row in batch:
            left[row.job_id] -= steps
            if left[row.job_id] <= 0:
                finish[row.job_id] = clock
        batch = [row for row in batch if left[row.job_id] > 0]
        held = fill()
    return {
        job_id: RowForecast(position.get(job_id, 0), start[job_id], finish[job_id])
        for job_id in start
    }

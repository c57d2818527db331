"""A worker's batch run forward on predicted step times: every row's ``RowForecast`` (pure: no
torch, no redis, no clock).

``simulate`` replays what ``BatchScheduler`` will do with the rows it has now: each running row
ends after its remaining steps; queued rows, in the scheduler's order, take slots as they free
(``join_when_empty``: only once the whole batch has ended, as static batching does). The batch
changes only when a row ends or joins, so the step time is priced once per change.

With ``sizing`` (the slack scheduler's plan with ``size_batches``) a queued row that
``delays_a_tighter_row`` keeps out of a free slot stays queued, in its place, while later rows
take the slots; an empty batch always takes the next row. The scheduler asks again after every
step. The forecast does not walk those steps one by one: while the batch is unchanged, a held
row's answer turns from kept to let in at most twice, and it finds the first such step by halving
(``_Run.first_let_in``):

* it is let in for good once no running row needs protecting from it (the running rows' slack
  beside it grows every step, their slack alone shrinks) or once it starves;
* it is let in while its own slack has run short (``must_join_now``, which turns one way) and it
  would still be on time beside the batch; past that it is kept again. (Whether it would be on
  time beside the batch also depends on which running rows shrinking could park for it, which can
  change as they advance; the forecast looks for one such window, the first.)

With ``joins`` (the scheduler's join rule) a queued row that the rule keeps out of a free slot,
and every row after it, waits until the batch changes (a row ends): the rule looks at the rows'
costs, not their steps, so it answers the same until then.

So a forecast costs O(held rows x log steps) step-time predictions per change of the batch, not
one per held row per step.

Future parks are not simulated: a tight queued row may join sooner than forecast (by a park), and
the running rows it displaces (or that shrinking parks) end later. Rows due for the starvation
bound (``Row.due``) come first in the queue it is given and are never kept out; rows that will come
due later are not foreseen.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from backend.worker.deadlines import (
    DeadlinePlan,
    RowForecast,
    delays_a_tighter_row,
    must_join_now,
)
from backend.worker.step_clock import JoinRule

if TYPE_CHECKING:  # batching imports this module: the row type is only needed for annotations
    from backend.worker.batch_rows import Row


def simulate(
    now: float,
    running: Sequence[Row],
    queue: Sequence[Row],
    max_batch: int,
    step_s: Callable[[Sequence[Row]], float],
    join_when_empty: bool = False,
    sizing: DeadlinePlan | None = None,
    joins: JoinRule | None = None,
) -> dict[str, RowForecast]:
    """Every row's forecast (module docstring): ``running`` rows start now, ``queue`` rows in the
    order they take slots; ``step_s`` prices a batch."""
    run = _Run(now, running, queue, max_batch, step_s, join_when_empty, sizing, joins)
    run.to_the_end()
    return {
        job_id: RowForecast(run.position.get(job_id, 0), run.start[job_id], run.finish[job_id])
        for job_id in run.start
    }


def first_true(pred: Callable[[int], bool], low: int, high: int) -> int:
    """The least k in ``low..high`` with ``pred(k)``, for a ``pred`` false then true on that range
    and true at ``high`` (``bisect`` over the range, ``False < True``)."""
    return low + bisect.bisect_left(range(low, high + 1), True, key=pred)


class _Run:
    """The state of one forecast: the batch, the rows still queued, the clock."""

    def __init__(
        self,
        now: float,
        running: Sequence[Row],
        queue: Sequence[Row],
        max_batch: int,
        step_s: Callable[[Sequence[Row]], float],
        join_when_empty: bool,
        sizing: DeadlinePlan | None,
        joins: JoinRule | None,
    ):
        self.position = {row.job_id: i + 1 for i, row in enumerate(queue)}
        self.start = {row.job_id: now for row in running}
        self.finish: dict[str, float] = {}
        self.left = {row.job_id: row.remaining_steps for row in running}  # steps left, per row
        self.batch: list[Row] = list(running)
        self.pending: list[Row] = list(reversed(queue))  # pop() takes the next to join
        self.clock = now
        self.max_batch, self.step_s = max_batch, step_s
        self.join_when_empty, self.sizing, self.joins = join_when_empty, sizing, joins

    def to_the_end(self) -> None:
        held = self.fill()
        while self.batch:
            steps = max(0, min(self.left[row.job_id] for row in self.batch))
            if held and len(self.batch) < self.max_batch and steps > 1:
                steps = self.first_let_in(steps)
            self.clock += steps * max(0.0, self.step_s(self.batch))
            for row in self.batch:
                self.left[row.job_id] -= steps
                if self.left[row.job_id] <= 0:
                    self.finish[row.job_id] = self.clock
            self.batch = [row for row in self.batch if self.left[row.job_id] > 0]
            held = self.fill()

    def fill(self) -> bool:
        """Queued rows take the free slots; True when one was kept out of a free slot."""
        if self.join_when_empty and self.batch:
            return False
        kept: list[Row] = []
        batch_step: float | None = None  # priced when first asked, per batch
        while self.pending and len(self.batch) < self.max_batch:
            row = self.pending.pop()
            if self.joins and self.batch and not row.due and not self.joins(self.batch, row):
                self.pending.append(row)  # it waits for the batch to change
                break
            if self.sizing is not None and self.batch and not row.due:
                batch_step = self.step_s(self.batch) if batch_step is None else batch_step
                if delays_a_tighter_row(self.sizing, self.then(0), row, self.clock, batch_step):
                    kept.append(row)
                    continue
            self.start[row.job_id] = self.clock
            self.left[row.job_id] = row.remaining_steps
            self.batch.append(row)
            batch_step = None
        self.pending.extend(reversed(kept))  # back at the head of the queue, in order
        return bool(kept)

    def then(self, steps: int) -> list[Row]:
        """The batch as it will be ``steps`` steps from the clock (its rows' steps advanced)."""
        return [replace(r, step=r.num_steps - self.left[r.job_id] + steps) for r in self.batch]

    def first_let_in(self, limit: int) -> int:
        """The first step (1..``limit``) after which ``fill`` lets a held row in; ``limit`` when
        none is let in sooner (the module docstring says why halving finds it)."""
        plan = self.sizing
        assert plan is not None  # rows are held only by sizing
        batch_step = max(0.0, self.step_s(self.batch))

        def let_in(row: Row) -> Callable[[int], bool]:
            return lambda k: (
                not delays_a_tighter_row(
                    plan, self.then(k), row, self.clock + k * batch_step, batch_step
                )
            )

        def short(row: Row) -> Callable[[int], bool]:
            return lambda k: must_join_now(plan, self.then(k), row, self.clock + k * batch_step)

        best = limit
        for row in reversed(self.pending):  # fill's order
            if best <= 1:
                break
            joins, runs_short = let_in(row), short(row)
            if runs_short(best - 1):  # its slack runs short before ``best``: from which step?
                opens = first_true(runs_short, 1, best - 1)
                if joins(opens):  # let in there at the latest, for good before it
                    best = first_true(joins, 1, opens)
                    continue
            # the short-slack exception never lets it in before ``best``: one turn left
            if joins(best - 1):
                best = first_true(joins, 1, best - 1)
        return best

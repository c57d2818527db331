"""Rows, step times, plans and schedulers for the deadline scheduler's pure tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backend.worker.batching import BatchScheduler, Row
from backend.worker.deadlines import DeadlinePlan

KEY = "kv:128x128"


def make_row(
    job_id: str,
    steps: int = 10,
    deadline: float = 0.0,
    priority: int = 0,
    at: float = 0.0,
    step: int = 0,
) -> Row:
    return Row(job_id, steps, KEY, 0.2, at, deadline=deadline, priority=priority, step=step)


def constant(seconds: float) -> Callable[[Sequence[Row]], float]:
    return lambda rows: seconds


def by_size(base: float, per_row: float) -> Callable[[Sequence[Row]], float]:
    return lambda rows: base + per_row * len(rows)


def make_plan(
    scheduler: str = "slack",
    round_steps: int = 3,
    max_wait_s: float = 300.0,
    max_parks: int = 2,
    step_time: Callable[[Sequence[Row]], float] = constant(1.0),
    size_batches: bool = True,
    shrink_batches: bool = True,
    urgent_parks: bool = True,
    park_by_deadline: bool = True,
) -> DeadlinePlan:
    return DeadlinePlan(
        scheduler=scheduler,
        round_steps=round_steps,
        max_wait_s=max_wait_s,
        max_parks_per_round=max_parks,
        size_batches=size_batches,
        shrink_batches=shrink_batches,
        urgent_parks=urgent_parks,
        park_by_deadline=park_by_deadline,
        step_time=step_time,
    )


# A step costs 1 s plus 1 s per row: a tight row alone (10 steps, due at 21) is on time with 1 s to
# spare; with a second row beside it each step takes 3 s and it would end at 30.
def sizing_scheduler(size_batches: bool = True, **plan) -> BatchScheduler:
    s = BatchScheduler(
        4, plan=make_plan(step_time=by_size(1.0, 1.0), size_batches=size_batches, **plan)
    )
    s.add(make_row("tight", steps=10, deadline=21.0))
    assert s.schedule(0.0).admitted == ["tight"]
    return s

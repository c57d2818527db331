"""Rows, step times, plans and schedulers for the deadline scheduler's pure tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backend.worker.batch_rows import Row, SchedulerOutput
from backend.worker.batching import BatchScheduler
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
    keep_slot_while_reading: bool = True,
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
        keep_slot_while_reading=keep_slot_while_reading,
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


class Harness:
    """Drives a scheduler one step per ``tick`` and counts the steps each row ran."""

    def __init__(self, scheduler: BatchScheduler):
        self.s = scheduler
        self.steps_run: dict[str, int] = {}
        self.finished_at: dict[str, float] = {}
        self.outs: list[SchedulerOutput] = []

    def tick(self, now: float, ready: Callable[[Row], bool] | None = None) -> SchedulerOutput:
        out = self.s.schedule(now, ready)
        self.outs.append(out)
        stepped = [j for g in out.groups for j in g]
        assert len(stepped) == len(set(stepped)) <= self.s.max_batch
        assert not set(out.parked) & set(stepped)  # a parked row runs no step this schedule
        assert set(stepped) == set(self.s.running)
        assert not set(self.s.running) & set(self.s.waiting)
        for job_id in stepped:
            self.steps_run[job_id] = self.steps_run.get(job_id, 0) + 1
        for row in self.s.update_from_output(stepped):
            assert self.steps_run[row.job_id] == row.num_steps  # exactly its steps, parked or not
            self.finished_at[row.job_id] = now + 1.0  # one step per second in these tests
        return out

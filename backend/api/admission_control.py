"""Admission control of a new job: will it finish in time, and is the queue within its bound?
(pure: no redis, no clock; the API's ``backend.api.admission`` gathers the inputs).

Inputs: the new job (class, deadline, priority, steps), ``now``, one ``WorkerLoad`` per live
worker serving its model (its slots, the predicted seconds of one step of its batch with the job in
it, its running and waiting rows from its heartbeat), the accepted jobs of that model not on a
worker yet (``unplaced``), and how many jobs are accepted and not running over the deployment
(``queued``).

Prediction (``forecast``): the job starts when the rows that go before it leave a slot free.
Which rows go before it follows the workers' step scheduler (``DeadlineSettings.scheduler``):

* ``slack``: the rows that precede it (``backend.costmodel.slack.precedence``: higher priority,
  then less slack, then arrival): a row with a later deadline and as much slack does not delay it,
  the scheduler parks such a row for it at a step boundary (rows already waiting go before it on
  ties);
* ``edf``: every running row (it keeps its slot), then the waiting rows that precede it;
* ``fifo``: every row (arrival order).

On each worker the rows that go before it are replayed on its ``max_batch`` slots (running rows
hold theirs for their remaining steps; the others take the first slot that frees, in precedence
order, each for its steps); then the unplaced jobs that precede it take the first slot that
frees on any worker. The job's predicted start on a worker is its first free slot, its finish that
plus ``steps x step_s`` plus the worker's finish tail (post-processing and the hops around it, as
the worker measured them; its rows' deadlines are their jobs' less that tail, and the job is
ranked among them so); the forecast is the worker where it finishes first. Step times are taken
as constant over the wait (the batch as it would be with the job in it). The starvation bound
(``edf``, ``slack``): a row the worker reported due, or whose wait passes ``max_wait_s`` within
the worker's next round (``backend.costmodel.slack.comes_due``), goes before the job whatever its
slack, and before the other rows, longest wait first. Not modelled: rows that come due later, the
time to the next planning round before a park, pre-processing (tens of milliseconds on the shipped
models, against deadlines of tens of seconds).

Decision (``decide``), with ``late_factor`` L, ``max_queue`` Q:

* ``queue``: ``queued >= Q`` (the bound applies with or without live workers);
* ``deadline``: ``predicted_finish - now > L x (deadline - now)``; only when there is a forecast:
  with no live worker (or no step time) nothing is refused on prediction.

A job refused by either bound is answered 429 when its class is in ``shed_classes``, with
``retry_after_s``: for the queue bound, the time the workers take to start the jobs over the bound
(each worker starts ``max_batch`` jobs per ``steps x step_s``); for the deadline bound, the time
after which the work ahead of it has shrunk enough for a job submitted then, with the same
relative deadline, to pass (``wait + run - L x deadline_s``; when even an empty queue would not
do, ``wait``: the message says to give a longer deadline). A job of any other class is accepted and
marked late. Nothing accepted is ever dropped.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from backend.config_deadlines import SERVICE_CLASSES
from backend.costmodel.slack import (
    SCHEDULERS,
    comes_due,
    due_within_s,
    last_step_by,
    precedence,
    slack_s,
)

DEFAULT_RETRY_S = 30  # Retry-After when the queue is over its bound and no worker can drain it
MAX_RETRY_S = 3600


@dataclass(frozen=True)
class Row:
    """A job on a worker (from its heartbeat) or accepted and not on a worker yet."""

    remaining_steps: int
    deadline: float = 0.0  # epoch seconds (0: none, infinite slack)
    priority: int = 0
    running: bool = False  # holds a slot of the running batch now
    # the starvation bound's state from the heartbeat: the worker found it due; its wait (queued
    # and parked) by the decision's ``now``
    due: bool = False
    waited_s: float = 0.0


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    max_batch: int
    step_s: float  # predicted seconds of one step of its batch with the new job in it (> 0)
    rows: tuple[Row, ...] = ()  # their deadlines less ``finish_tail_s``, as the worker plans them
    finish_tail_s: float = 0.0  # seconds its jobs take from their last step to done


@dataclass(frozen=True)
class NewJob:
    service_class: str
    deadline: float  # epoch seconds
    priority: int
    steps: int


@dataclass(frozen=True)
class Policy:
    """``DeadlineSettings`` as admission reads it."""

    late_factor: float = 2.0
    max_queue: int = 256
    shed_classes: tuple[str, ...] = ("batch",)
    scheduler: str = "slack"
    round_steps: int = 5
    max_wait_s: float = math.inf  # the starvation bound


@dataclass(frozen=True)
class Forecast:
    worker_id: str  # where it would finish first
    start: float  # epoch seconds of its predicted first step
    finish: float  # epoch seconds it is predicted done: its denoising's end plus the finish tail
    ahead: int  # rows (on that worker or unplaced) that go before it


@dataclass(frozen=True)
class Verdict:
    accept: bool
    late: bool  # accepted though refused by a bound (a class not shed)
    reason: str  # "" (within both bounds), "queue" or "deadline"
    forecast: Forecast | None
    retry_after_s: int  # > 0 when refused, else 0
    message: str  # why, and what to do; "" within both bounds


def _precedence(
    row: Row, now: float, step_s: float, enqueued_at: float, policy: Policy
) -> tuple[int, float, int, float, float]:
    within_s = due_within_s(policy.scheduler, policy.round_steps, step_s)
    due = comes_due(row.due, row.waited_s, within_s, policy.max_wait_s)
    return precedence(
        starved=due,
        waited_s=row.waited_s,
        priority=row.priority,
        slack=slack_s(row.deadline, now, row.remaining_steps, step_s),
        enqueued_at=enqueued_at,
    )


def _goes_before(row: Row, job: Row, now: float, step_s: float, policy: Policy) -> bool:
    if policy.scheduler == "fifo" or (policy.scheduler == "edf" and row.running):
        return True
    # rows already there arrived first: they win ties
    return _precedence(row, now, step_s, 0.0, policy) < _precedence(job, now, step_s, now, policy)


def forecast(
    job: NewJob,
    now: float,
    workers: Sequence[WorkerLoad],
    unplaced: Sequence[Row] = (),
    policy: Policy = Policy(),
) -> Forecast | None:
    """Where and when the job would run (module docstring), ordered by ``policy``'s scheduler
    and bound; None without a worker with a step time."""
    if policy.scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {policy.scheduler!r}")
    usable = sorted(
        (w for w in workers if w.step_s > 0 and math.isfinite(w.step_s) and w.max_batch > 0),
        key=lambda w: w.worker_id,
    )
    if not usable:
        return None
    mine = Row(max(1, job.steps), job.deadline, job.priority)
    # each worker's slots: seconds from now until each frees, after the rows that go before it
    slots: dict[str, list[float]] = {}
    ahead: dict[str, int] = {}
    for w in usable:
        # ranked against its rows as the worker ranks them: by when its last step must end there
        planned = replace(mine, deadline=last_step_by(mine.deadline, w.finish_tail_s))
        before = [r for r in w.rows if _goes_before(r, planned, now, w.step_s, policy)]
        before.sort(key=lambda r: (not r.running, _precedence(r, now, w.step_s, 0.0, policy)))
        free = [0.0] * w.max_batch
        for row in before:
            at = heapq.heappop(free)
            heapq.heappush(free, at + max(0, row.remaining_steps) * w.step_s)
        slots[w.worker_id], ahead[w.worker_id] = free, len(before)
    mean_step_s = sum(w.step_s for w in usable) / len(usable)
    queued = [r for r in unplaced if _goes_before(r, mine, now, mean_step_s, policy)]
    queued.sort(key=lambda r: _precedence(r, now, mean_step_s, 0.0, policy))
    for row in queued:  # each to the slot that frees first, on any worker
        w = min(usable, key=lambda w: (slots[w.worker_id][0], w.worker_id))
        at = heapq.heappop(slots[w.worker_id])
        heapq.heappush(slots[w.worker_id], at + max(0, row.remaining_steps) * w.step_s)

    def done_s(w: WorkerLoad) -> float:
        return slots[w.worker_id][0] + mine.remaining_steps * w.step_s + w.finish_tail_s

    best = min(usable, key=lambda w: (done_s(w), w.worker_id))
    return Forecast(
        worker_id=best.worker_id,
        start=now + slots[best.worker_id][0],
        finish=now + done_s(best),
        ahead=ahead[best.worker_id] + len(queued),
    )


def _clamp_retry(seconds: float) -> int:
    if not math.isfinite(seconds):
        return MAX_RETRY_S
    return int(min(MAX_RETRY_S, max(1, math.ceil(seconds))))


def drain_s(excess: int, steps: int, workers: Sequence[WorkerLoad]) -> float | None:
    """Seconds the workers take to start ``excess`` more jobs of ``steps`` steps (each worker
    starts ``max_batch`` jobs per ``steps x step_s``); None without a worker with a step time."""
    rate = sum(
        w.max_batch / (max(1, steps) * w.step_s)
        for w in workers
        if w.step_s > 0 and math.isfinite(w.step_s) and w.max_batch > 0
    )
    return excess / rate if rate > 0 else None


def decide(
    job: NewJob,
    now: float,
    workers: Sequence[WorkerLoad],
    unplaced: Sequence[Row],
    queued: int,
    policy: Policy,
) -> Verdict:
    """Admit, admit late, or refuse the job (module docstring)."""
    predicted = forecast(job, now, workers, unplaced, policy)
    shed = job.service_class in policy.shed_classes
    to_deadline = job.deadline - now
    if queued >= policy.max_queue:
        drain = drain_s(queued - policy.max_queue + 1, job.steps, workers)
        retry = _clamp_retry(DEFAULT_RETRY_S if drain is None else drain)
        why = f"{queued} jobs are accepted and not running yet, the bound is {policy.max_queue}"
        return _verdict(job, "queue", why, retry, shed, predicted, policy)
    if predicted is None:
        return Verdict(True, False, "", None, 0, "")
    latency = predicted.finish - now
    allowed = policy.late_factor * to_deadline
    if latency <= allowed:
        return Verdict(True, False, "", predicted, 0, "")
    wait, run = predicted.start - now, predicted.finish - predicted.start
    retry = _clamp_retry(wait + run - allowed if run <= allowed else wait)
    why = (
        f"it is predicted to finish in {latency:.0f} s ({predicted.ahead} jobs go before it), "
        f"past {policy.late_factor:g} x the {to_deadline:.0f} s to its deadline"
    )
    if run > allowed:
        why += (
            f"; its own {job.steps} steps take about {run:.0f} s, so give deadline_s of at least "
            f"{math.ceil(run / policy.late_factor)}"
        )
    return _verdict(job, "deadline", why, retry, shed, predicted, policy)


def _verdict(
    job: NewJob,
    reason: str,
    why: str,
    retry: int,
    shed: bool,
    predicted: Forecast | None,
    policy: Policy,
) -> Verdict:
    if not shed:
        return Verdict(True, True, reason, predicted, 0, f"accepted late: {why}")
    others = [c for c in SERVICE_CLASSES if c != job.service_class]
    others = [c for c in others if c not in policy.shed_classes]
    instead = f", or submit it as class {' or '.join(others)}" if others else ""
    longer = ", give a longer deadline_s" if reason == "deadline" else ""
    message = (
        f"{job.service_class} job refused ({reason} bound): {why}. Retry in {retry} s "
        f"(Retry-After){longer}{instead}"
    )
    return Verdict(False, False, reason, predicted, retry, message)

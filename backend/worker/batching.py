"""Step-level batch scheduler: a pure state machine (no torch, no I/O), after vLLM v1's scheduler.

Each worker iteration calls ``schedule(now)``, which retires cancelled rows, admits waiting rows and
returns the forward passes to run this step; after running them the worker calls
``update_from_output(stepped)``, which advances every stepped row by one step and retires finished
ones. Modes:

* ``continuous`` (default): waiting rows join the running batch at every step while slots are free;
* ``static``: a batch is formed only when the previous one has completely finished;
* ``inline``: admission as ``continuous``; the worker also runs pre/post-processing in its own loop;
* ``baseline``: as ``static``, and a batch holds only rows of one group key, the oldest waiting
  row's (the baseline worker runs the whole batch in one ordinary pipeline call, which shares size,
  steps, strength and guidance); rows of other keys keep their places for a later batch.

Prefetch-gated admission: ``schedule(now, ready)`` admits a waiting row only when ``ready(row)``
says so (the engine worker and the route simulation's workers both answer with
``backend.worker.admission.AdmissionRules``). A row that is not ready keeps its place at the head
of the queue while rows behind it take the free slots (``SchedulerOutput.held``); it joins at the
first step after it becomes ready. No read ever stalls the running batch (FlashPS's bubble-free
serving).

Invariants: at most ``max_batch`` rows run; a row is in exactly one of waiting / running / done;
every running row is stepped exactly once per ``schedule`` -> ``update_from_output`` round (rows
that cannot share a forward pass, e.g. other resolutions, go into separate groups of the same step;
the baseline worker runs its one group's steps inside one pipeline call, reporting each step with
``update_from_output``); a cancelled row never runs another step after the ``schedule`` that
follows the cancel.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend.protocol.messages import RunningRow, WaitingRow

MODES = ("continuous", "static", "inline", "baseline")


@dataclass
class Row:
    job_id: str
    num_steps: int
    # rows with equal keys can share one forward pass (same cache mode and resolution)
    group_key: str
    mask_ratio: float = 1.0
    enqueued_at: float = 0.0
    template: str = ""  # cache digest of the row's template ("" = none), for routing by residency
    adapters: tuple[str, ...] = ()  # sha256 of the row's LoRA adapters, for routing by residency
    admitted_at: float | None = None
    step: int = 0

    @property
    def remaining_steps(self) -> int:
        return self.num_steps - self.step


@dataclass
class SchedulerOutput:
    # rows that join this step (the worker admits them)
    admitted: list[str] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)  # one forward pass per group, this step
    cancelled: list[str] = field(default_factory=list)  # rows dropped (waiting or running)
    # waiting rows passed over: not ready, a slot was free
    held: list[str] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(len(g) for g in self.groups)


class BatchScheduler:
    def __init__(self, max_batch: int, mode: str = "continuous"):
        if mode not in MODES:
            raise ValueError(f"batching mode must be one of {', '.join(MODES)}, got {mode!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch, self.mode = max_batch, mode
        self.waiting: OrderedDict[str, Row] = OrderedDict()
        self.running: OrderedDict[str, Row] = OrderedDict()
        self._cancel_requests: set[str] = set()

    # ----- inputs -----------------------------------------------------------------------------
    def add(self, row: Row) -> bool:
        """Queue ``row``; False (and nothing changes) when its job is already scheduled here: a
        duplicate delivery is dropped, never run twice."""
        if row.num_steps < 1:
            raise ValueError(f"job {row.job_id} has no steps to run")
        if row.job_id in self.waiting or row.job_id in self.running:
            return False
        self.waiting[row.job_id] = row
        return True

    def cancel(self, job_id: str) -> bool:
        """Ask to drop ``job_id``; it leaves at the next ``schedule``. False if the job is unknown
        here."""
        if job_id in self.waiting or job_id in self.running:
            self._cancel_requests.add(job_id)
            return True
        return False

    # ----- one step ---------------------------------------------------------------------------
    def schedule(self, now: float, ready: Callable[[Row], bool] | None = None) -> SchedulerOutput:
        """Retire cancelled rows, admit waiting rows (FIFO, skipping those ``ready`` rejects), and
        group the running rows into this step's forward passes."""
        out = SchedulerOutput()
        for job_id in sorted(self._cancel_requests):
            if self.waiting.pop(job_id, None) or self.running.pop(job_id, None):
                out.cancelled.append(job_id)
        self._cancel_requests.clear()
        if self._may_admit():
            batch_key = None  # baseline: the group key of the first row admitted
            for job_id, row in list(self.waiting.items()):
                if len(self.running) >= self.max_batch:
                    break
                if batch_key is not None and row.group_key != batch_key:
                    continue  # not held: it waits for a batch of its own key
                if ready is not None and not ready(row):
                    out.held.append(job_id)
                    continue
                if self.mode == "baseline":
                    batch_key = row.group_key
                del self.waiting[job_id]
                row.admitted_at = now
                self.running[job_id] = row
                out.admitted.append(job_id)
        groups: dict[str, list[str]] = {}
        for job_id, row in self.running.items():
            groups.setdefault(row.group_key, []).append(job_id)
        out.groups = list(groups.values())
        return out

    def _may_admit(self) -> bool:
        return self.mode not in ("static", "baseline") or not self.running

    def update_from_output(self, stepped: list[str]) -> list[Row]:
        """Advance the rows that ran one step; return (and drop) those that finished."""
        finished = []
        for job_id in stepped:
            row = self.running.get(job_id)
            if row is None:
                continue  # cancelled while its step ran
            row.step += 1
            if row.remaining_steps <= 0:
                finished.append(self.running.pop(job_id))
        return finished

    def restart(self, job_id: str) -> None:
        """A running row starts over at step 0 in its slot (its cache broke mid-edit and it now
        computes densely); it keeps its place in the running batch."""
        row = self.running.get(job_id)
        if row is None:
            raise KeyError(f"job {job_id} is not running: only a running row can restart")
        row.step = 0

    def drop(self, job_id: str) -> Row | None:
        """Remove a row at once (its admission failed); the worker reports why."""
        return self.waiting.pop(job_id, None) or self.running.pop(job_id, None)

    # ----- views (heartbeats, routing) ------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def live_state(self) -> dict[str, Any]:
        """Running batch and queue, as the worker's heartbeat reports them."""
        return {
            "running": [
                RunningRow(r.job_id, r.mask_ratio, r.remaining_steps, r.template, list(r.adapters))
                for r in self.running.values()
            ],
            "waiting": [
                WaitingRow(r.job_id, r.mask_ratio, r.num_steps, r.template, list(r.adapters))
                for r in self.waiting.values()
            ],
            "max_batch": self.max_batch,
            "mode": self.mode,
        }

"""Per-step statistics of a worker loop (pure): step time, forward time, batching overhead, batch
size.

Batching overhead of a step = the loop iteration's wall time minus the denoiser's forward time and
minus per-job work (admitting a job: cache acquire and state set-up; parking it; retiring it:
writing its final latents, handing it on; the users' forecast of every row): scheduling, building
and splitting the batch, planning, per-row scheduler updates and events. Per-job work is reported
on its own (``mean_job_work_s`` per step).
Totals cover the whole life of the worker; percentiles cover the most recent ``window`` steps, so a
long-running worker's memory stays bounded.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import ClassVar

from backend.engine.graph_book import GraphBook
from backend.worker.out_of_memory import BatchCaps


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


@dataclass
class WorkerStats:
    # the keys of ``snapshot`` that only grow: Prometheus counters (every other key is a gauge)
    COUNTERS: ClassVar[frozenset[str]] = frozenset(
        {
            "steps",
            "jobs",
            "cache_fallbacks_total",
            "held_row_schedules_total",
            "deferred_row_schedules_total",
            "not_paying_row_schedules_total",
            "parks_total",
            "resumes_total",
            "oom_errors_total",
            "oom_retried_rows_total",
            "oom_failed_rows_total",
            "uncompiled_steps_total",
        }
    )
    window: int = 10_000
    steps: int = 0
    step_s_total: float = 0.0
    forward_s_total: float = 0.0
    job_work_s_total: float = 0.0
    rows_total: int = 0
    max_rows: int = 0
    jobs_by_status: Counter = field(default_factory=Counter)
    cache_fallbacks: int = 0  # rows that found their template cache broken and computed densely
    # waiting rows the last schedule held on their cache (a read in flight, RAM full, a recording)
    held_rows: int = 0
    # total of held_rows over every schedule: steady growth = RAM tier or disk too slow
    held_row_schedules: int = 0
    # waiting rows the last schedule kept out of a free slot so that a tighter running row stays
    # on time (slack scheduler, ``size_batches``), and their total over every schedule
    deferred_rows: int = 0
    deferred_row_schedules: int = 0
    # waiting rows the last schedule kept out of a free slot because joining the running batch
    # would not lower the rows' mean latency (the join rule: a CPU's steps grow with every row),
    # and their total over every schedule
    not_paying_rows: int = 0
    not_paying_row_schedules: int = 0
    recent_overhead_s: deque = field(default_factory=deque)
    # rows parked at a step boundary for tighter deadlines, and parked rows resumed
    parks: int = 0
    resumes: int = 0
    # steps and their total seconds per batch size: how a step's time grows with its rows (on a
    # CPU about linearly, so batching there buys little throughput)
    steps_by_rows: Counter = field(default_factory=Counter)
    step_s_by_rows: Counter = field(default_factory=Counter)
    # forwards that ran out of device memory; rows run again after one (a row retried twice
    # counts twice); rows failed because they did not fit even alone
    oom_errors: int = 0
    oom_retried_rows: int = 0
    oom_failed_rows: int = 0
    # the shapes' batch caps after running out of memory (None: nothing is capped)
    caps: BatchCaps | None = None
    # the engine's compiled step graphs and their memory (None: an engine without the book)
    graphs: GraphBook | None = None

    def record_step(
        self, num_rows: int, iteration_s: float, forward_s: float, job_work_s: float = 0.0
    ) -> None:
        self.steps += 1
        self.step_s_total += iteration_s
        self.forward_s_total += forward_s
        self.job_work_s_total += job_work_s
        self.rows_total += num_rows
        self.max_rows = max(self.max_rows, num_rows)
        self.steps_by_rows[num_rows] += 1
        self.step_s_by_rows[num_rows] += iteration_s
        self.recent_overhead_s.append(max(0.0, iteration_s - forward_s - job_work_s))
        if len(self.recent_overhead_s) > self.window:
            self.recent_overhead_s.popleft()

    def mean_step_s_by_rows(self) -> dict[int, float]:
        """Mean step seconds per batch size, for every size that ran, in increasing size."""
        return {
            rows: self.step_s_by_rows[rows] / count
            for rows, count in sorted(self.steps_by_rows.items())
        }

    def record_held(self, num_rows: int) -> None:
        self.held_rows = num_rows
        self.held_row_schedules += num_rows

    def record_deferred(self, num_rows: int) -> None:
        self.deferred_rows = num_rows
        self.deferred_row_schedules += num_rows

    def record_not_paying(self, num_rows: int) -> None:
        self.not_paying_rows = num_rows
        self.not_paying_row_schedules += num_rows

    def record_parking(self, parked: int, resumed: int) -> None:
        self.parks += parked
        self.resumes += resumed

    def record_job(self, status: str) -> None:
        self.jobs_by_status[status] += 1

    def snapshot(self) -> dict:
        steps = max(1, self.steps)
        return {
            "steps": self.steps,
            "mean_step_s": self.step_s_total / steps,
            "mean_overhead_s": (self.step_s_total - self.forward_s_total - self.job_work_s_total)
            / steps,
            "mean_job_work_s": self.job_work_s_total / steps,
            "p50_overhead_s": percentile(self.recent_overhead_s, 50),
            "p95_overhead_s": percentile(self.recent_overhead_s, 95),
            "mean_batch_rows": self.rows_total / steps,
            "max_batch_rows": self.max_rows,
            "jobs": dict(self.jobs_by_status),
            "cache_fallbacks_total": self.cache_fallbacks,
            "held_rows": self.held_rows,
            "held_row_schedules_total": self.held_row_schedules,
            "deferred_rows": self.deferred_rows,
            "deferred_row_schedules_total": self.deferred_row_schedules,
            "not_paying_rows": self.not_paying_rows,
            "not_paying_row_schedules_total": self.not_paying_row_schedules,
            "parks_total": self.parks,
            "resumes_total": self.resumes,
            "oom_errors_total": self.oom_errors,
            "oom_retried_rows_total": self.oom_retried_rows,
            "oom_failed_rows_total": self.oom_failed_rows,
            **self._caps(),
            **(self.graphs.snapshot() if self.graphs is not None else {}),
        }

    def _caps(self) -> dict:
        """``batch_cap``: the lowest shape cap in force (the max batch when none is);
        ``batch_caps``: shape -> its cap, for the capped shapes only."""
        if self.caps is None:
            return {}
        return {"batch_cap": self.caps.lowest(), "batch_caps": self.caps.in_force()}

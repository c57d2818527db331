"""What the step scheduler (``backend.worker.batching.BatchScheduler``) keeps per row (``Row``) and
what one schedule decides (``SchedulerOutput``). Plain data: no torch, no redis, no clock."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    admitted_at: float | None = None  # the first admission (a resumed row keeps it)
    step: int = 0
    deadline: float = 0.0  # epoch seconds on the clock of ``now`` and ``enqueued_at``; 0 = none
    priority: int = 0  # higher goes first (``backend.costmodel.slack.precedence``)
    service_class: str = ""  # "interactive" / "batch" ("" = unknown), for the worker's metrics
    # Time spent waiting (queued or parked), for the starvation bound: ``wait_s`` sums the waits
    # that ended, ``waiting_since`` is when the current one began (None while running). ``add``
    # starts the first wait at ``enqueued_at``: it must be on the clock of ``schedule(now)``.
    wait_s: float = 0.0
    waiting_since: float | None = None
    parked: bool = False  # parked at a step boundary and not resumed yet (``step`` is kept)
    # False while the row may not leave the batch mid-way (the worker sets it for a row recording
    # its template's cache: rows of that template wait for the recording)
    parkable: bool = True
    parks: int = 0  # times this row was parked
    # the row came due for the starvation bound (``deadlines.mark_due``, ``_due``): it goes
    # first and is never parked again; it stays due
    due: bool = False

    @property
    def remaining_steps(self) -> int:
        return self.num_steps - self.step


@dataclass
class SchedulerOutput:
    # rows that join this step (the worker admits them)
    admitted: list[str] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)  # one forward pass per group, this step
    cancelled: list[str] = field(default_factory=list)  # rows dropped (waiting or running)
    # waiting rows passed over: not ready, a slot was free (or a park would have made one)
    held: list[str] = field(default_factory=list)
    # running rows that left the batch at this step boundary (slack scheduler): the worker
    # keeps their state and pins; they never appear in ``groups``
    parked: list[str] = field(default_factory=list)
    # rows in ``admitted`` that were parked: the worker resumes their kept state from their
    # ``step`` (it does not build it again)
    resumed: list[str] = field(default_factory=list)
    # waiting rows kept out although a slot was free (slack with ``size_batches``): joining would
    # make a running row that goes before them late
    deferred: list[str] = field(default_factory=list)
    # waiting rows kept out although a slot was free (``join_rule``): joining would not pay
    not_paying: list[str] = field(default_factory=list)
    # waiting rows kept out because their shape runs as many rows as its batch cap (a forward of
    # that shape ran out of device memory)
    capped: list[str] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(len(g) for g in self.groups)

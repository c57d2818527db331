"""Settings of deadlines, priorities and admission control (``Settings.deadlines``).

A request belongs to a service class (``interactive``: the studio's default; ``batch``: the REST
default); each class has a target latency, which is the request's deadline unless it gives its
own. The API sheds (429) a new job of a class configured to shed when it is predicted to finish
too late, or when the queue is past its bound; jobs of other classes are accepted and marked late.
Engine workers plan their batches against the deadlines (``scheduler``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from backend.config_base import Strict, comma_separated
from backend.costmodel.slack import DEFAULT_MAX_PARKS_PER_ROUND

SERVICE_CLASSES = ("interactive", "batch")
ServiceClass = Literal["interactive", "batch"]
StepScheduler = Literal["fifo", "edf", "slack"]
MAX_PRIORITY = 9


class DeadlineSettings(Strict):
    """Service classes, deadline-aware step scheduling and admission control."""

    interactive_target_s: float = Field(default=30.0, gt=0.0, le=86_400.0)
    """Target latency of an ``interactive`` request (submitted -> result stored), seconds: its
    deadline unless it gives its own."""
    batch_target_s: float = Field(default=600.0, gt=0.0, le=7 * 86_400.0)
    """Target latency of a ``batch`` request, seconds."""
    shed_classes: tuple[ServiceClass, ...] = ("batch",)
    """Classes answered 429 (with ``Retry-After``) when admission control refuses them; a request
    of any other class is accepted and marked late. ``none``: no class is shed."""
    late_factor: float = Field(default=2.0, ge=1.0, le=100.0)
    """Admission refuses a job whose predicted latency exceeds this many times the time to its
    deadline."""
    max_queue: int = Field(default=256, ge=1, le=1_000_000)
    """Jobs accepted and not yet running, over the whole deployment, past which admission refuses
    new ones."""
    scheduler: StepScheduler = "slack"
    """How an engine worker picks the rows that hold its batch's slots: ``fifo`` (arrival order),
    ``edf`` (earliest deadline first, a running row keeps its slot), ``slack`` (least slack first,
    planned in rounds; a row with slack to spare may be parked at a step boundary for a tighter
    one and resumes later from the same step)."""
    round_steps: int = Field(default=5, ge=1, le=100)
    """Steps per planning round of the ``slack`` scheduler (TetriServe found 5 the most robust)."""
    max_wait_s: float = Field(default=300.0, gt=0.0)
    """Starvation bound: no row waits (queued and parked, summed) longer; a row that would, behind
    the rows due before it, goes first and is never parked again."""
    max_parks_per_round: int = Field(default=DEFAULT_MAX_PARKS_PER_ROUND, ge=0, le=64)
    """Rows one planning round may park (0: never park); a row due for the starvation bound may
    have a row parked for it beyond them. 8, a whole default batch: where a step grows steeply
    with its rows (a CPU), a tight row joining a full batch needs 4-5 rows parked to be on time,
    and 2 a round left it in too large a batch for its first steps (docs/design/deadlines.md,
    "Bounds")."""
    size_batches: bool = True
    """``slack`` only: leave a slot free while filling it would lengthen the batch's steps so much
    that a running row which goes first (tighter, or of higher priority) misses its deadline; the
    waiting row joins when that row ends, or when it must join to be on time itself."""
    shrink_batches: bool = True
    """``slack`` only: at any step, when a running row is late at the batch's step time and would
    be on time in a smaller batch, park rows with slack to spare (the loosest first, within
    ``max_parks_per_round``) until it is; they rejoin as ``size_batches`` lets them."""
    urgent_parks: bool = True
    """``slack`` only: a waiting row that would be late if it waited for the next planning round
    may have a running row parked for it at once, by the rounds' rules and within
    ``max_parks_per_round``; off, parks for waiting rows happen at the rounds only."""
    park_by_deadline: bool = True
    """``slack`` only: a running row is parked only for a row due before it (a row without a
    deadline is due last). Off, any row that goes before it and has less slack may park it: a
    fresh row of the same class has more steps left, hence less slack, and in a burst the row
    parked for it is pushed back by every later arrival (docs/design/deadlines.md, "Parks go by
    deadline")."""
    keep_slot_while_reading: bool = True
    """``edf`` and ``slack``: a waiting row passed over for a free slot while its template's cache
    is read into RAM keeps that slot from the rows due after it (by deadline; with
    ``park_by_deadline`` off, from every row after it) when no running row ends in time for it,
    so that a looser row does not take it for all its steps while the read lands; rows due for
    the starvation bound are not kept out. Off, the next ready row takes it."""
    forecast_refresh_s: float = Field(default=0.5, ge=0.0, le=60.0)
    """How old a worker's forecast of its rows (queue position, predicted start and finish, shown
    to users) may grow before the worker runs its queue forward again; 0: at every step. The
    forecast's cost grows with the queue, and made at every step of a burst it lengthens the
    steps themselves."""
    plan_quantile: float = Field(default=0.0, ge=0.0, lt=1.0)
    """``edf`` and ``slack``: plan on a step time this quantile of the recent steps' measured /
    predicted would give (never shorter than the prediction), a margin for a machine whose speed
    moves between seconds; 0: plan on the prediction (TetriServe's steady steps). Forecasts shown
    to users keep the prediction."""

    finish_tail: bool = True
    """An engine worker measures how long its jobs take after their last step (post-processing and
    the hops around it, read back from the job records) and plans each row to end that much
    before its deadline (a high quantile of the recent tails); routing and admission add it to
    a job's predicted finish. Off: rows are planned to end at their deadlines."""

    @field_validator("shed_classes", mode="before")
    @classmethod
    def _split(cls, value):
        # an empty variable reads as unset (the default), so "none" is how to shed nothing
        return () if isinstance(value, str) and value.strip() == "none" else comma_separated(value)

    def target_s(self, service_class: str) -> float:
        """The class's target latency."""
        return self.interactive_target_s if service_class == "interactive" else self.batch_target_s

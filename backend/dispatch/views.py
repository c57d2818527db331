"""What the router reads: a worker's state (``WorkerView``, from its heartbeat), a job to place
(``JobRequest``) and the choice (``Decision``). Pure Python over dataclasses; the router
(``backend.dispatch.router``) re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from backend.costmodel.slack import last_step_by
from backend.dispatch.adapter_cost import AdapterNeed, AdapterResidency
from backend.dispatch.deadline_cost import RowOrder
from backend.models.catalog import UnknownModelError, rows_per_request
from backend.protocol.messages import WorkerHeartbeat


@dataclass(frozen=True)
class RowState:
    job_id: str
    mask_ratio: float
    remaining_steps: int
    template: str = ""
    adapters: tuple[str, ...] = ()  # sha256 of each LoRA adapter the row applies
    deadline: float = 0.0  # the job's deadline (the deadlines' clock; 0: none)
    priority: int = 0
    step: int = 0  # steps already run (a waiting row > 0: parked at a step boundary)
    # the starvation bound's state (``WaitingRow``): a waiting row's wait (queued and parked) as
    # of the view's ``seen_at``; due: let in first and never parked
    waited_s: float = 0.0
    due: bool = False


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    model_id: str
    device: str
    max_batch: int
    running: tuple[RowState, ...] = ()
    waiting: tuple[RowState, ...] = ()  # remaining_steps = num_steps less the steps run
    resident_ram: frozenset[str] = frozenset()
    resident_disk: frozenset[str] = frozenset()
    adapters_device: frozenset[str] = frozenset()  # sha256 of the adapters in W's device tier
    adapters_host: frozenset[str] = frozenset()  # ... and in its host-RAM tier
    order: RowOrder = RowOrder()  # how W gives its slots to its rows (its deadlines settings)
    # seconds W's jobs take after their last step (its heartbeat's ``finish_tail_s``); the
    # deadlines of W's rows are already that much earlier than their jobs'
    finish_tail_s: float = 0.0
    # when W reported this state (its heartbeat's ``at``), on the deadlines' clock; waiting rows
    # go on waiting after it (0: the state is as of any decision)
    seen_at: float = 0.0
    # template cache digests on W's device tier: a row of one reads its cache with no copy
    resident_device: frozenset[str] = frozenset()

    def waited_s(self, row: RowState, now: float) -> float:
        """Seconds waiting ``row`` will have waited at ``now``: its wait when reported, and the
        time since (it waits on: a heartbeat reports a row that runs as running)."""
        return row.waited_s + (max(0.0, now - self.seen_at) if self.seen_at else 0.0)

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def slack(self) -> int:
        return self.max_batch - self.load


@dataclass(frozen=True)
class JobRequest:
    job_id: str
    model_id: str
    mask_ratio: float
    num_steps: int
    template: str = ""  # cache digest of the job's template ("" = no cache: computes densely)
    adapters: tuple[AdapterNeed, ...] = ()  # its LoRA adapters (none: the base model)
    deadline: float = 0.0  # by when its result is due (ServiceLevel.deadline; 0: none)
    priority: int = 0  # ServiceLevel.priority
    now: float = 0.0  # the time of the decision, on the deadlines' clock
    batch_id: str = ""  # the batch it is an item of ("" none): routed with its siblings (groups)


@dataclass(frozen=True)
class Decision:
    worker_id: str | None  # None: no candidate (``reason`` says why)
    policy: str  # the policy that decided (a fallback names itself)
    reason: str
    costs: dict[str, float]  # candidate worker id -> the policy's cost (lower wins)
    # candidate worker id -> the cost's terms (mask_aware: the estimate, finish and lateness)
    terms: dict[str, dict[str, float]] = field(default_factory=dict)


def view_from_heartbeat(beat: WorkerHeartbeat, order: RowOrder = RowOrder()) -> WorkerView:
    """A router's view of a worker's heartbeat (a waiting row's remaining steps: those it has not
    run; all of them unless it was parked); ``order``: how the worker orders its rows."""
    running = tuple(
        RowState(
            row.job_id,
            row.mask_ratio,
            row.remaining_steps,
            row.template,
            tuple(row.adapters),
            row.deadline,
            row.priority,
            due=row.due,
        )
        for row in beat.running
    )
    waiting = tuple(
        RowState(
            row.job_id,
            row.mask_ratio,
            max(0, row.num_steps - row.step),
            row.template,
            tuple(row.adapters),
            row.deadline,
            row.priority,
            row.step,
            row.waited_s,
            row.due,
        )
        for row in beat.waiting
    )
    return WorkerView(
        beat.worker_id,
        beat.model_id,
        beat.device,
        beat.max_batch,
        running,
        waiting,
        frozenset(beat.resident_ram),
        frozenset(beat.resident_disk),
        frozenset(beat.adapters_device),
        frozenset(beat.adapters_host),
        order,
        beat.finish_tail_s,
        beat.at,
        frozenset(beat.resident_device),
    )


def planned_on(job: JobRequest, view: WorkerView) -> JobRequest:
    """``job`` as W would plan it: by when its last step must end there for the job to be done by
    its deadline (the deadline less W's finish tail), like the rows W publishes."""
    return replace(job, deadline=last_step_by(job.deadline, view.finish_tail_s))


def adapter_residency(view: WorkerView) -> AdapterResidency:
    """Where W holds adapters, as the adapter term reads it."""
    in_use = frozenset(a for r in (*view.running, *view.waiting) for a in r.adapters)
    return AdapterResidency(view.adapters_device, view.adapters_host, in_use)


def waiting_note(model_id: str, workers: Sequence[WorkerView]) -> str | None:
    """What a job the router cannot place yet says while it waits: which models the live workers
    serve when none serves its model; None when one does (it is only busy: late binding)."""
    served = sorted({w.model_id for w in workers})
    if model_id in served:
        return None
    live = f"live workers serve: {', '.join(served)}" if served else "no worker is live"
    return f"waiting for a worker that serves {model_id} ({live})"


def default_rows_per_request(model_id: str) -> int:
    """Engine rows per request of ``model_id``, from the model catalog (2 with classifier-free
    guidance, 1 for Flux Fill's guidance embedding); 2 for a model the catalog cannot resolve
    on this host (a checkpoint directory only the workers have)."""
    try:
        return rows_per_request(model_id)
    except UnknownModelError:
        return 2

"""The route simulation with deadlines: workers that schedule their steps by deadline and park rows
(``backend.worker.batching.BatchScheduler`` with a ``DeadlinePlan``), a router shown each job's
deadline, and the API's admission-control rule (429) at arrival.

Each simulated worker runs the serving worker's own scheduler with the arm's step scheduler:
``fifo`` (no plan: today's continuous batching), ``edf`` or ``slack``, planned in rounds of
``round_steps`` steps, with its starvation bound (``max_wait_s``) and churn bound
(``max_parks_per_round``). Its step-time prediction is the worker's own: the routing cost model's
latency of the rows (the fitted lines; a recording row dense, every other one cached), while a step
takes the exact plan's latency (``route_sim``). With ``StepPlan.clock`` that prediction is
calibrated by a ``StepClock`` on every step the worker runs, as the engine worker's is; with a
``DriftSpec``, each worker's steps are slowed by its own machine's drift (``machine_drift``). As
in the engine worker (``backend.worker.loop``), a parked row leaves the batch at a step boundary
keeping its step and its cache pin, resumes as soon as it is ranked into the batch again (nothing
to read back) and runs its remaining steps; a row recording its template's cache is never parked
(``Row.parkable``: the template's other rows wait for that recording).

Admission control (``ShedRule``), the API's formula: a job of a shed class is refused when its
predicted latency (the router's predicted finish on the worker it chose) exceeds ``late_factor`` x
the time to its deadline, or when the jobs accepted and not running (waiting or parked on any
worker) are ``max_queue`` or more; a refused job is counted, never queued. A job of another class
is accepted and counted as accepted late when predicted late.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from backend.bench.machine_drift import DriftSpec, SpeedDrift
from backend.bench.route_sim import ClusterSimulation, SimJob, SimWorker
from backend.costmodel.slack import DEFAULT_MAX_PARKS_PER_ROUND
from backend.dispatch.router import AdapterNeed, Decision, JobRequest, RoutingCostModel, RowOrder
from backend.worker.batch_rows import Row, SchedulerOutput
from backend.worker.batching import BatchScheduler
from backend.worker.deadlines import DeadlinePlan
from backend.worker.step_clock import StepClock

if TYPE_CHECKING:
    from backend.bench.route_bench import RouteBenchConfig

ARMS = ("fifo", "edf", "slack")


@dataclass(frozen=True)
class Service:
    """A request's service level on the simulated clock."""

    service_class: str
    deadline: float  # arrival + the class's target
    priority: int = 0


@dataclass(frozen=True)
class StepPlan:
    """The workers' step scheduler and its bounds (``Settings.deadlines``)."""

    scheduler: str = "slack"
    round_steps: int = 5
    max_wait_s: float = 300.0
    max_parks_per_round: int = DEFAULT_MAX_PARKS_PER_ROUND
    urgent_parks: bool = True  # parks for a row late by the next round at once (else at rounds)
    park_by_deadline: bool = True  # a row is parked only for an earlier deadline
    # a row passed over while its cache is read keeps its slot from rows due after it
    keep_slot_while_reading: bool = True
    # predict steps on a ``StepClock`` that each simulated step calibrates, as the engine worker
    # does (False: the cost model's figure, fixed)
    clock: bool = False

    @property
    def order(self) -> RowOrder:
        """The same, as the router models it."""
        return RowOrder(
            self.scheduler,
            self.round_steps,
            self.max_parks_per_round,
            urgent_parks=self.urgent_parks,
            max_wait_s=self.max_wait_s,
            park_by_deadline=self.park_by_deadline,
        )


@dataclass(frozen=True)
class ShedRule:
    """Admission control (module docstring); ``Settings.deadlines``' fields of the same names."""

    shed_classes: tuple[str, ...] = ("batch",)
    late_factor: float = 2.0
    max_queue: int = 256

    def refuses(
        self, service: Service, predicted_s: float, to_deadline_s: float, queued: int
    ) -> str:
        """Why a job is refused ("queue", "deadline"), or "" when it is accepted."""
        if service.service_class not in self.shed_classes:
            return ""
        if queued >= self.max_queue:
            return "queue"
        return "deadline" if predicted_s > self.late_factor * to_deadline_s else ""


class DeadlineSimWorker(SimWorker):
    """A ``SimWorker`` whose scheduler may park rows (module docstring): a parked row keeps its
    cache pinned; a recording row may not be parked."""

    clock: StepClock | None = None  # with ``StepPlan.clock``: learns from every step
    stepping_s = 0.0  # the seconds of the step running now

    def use_plan(self, plan: StepPlan, model: RoutingCostModel) -> None:
        """Schedule with ``plan`` (fifo: no plan, as today), predicting steps with ``model``
        (calibrated by a step clock with ``plan.clock``)."""
        self.order = plan.order

        def step_time(rows: Sequence[Row]) -> float:
            jobs = self.jobs
            return model.step_latency(
                [(r.mask_ratio, r.template, not jobs[r.job_id].records) for r in rows]
            )

        if plan.clock and plan.scheduler != "fifo":
            self.clock = StepClock(model.step_latency)
            step_time = self.clock.planned
        self.scheduler = BatchScheduler(
            self.cfg.max_batch,
            plan=None
            if plan.scheduler == "fifo"
            else DeadlinePlan(
                scheduler=plan.scheduler,
                round_steps=plan.round_steps,
                max_wait_s=plan.max_wait_s,
                max_parks_per_round=plan.max_parks_per_round,
                urgent_parks=plan.urgent_parks,
                park_by_deadline=plan.park_by_deadline,
                keep_slot_while_reading=plan.keep_slot_while_reading,
                step_time=step_time,
            ),
        )

    def _ready(self, row: Row) -> bool:
        return row.parked or super()._ready(row)  # a parked row kept its cache pinned

    def finish_step(self, now: float) -> list[SimJob]:
        if self.clock is not None:  # the step's rows, before the finished ones leave
            self.clock.observe(list(self.scheduler.running.values()), self.stepping_s)
        return super().finish_step(now)

    def _scheduled(self, out: SchedulerOutput, now: float) -> None:
        resumed = set(out.resumed)
        for job_id in out.admitted:
            if job_id not in resumed:  # a resumed row was admitted (and counted) before
                job = self.jobs[job_id]
                self._admit(job, now)
                self.scheduler.running[job_id].parkable = not job.records


class DeadlineClusterSimulation(ClusterSimulation):
    """``ClusterSimulation`` with service levels, deadline-scheduled workers and admission
    control (module docstring). ``blind``: the router is not shown the deadlines."""

    worker_class = DeadlineSimWorker

    def __init__(
        self,
        cfg: RouteBenchConfig,
        truth: RoutingCostModel,
        router,
        trace,
        disk: set[str],
        services: Sequence[Service],
        plan: StepPlan,
        model: RoutingCostModel,
        shed: ShedRule | None = None,
        blind: bool = False,
        drift: DriftSpec | None = None,
    ):
        super().__init__(cfg, truth, router, trace, disk)
        self.services, self.shed_rule, self.blind = services, shed, blind
        # each worker's own machine, drifting on its own (None: steps only get ``noise_cv``)
        self.drifts = (
            [SpeedDrift(drift, [cfg.seed, i, 7]) for i in range(cfg.num_workers)]
            if drift is not None and drift.cv > 0
            else None
        )
        for worker in self.workers:
            assert isinstance(worker, DeadlineSimWorker)
            worker.use_plan(plan, model)
        self.refused: dict[int, str] = {}  # request index -> why ("queue" or "deadline")
        self.accepted_late: set[int] = set()  # accepted although predicted late
        self.predicted: dict[int, float] = {}  # request index -> the router's predicted finish

    def step_seconds(self, worker: SimWorker, rows: list[tuple[float, str, bool]]) -> float:
        """The step's seconds, slowed by the worker's machine's drift at the step's start."""
        seconds = super().step_seconds(worker, rows)
        if self.drifts is not None:  # the worker's caches settled at the step's start
            seconds *= self.drifts[int(worker.worker_id[1:])].factor(worker.caches.now)
        assert isinstance(worker, DeadlineSimWorker)
        worker.stepping_s = seconds
        return seconds

    def request_of(
        self, req, template: str, adapters: tuple[AdapterNeed, ...], now: float
    ) -> JobRequest:
        job = super().request_of(req, template, adapters, now)
        if self.blind:
            return job
        service = self.services[req.index]
        return replace(job, deadline=service.deadline, priority=service.priority, now=now)

    def accept(self, req, decision: Decision, now: float) -> bool:
        service = self.services[req.index]
        terms = decision.terms.get(decision.worker_id or "", {})
        predicted = terms.get("finish_s", 0.0)
        self.predicted[req.index] = now + predicted
        if self.shed_rule is not None:
            queued = len(self.held) + sum(len(w.scheduler.waiting) for w in self.workers)
            why = self.shed_rule.refuses(service, predicted, service.deadline - now, queued)
            if why:
                self.refused[req.index] = why
                return False
        if now + predicted > service.deadline:
            self.accepted_late.add(req.index)
        return True

    def with_service(self, job: SimJob, req) -> SimJob:
        service = self.services[req.index]
        job.deadline, job.priority = service.deadline, service.priority
        job.service_class = service.service_class
        return job

    def scheduler_counts(self) -> dict[str, int]:
        """Parks, resumes and planning rounds over every worker."""
        out = {"parks": 0, "resumes": 0, "rounds": 0}
        for worker in self.workers:
            for key, value in worker.scheduler.counters().items():
                out[key] += value
        return out

"""The route simulation's cluster: a discrete-event simulation of engine workers and a router.

Every simulated worker runs the serving worker's own pure parts on simulated time: the
``BatchScheduler`` (step-level continuous batching), the ``AdmissionRules`` (prefetch-gated
admission, one recording per template) and a ``CacheManager`` over its RAM tier, so the
simulation cannot drift from the worker's rules. What the simulation supplies is time:

* a step of a batch takes the routing cost model's latency of its rows (``truth``: the exact
  Algorithm-1 plan), times a lognormal noise factor (``noise_cv``) and the measured step shape's
  factor of its row count (``cfg.step_shape``; none by default);
* the disk tier is one directory shared by every worker (``SharedDisk``); a disk -> RAM read of an
  entry takes ``read_s``, one read at a time per worker (the tiered cache's one prefetch thread),
  in the order the manager plans them; a recording is committed to the shared disk when its row
  finishes and then read into the recorder's RAM, as ``TieredActivationCache.commit`` does.

LoRA adapters (``cfg.num_adapters`` > 0; ``SimulatedAdapters``): each job carries the adapters
its request draws (``route_bench.adapter_catalog``), and each worker keeps them in the serving
worker's own ``AdapterBook`` (device and host tiers with their byte budgets and eviction policy)
and joins them to rows with its ``RowJoins``: a queued job's adapters are read from the shared
registry into host RAM at once (one read at a time), a row asks for them when admitted (a host ->
device copy, one at a time, after the read), takes each at the first step it is on the device and,
at its join deadline, blocks the whole step until the rest has landed (as
``RowAdapters.before_step`` does). Reads and copies take bytes x their seconds per byte.

Invariants: a worker's RAM tier holds at most ``ram_templates`` entries (its budget in bytes);
every job routed to a worker finishes on it; a read lands (``complete_load``) only at or after the
time it was planned to; a row runs its join-deadline step only with every adapter joined.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from backend.bench.step_shape import shape_factor
from backend.cache.manager import CacheManager, LoadPlan, Residency, Tier
from backend.dispatch.router import (
    AdapterNeed,
    Decision,
    JobRequest,
    Router,
    RoutingCostModel,
    RowOrder,
    RowState,
    WorkerView,
)
from backend.worker.adapter_book import AdapterBook, RowJoins, join_deadline
from backend.worker.admission import AdmissionRules, Candidate
from backend.worker.batch_rows import Row, SchedulerOutput
from backend.worker.batching import BatchScheduler
from backend.worker.deadlines import waited_s

if TYPE_CHECKING:
    from backend.bench.route_bench import RouteBenchConfig

UNLIMITED_DISK_BYTES = 1 << 62  # the shared disk holds every template: its budget never binds
GROUP = "sim"  # every simulated row shares forward passes (one model, resolution and cache mode)


@dataclass
class SimJob:
    index: int
    template: str
    mask_ratio: float
    arrived_at: float
    admitted_at: float | None = None
    cached: bool = False  # reads its template's cache (set at admission)
    records: bool = False  # computes densely and records its template's cache
    adapters: tuple[AdapterNeed, ...] = ()  # its LoRA adapters (sha, bytes)
    joins: RowJoins | None = None  # set at admission when it has adapters
    steps_done: int = 0
    deadline: float = 0.0  # on the simulated clock (0: none); route_deadlines sets these
    priority: int = 0
    service_class: str = ""
    wait_s: float = 0.0  # queued and parked, in all (set when it finishes)
    parks: int = 0  # times it was parked (set when it finishes)


class SimulatedAdapters:
    """One worker's adapter tiers on simulated time (module docstring); ``AdapterBook`` decides
    residency and eviction, this class supplies when reads and copies land."""

    def __init__(self, cfg: RouteBenchConfig, read_s_per_byte: float, copy_s_per_byte: float):
        mib = 1 << 20
        self.book = AdapterBook(
            cfg.adapter_device_mb * mib, cfg.adapter_host_mb * mib, cfg.adapter_policy
        )
        self.read_s_per_byte, self.copy_s_per_byte = read_s_per_byte, copy_s_per_byte
        self.to_host: dict[str, tuple[float, int]] = {}  # sha -> (read lands, bytes)
        self.to_device: dict[str, tuple[float, int]] = {}  # sha -> (copy lands, bytes)
        self.read_free_at = self.copy_free_at = 0.0

    def settle(self, now: float) -> None:
        """Reads and copies that landed by ``now`` enter their tier, in landing order."""
        landed = [(t, 0, sha, n) for sha, (t, n) in self.to_host.items() if t <= now]
        landed += [(t, 1, sha, n) for sha, (t, n) in self.to_device.items() if t <= now]
        for _t, kind, sha, nbytes in sorted(landed):
            if kind == 0:
                del self.to_host[sha]
                self.book.loaded(sha, nbytes)
            else:
                del self.to_device[sha]
                self.book.on_device(sha, nbytes)

    def prefetch(self, need: AdapterNeed, now: float) -> float:
        """Start reading ``need`` into host RAM unless it is there or on its way; when it is in
        host RAM (now or later)."""
        if need.sha256 in self.to_host:
            return self.to_host[need.sha256][0]
        if self.book.start_load(need.sha256):
            self.read_free_at = max(now, self.read_free_at) + need.nbytes * self.read_s_per_byte
            self.to_host[need.sha256] = (self.read_free_at, need.nbytes)
            return self.read_free_at
        return now

    def ask(self, need: AdapterNeed, now: float) -> None:
        """A row was admitted with ``need``: count the hit by tier, and start its copy to the
        device (after its read) unless it is there or on its way."""
        self.book.asked(need.sha256)
        self._copy(need, now)

    def _copy(self, need: AdapterNeed, now: float) -> None:
        if need.sha256 in self.book.device.sizes or need.sha256 in self.to_device:
            return
        on_host = self.prefetch(need, now)
        start = max(on_host, self.copy_free_at)
        self.copy_free_at = start + need.nbytes * self.copy_s_per_byte
        self.to_device[need.sha256] = (self.copy_free_at, need.nbytes)

    def lands_at(self, need: AdapterNeed, now: float) -> float:
        """When ``need`` is on the device (asking for it again if an eviction took it)."""
        if need.sha256 in self.book.device.sizes:
            return now
        self._copy(need, now)
        return self.to_device[need.sha256][0]


class SharedDisk:
    """The disk tier every worker shares: the templates recorded there, in one frozen view."""

    def __init__(self, templates: set[str]):
        self.templates = set(templates)
        self.view = frozenset(self.templates)

    def publish(self, template: str) -> None:
        self.templates.add(template)
        self.view = frozenset(self.templates)


class SimulatedCaches:
    """One worker's tiered cache on simulated time (module docstring); ``CacheManager`` decides.

    A ``CacheGate`` for ``AdmissionRules``: ``settle(now)`` first sets the time of the questions.
    """

    def __init__(self, ram_entries: int, disk: SharedDisk, entry_bytes: int, read_s: float):
        self.manager = CacheManager(ram_entries * entry_bytes, UNLIMITED_DISK_BYTES)
        self.disk, self.entry_bytes, self.read_s = disk, entry_bytes, read_s
        self.landing: dict[str, float] = {}  # entry -> when its read lands in RAM
        self.disk_free_at = 0.0
        self.reads = 0
        self.now = 0.0

    def settle(self, now: float) -> None:
        """Advance to ``now``: reads that landed by then complete."""
        self.now = now
        for entry_id, lands in list(self.landing.items()):
            if lands <= now:
                del self.landing[entry_id]
                self.manager.complete_load(entry_id, ok=True)

    def next_landing(self) -> float | None:
        return min(self.landing.values(), default=None)

    def _discover(self, entry_id: str) -> None:
        """An entry another worker published on the shared disk is registered before it is used,
        as ``TieredActivationCache._discover`` does."""
        if self.manager.residency(entry_id) is Residency.MISS and entry_id in self.disk.templates:
            self.manager.register_disk(entry_id, self.entry_bytes)

    def _read(self, plan: LoadPlan) -> None:
        """Queue the planned read behind this worker's reads in flight (its evictions only drop
        RAM copies: every entry stays on the shared disk)."""
        self.disk_free_at = max(self.now, self.disk_free_at) + self.read_s
        self.landing[plan.entry_id] = self.disk_free_at
        self.reads += 1

    def prefetch(self, entry_id: str, speculative: bool) -> None:
        self._discover(entry_id)
        plan = self.manager.plan_prefetch(entry_id, self.now, speculative)
        if plan is not None:
            self._read(plan)

    def ready(self, row: Candidate) -> bool:
        self.prefetch(row.template, speculative=False)
        return self.manager.acquirable_now(row.template)

    def acquire(self, row: Candidate) -> bool:
        self._discover(row.template)
        if self.manager.lookup(row.template, now=self.now) is Residency.MISS:
            return True
        self.manager.pin(row.template)
        return False

    def release(self, entry_id: str) -> None:
        self.manager.unpin(entry_id)

    def commit(self, entry_id: str) -> None:
        """A recording finished: publish it on the shared disk (unless another worker did
        meanwhile) and read it into RAM speculatively (it is likely edited again)."""
        self._discover(entry_id)
        if self.manager.residency(entry_id) is not Residency.MISS:
            return
        self.disk.publish(entry_id)
        plan = self.manager.prepare_store(entry_id, self.entry_bytes, Tier.DISK)
        self.manager.complete_store(entry_id, ok=plan.ok)
        load = self.manager.prepare_load(entry_id, spare_prefetched=True)
        if load is not None and load.ok:
            self._read(load)


class SimWorker:
    """One engine worker: ``BatchScheduler`` + ``AdmissionRules`` + ``SimulatedCaches``."""

    def __init__(
        self,
        worker_id: str,
        cfg: RouteBenchConfig,
        caches: SimulatedCaches,
        adapters: SimulatedAdapters | None = None,
    ):
        self.worker_id, self.cfg, self.caches = worker_id, cfg, caches
        self.adapters = adapters
        self.block_s = 0.0  # how long the step being started waits for adapters (deadline)
        self.blocked_s = 0.0  # all steps' waits for adapters
        self.scheduler = BatchScheduler(cfg.max_batch)
        self.order = RowOrder()  # how the router models this worker's scheduler
        self.admission = AdmissionRules()
        self._gate = _AdmittedGate(self)
        self.jobs: dict[str, SimJob] = {}
        self.queue_s: list[float] = []  # arrival -> admission of every admitted job
        self.held = self.dense_rows = 0  # row-schedules a row was held; rows run densely
        self.busy = False  # a step is in flight
        self.wake_at: float | None = None  # a wake event is pending for a landing read

    def view(self, cfg: RouteBenchConfig, now: float) -> WorkerView:
        """The router's view of this worker at ``now`` (waits counted to then)."""
        book = self.adapters.book if self.adapters is not None else None
        shas = {j: tuple(a.sha256 for a in job.adapters) for j, job in self.jobs.items() if book}

        def state(r: Row, step: int, waited: float = 0.0) -> RowState:
            return RowState(
                r.job_id,
                r.mask_ratio,
                r.remaining_steps,
                r.template,
                shas.get(r.job_id, ()),
                r.deadline,
                r.priority,
                step,
                waited,
                r.due,
            )

        return WorkerView(
            self.worker_id,
            cfg.model_id,
            cfg.device,
            cfg.max_batch,
            tuple(state(r, 0) for r in self.scheduler.running.values()),
            tuple(state(r, r.step, waited_s(r, now)) for r in self.scheduler.waiting.values()),
            frozenset(self.caches.manager.resident(Tier.RAM)),
            self.caches.disk.view,
            frozenset(book.device.sizes) if book else frozenset(),
            frozenset(book.host.sizes) if book else frozenset(),
            self.order,
        )

    def receive(self, job: SimJob, now: float) -> None:
        """A routed job joins the queue; its template's read starts at once (a speculative
        prefetch, as the worker's on arrival)."""
        job_id = str(job.index)
        self.jobs[job_id] = job
        self.scheduler.add(
            Row(
                job_id,
                self.cfg.steps,
                GROUP,
                job.mask_ratio,
                now,
                template=job.template,
                deadline=job.deadline,
                priority=job.priority,
                service_class=job.service_class,
            )
        )
        self.caches.settle(now)
        self.caches.prefetch(job.template, speculative=True)
        if self.adapters is not None:
            self.adapters.settle(now)
            for need in job.adapters:  # read into host RAM while queued
                self.adapters.prefetch(need, now)

    def start_step(self, now: float) -> list[tuple[float, str, bool]]:
        """Admit at a step boundary; the running rows ``(mask, template, cached)`` of the step."""
        self.caches.settle(now)
        self.admission.start_schedule()
        out = self.scheduler.schedule(now, self._ready)
        self.held += len(out.held)
        self._scheduled(out, now)
        self.block_s = self._join_adapters(now) if self.adapters is not None else 0.0
        return [
            (job.mask_ratio, job.template, job.cached)
            for job in (self.jobs[j] for j in self.scheduler.running)
        ]

    def _scheduled(self, out: SchedulerOutput, now: float) -> None:
        """The schedule's admissions (a subclass also handles its parks and resumes)."""
        for job_id in out.admitted:
            self._admit(self.jobs[job_id], now)

    def _ready(self, row: Row) -> bool:
        return self.admission.admit(Candidate(row.job_id, row.template), self._gate)

    def _join_adapters(self, now: float) -> float:
        """Running rows take the adapters on the device; a row at its deadline waits for the
        rest: the seconds the step waits (``RowAdapters.before_step``)."""
        assert self.adapters is not None
        tiers, until = self.adapters, now
        tiers.settle(now)
        blocked: list[SimJob] = []
        for job in (self.jobs[j] for j in self.scheduler.running):
            if job.joins is None or not job.joins.missing():
                continue
            ready, waits = job.joins.plan(job.steps_done, tiers.book.device.sizes)
            self._join(job, ready)
            if waits:
                tiers.book.counters.rows_blocked += 1
                needs = {a.sha256: a for a in job.adapters}
                until = max([until] + [tiers.lands_at(needs[sha], now) for sha in waits])
                blocked.append(job)
        if blocked:
            tiers.settle(until)
            for job in blocked:
                assert job.joins is not None
                self._join(job, job.joins.missing())
        return until - now

    def _join(self, job: SimJob, shas: list[str]) -> None:
        assert self.adapters is not None and job.joins is not None
        for sha in shas:
            if sha not in job.joins.joined:
                self.adapters.book.pin(sha)
        job.joins.join(shas, job.steps_done)

    def _admit(self, job: SimJob, now: float) -> None:
        job.admitted_at = now
        self.queue_s.append(now - job.arrived_at)
        if self.adapters is not None and job.adapters:
            self.adapters.settle(now)
            wanted = {a.sha256: 1.0 for a in job.adapters}
            job.joins = RowJoins(wanted, join_deadline(self.cfg.steps, self.cfg.adapter_join_by))
            self.adapters.book.counters.rows_with_adapters += 1
            for need in {a.sha256: a for a in job.adapters}.values():
                self.adapters.ask(need, now)
        if job.cached:
            return
        self.dense_rows += 1
        candidate = Candidate(str(job.index), job.template)
        if self.admission.should_record(candidate):
            job.records = True
            self.admission.start_recording(job.template)

    def finish_step(self, now: float) -> list[SimJob]:
        """Every running row stepped once; the jobs that finished (their caches released, their
        recordings committed)."""
        self.caches.settle(now)
        for job_id in self.scheduler.running:
            self.jobs[job_id].steps_done += 1
        finished = []
        for row in self.scheduler.update_from_output(list(self.scheduler.running)):
            job = self.jobs.pop(row.job_id)
            job.wait_s, job.parks = row.wait_s, row.parks
            if job.joins is not None and self.adapters is not None:
                for sha in job.joins.joined:
                    self.adapters.book.unpin(sha)
            if job.records:
                self.admission.end_recording(job.template)
                self.caches.commit(job.template)
            elif job.cached:
                self.caches.release(job.template)
            finished.append(job)
        return finished


class _AdmittedGate:
    """``SimulatedCaches`` as the worker's gate: an acquire also marks the job cached or not."""

    def __init__(self, worker: SimWorker):
        self.worker = worker

    def ready(self, row: Candidate) -> bool:
        return self.worker.caches.ready(row)

    def acquire(self, row: Candidate) -> bool:
        miss = self.worker.caches.acquire(row)
        self.worker.jobs[row.job_id].cached = not miss
        return miss


class ClusterSimulation:
    """Workers, a router and a trace: ``run`` replays the trace (module docstring)."""

    worker_class = SimWorker

    def __init__(
        self,
        cfg: RouteBenchConfig,
        truth: RoutingCostModel,
        router: Router,
        trace,
        disk: set[str],
        adapter_blind: bool = False,
    ):
        self.cfg, self.truth, self.router, self.trace = cfg, truth, router, trace
        self.disk = SharedDisk(disk)
        entry_bytes = max(1, truth.step_cache_bytes * cfg.steps)
        # adapters: each request's (route_bench.request_adapters); the router is shown none of
        # them when ``adapter_blind`` (mask_aware without its adapter term)
        self.adapter_blind = adapter_blind
        self.adapters_of: dict[int, tuple[AdapterNeed, ...]] = {}
        if cfg.num_adapters > 0:
            from backend.bench.route_bench import request_adapters

            self.adapters_of = request_adapters(cfg, trace)
        self.workers = [
            self.worker_class(
                f"w{i:02d}",
                cfg,
                SimulatedCaches(
                    cfg.ram_templates, self.disk, entry_bytes, truth.disk_read_s(cfg.steps)
                ),
                SimulatedAdapters(
                    cfg, truth.adapter_loads.read_s_per_byte, truth.adapter_loads.copy_s_per_byte
                )
                if cfg.num_adapters > 0
                else None,
            )
            for i in range(cfg.num_workers)
        ]
        self.rngs = [np.random.default_rng([cfg.seed, i]) for i in range(cfg.num_workers)]
        self.latency_memo: dict[str, tuple] = {}  # worker id -> (batch rows, step seconds)
        self.events: list = []
        self.held: deque = deque()  # late binding: jobs the dispatcher holds (FIFO)
        self.seq = 0
        self.done_at: dict[int, float] = {}
        self.finished: dict[int, SimJob] = {}
        self.batch_rows: list[int] = []
        self.decisions: list[float] = []

    @property
    def counts(self) -> dict[str, float]:
        """ram_hits (rows whose entry was in RAM without a read of their own), disk_reads,
        dense_rows (rows run without a cache: recordings), held (row-schedules held, slot free);
        with adapters also adapter_hits_{device,host,disk} (by the tier each adapter was in when
        its row was admitted), adapter_reads, adapter_copies, adapter_rows (rows with adapters),
        adapter_rows_blocked (rows that waited at their join deadline), adapter_block_s."""
        metrics = [w.caches.manager.metrics for w in self.workers]
        out: dict[str, float] = {
            "ram_hits": sum(m.ram_hits - m.prefetch_uses for m in metrics),
            "disk_reads": sum(w.caches.reads for w in self.workers),
            "dense_rows": sum(w.dense_rows for w in self.workers),
            "held": sum(w.held for w in self.workers),
        }
        books = [w.adapters.book.counters for w in self.workers if w.adapters is not None]
        if books:
            for tier in ("device", "host", "disk"):
                out[f"adapter_hits_{tier}"] = sum(c.hits[tier] for c in books)
            out["adapter_reads"] = sum(c.disk_loads for c in books)
            out["adapter_copies"] = sum(c.device_loads for c in books)
            out["adapter_rows"] = sum(c.rows_with_adapters for c in books)
            out["adapter_rows_blocked"] = sum(c.rows_blocked for c in books)
            out["adapter_block_s"] = sum(w.blocked_s for w in self.workers)
        return out

    @property
    def queue_s(self) -> list[float]:
        return [seconds for w in self.workers for seconds in w.queue_s]

    def push(self, at: float, kind: str, data) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, data))

    def run(self) -> None:
        for req in self.trace:
            self.push(req.arrival_s, "arrive", req)
        while self.events:
            now, _, kind, data = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(now, data)
            elif kind == "wake":
                self.wake(now, data)
            else:
                self.step_done(now, data)

    def arrive(self, now: float, req) -> None:
        if self.held or not self.dispatch(now, req):
            self.held.append(req)  # FIFO: no job overtakes one held before it

    def dispatch_held(self, now: float) -> None:
        while self.held and self.dispatch(now, self.held[0]):
            self.held.popleft()

    def dispatch(self, now: float, req) -> bool:
        """Route ``req`` now; False when the router has no candidate (late binding: all full)."""
        views = [w.view(self.cfg, now) for w in self.workers]
        template = f"tpl{req.template}"
        adapters = self.adapters_of.get(req.index, ())
        job = self.request_of(req, template, () if self.adapter_blind else adapters, now)
        started = time.perf_counter()
        decision = self.router.choose(job, views)
        self.decisions.append(time.perf_counter() - started)
        if decision.worker_id is None:
            return False
        if not self.accept(req, decision, now):
            return True  # refused (admission control): answered, never queued
        worker = self.workers[int(decision.worker_id[1:])]
        sim_job = SimJob(req.index, template, req.mask_ratio, req.arrival_s, adapters=adapters)
        worker.receive(self.with_service(sim_job, req), now)
        if not worker.busy:
            self.start_step(worker, now)
        return True

    def request_of(
        self, req, template: str, adapters: tuple[AdapterNeed, ...], now: float
    ) -> JobRequest:
        """The job as the router sees it (a subclass adds its deadline)."""
        return JobRequest(
            str(req.index), self.cfg.model_id, req.mask_ratio, self.cfg.steps, template, adapters
        )

    def accept(self, req, decision: Decision, now: float) -> bool:
        """Admission control of a routed job (here: every job is accepted)."""
        return True

    def with_service(self, job: SimJob, req) -> SimJob:
        """The job with its service level (here: none)."""
        return job

    def start_step(self, worker: SimWorker, now: float) -> None:
        """The worker admits and runs its next step; with nothing to run it sleeps until the
        first read in flight lands."""
        rows = worker.start_step(now)
        if not rows:
            worker.busy = False
            wake = worker.caches.next_landing()
            if wake is not None and (worker.wake_at is None or wake < worker.wake_at):
                worker.wake_at = wake
                self.push(wake, "wake", worker)
            return
        worker.busy = True
        self.batch_rows.append(len(rows))
        worker.blocked_s += worker.block_s
        self.push(now + worker.block_s + self.step_seconds(worker, rows), "step", worker)

    def step_seconds(self, worker: SimWorker, rows: list[tuple[float, str, bool]]) -> float:
        key = tuple(rows)
        memo = self.latency_memo.get(worker.worker_id)
        if memo is None or memo[0] != key:  # most steps run the same batch as the one before
            memo = self.latency_memo[worker.worker_id] = (key, self.truth.step_latency(rows))
        seconds = memo[1] * shape_factor(self.cfg.step_shape, len(rows))
        if self.cfg.noise_cv > 0:
            sigma = math.sqrt(math.log1p(self.cfg.noise_cv**2))
            rng = self.rngs[int(worker.worker_id[1:])]
            seconds *= float(rng.lognormal(-sigma * sigma / 2, sigma))
        return seconds

    def wake(self, now: float, worker: SimWorker) -> None:
        if worker.wake_at == now:
            worker.wake_at = None
        if not worker.busy:
            self.start_step(worker, now)

    def step_done(self, now: float, worker: SimWorker) -> None:
        finished = worker.finish_step(now)
        for job in finished:
            self.done_at[job.index] = now
            self.finished[job.index] = job
        self.start_step(worker, now)
        if finished and self.held:  # a worker's load fell: held jobs may find slack now
            self.dispatch_held(now)

"""`maskserve bench worker-deadlines`: the worker bench's deadline mode. One real engine worker runs
real denoising steps under mixed service classes; its step schedulers (``fifo``, ``edf``,
``slack``, and the ``slack`` variants of ``worker_deadlines_arms.ABLATIONS``) side by side on the
same traces.

Workload: the route deadline bench's (``route_deadlines.deadline_trace`` and ``services_of``):
``interactive_share`` of the requests (default 30%) are ``interactive`` with a tight target, the
rest ``batch`` with a loose one; a request's deadline is its arrival plus its class's target. Two
arrival processes per load: ``poisson``, and ``bursty`` (the two-state MMPP: bursts at
``burst_factor`` x the mean rate, mostly batch jobs with interactive ones arriving inside them),
both conditioned on their count. Templates (Zipf), masks (Beta) and seeds as ``bench worker``
(``worker_bench.prepare_inputs``: every template's cache recorded on disk before the runs; each
run's RAM tier starts cold and holds ``ram_templates`` of them).

Calibration, on a fresh ``fifo`` worker before the traces: the single-job service time (the median
of ``probe_jobs`` jobs served one at a time on an idle worker, after one warm-up job), the speed
gauge's reference (``speed_gauge``: a ladder of k jobs at once, k = 2..``max_batch``, so that steps
of every row count are in it) and the capacity (``saturation_jobs`` jobs arriving at once:
jobs / makespan, the saturation throughput the route bench measures). Loads are fractions of
that capacity. Targets default to multiples of the single-job service time (``interactive_x``,
``batch_x``; the starvation bound ``max_wait_x``): ``Settings.deadlines``' defaults (30 s, 600 s,
300 s) are sized for real models, not for a tiny model stepping in milliseconds, so the defaults
keep their ratios (1 : 20 : 10) with the interactive target at 5 single-job times. The
calibration's step clock seeds each arm's clock.

Each arm is a fresh ``EngineWorker`` (continuous batching) with ``plan=DeadlinePlan(scheduler)``
and its own ``StepClock`` (``worker.service.deadline_plan``: the model's fitted cost profile,
calibrated by the measured steps). Pre-processing runs before a trace's runs, in this process and
not timed (every arm replays the same prepared requests); a job reaches the worker's inbox at its
arrival time carrying its service level. A job's end is when the worker handed its final latents
on (written to a file, the job sent on to post-processing), which is not run: it is the same for
every arm and outside the worker's scheduling. There is no admission control here (the API's):
every job is accepted, so the 429 rates are 0.

Statistics: ``route_deadlines.measure`` on the measured outcome (every job counted, no warm-up):
per class SLO attainment, P50/P95 latency, throughput (completions inside the arrivals' window per
second); parks and resumes per job, the longest wait (queued plus parked) of any batch job, the
jobs waiting past the starvation bound; how far the finish each job was told was from its real
one (``forecast_accuracy``); then ``comparison`` and ``targets`` against ``fifo``.

The machine's speed: each run's ``slowdown`` is the median over its steps of measured / modelled
step time against the calibration's (``speed_gauge``); a run outside ``speed_band`` (say
1.3: more than 1.3 x slower or faster) is run again, at most ``retries`` more times, and the
report keeps the first attempt in the band (else the nearest), with every attempt's slowdown.

Repeats (``repeats``): each (process, load) runs its arms that many times on the same trace, the
order rotated by one arm each repeat (``rotated``). An arm is compared with fifo's run of the same
repeat, and the targets are judged on those paired differences averaged over the repeats
(``worker_deadlines_report.mean_comparison``), and again on the worst single repeat: this
machine's speed drifts by tens of percent over minutes, enough to move a tight-target cell by 20-50
points between two runs of the same arm.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import numpy as np
import torch

from backend.bench import speed_gauge
from backend.bench.forecast_accuracy import forecast_errors, told_forecasts
from backend.bench.route_deadlines import (
    CLASSES,
    TRACES,
    DeadlineBenchConfig,
    check_serve_classes,
    comparison,
    deadline_trace,
    measure,
    served,
    services_of,
    shown_attainment,
    targets,
)
from backend.bench.trace import counted_trace
from backend.bench.worker_bench import (
    BenchConfig,
    BenchInputs,
    edit_job,
    prepare_inputs,
    template_caches,
)
from backend.bench.worker_deadlines_arms import ARMS, SCHEDULERS, arm_deadlines, arm_plan
from backend.bench.worker_deadlines_report import mean_comparison, speed_adjusted
from backend.blobs import BlobStore
from backend.blobs.factory import open_blob_store
from backend.config import Settings
from backend.costmodel.slack import DEFAULT_MAX_PARKS_PER_ROUND
from backend.engine.factory import build_engine
from backend.protocol import PreparedJob, ServiceLevel
from backend.worker.batch_rows import Row
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from backend.worker.step_clock import JoinRule, StepClock


@dataclass
class WorkerDeadlineConfig:
    model_id: str = "tiny-sd2-inpaint"
    size: int = 128
    steps: int = 20
    max_batch: int = 8
    num_templates: int = 8
    ram_templates: int = 8  # RAM tier budget, in templates
    mask_mean: float = 0.11
    duration_s: float = 40.0  # seconds of arrivals per run
    seed: int = 0
    schedulers: tuple[str, ...] = SCHEDULERS
    traces: tuple[str, ...] = TRACES
    loads: tuple[float, ...] = (0.8, 1.0)
    interactive_share: float = 0.3
    # the classes whose jobs arrive (``route_deadlines.DeadlineBenchConfig.serve_classes``)
    serve_classes: tuple[str, ...] = CLASSES
    # targets and the starvation bound, as multiples of the single-job service time (the ratios
    # of ``Settings.deadlines``' 30 s, 600 s, 300 s) ...
    interactive_x: float = 5.0
    batch_x: float = 100.0
    max_wait_x: float = 50.0
    # ... or in seconds (> 0 wins)
    interactive_target_s: float = 0.0
    batch_target_s: float = 0.0
    max_wait_s: float = 0.0
    # bursts (``bursty``), as ``route_deadlines``
    burst_factor: float = 10.0
    burst_share: float = 0.05
    burst_s: float = 1.0
    # the step scheduler (``Settings.deadlines``)
    round_steps: int = 5
    max_parks_per_round: int = DEFAULT_MAX_PARKS_PER_ROUND
    # calibration
    capacity_rps: float = 0.0  # > 0: loads are fractions of this rate (no saturation run)
    probe_jobs: int = 5
    saturation_jobs: int = 32
    # the machine's speed (``speed_gauge``): a run whose median step ran more than ``speed_band``
    # times slower or faster than at calibration is run again, up to ``retries`` times (<= 1: no
    # band)
    speed_band: float = 1.3
    retries: int = 2
    drain_timeout_s: float = 300.0  # a run fails when jobs are left this long after arrivals end
    # each (process, load)'s arms run this many times, the order rotated by one each time
    repeats: int = 1
    # the worker's torch threads: 1 leaves this 2-core machine's other core to the bench's
    # feeder and sink; the stack's engine worker runs on every core (torch's default)
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be at least 1, got {self.torch_threads}")
        unknown = set(self.schedulers) - set(ARMS)
        if unknown:
            raise ValueError(f"unknown schedulers {sorted(unknown)}; expected some of {ARMS}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        check_serve_classes(self.serve_classes)
        if self.steps < 2:  # a row is seen in the scheduler between iterations (``_Worker``)
            raise ValueError(f"the bench needs at least 2 steps per job, got {self.steps}")

    def bench(self) -> BenchConfig:
        """``bench worker``'s configuration of the same model, templates and masks."""
        return BenchConfig(
            model_id=self.model_id,
            modes=("continuous",),
            duration_s=self.duration_s,
            num_templates=self.num_templates,
            ram_templates=self.ram_templates,
            mask_mean=self.mask_mean,
            steps=self.steps,
            size=self.size,
            max_batch=self.max_batch,
            seed=self.seed,
        )

    def workload(self, targets_s: dict[str, float]) -> DeadlineBenchConfig:
        """The route deadline bench's workload (traces, classes, statistics) for this run:
        ``targets_s`` holds ``interactive``, ``batch`` and ``max_wait`` in seconds."""
        return DeadlineBenchConfig(
            model_id=self.model_id,
            duration_s=self.duration_s,
            num_workers=1,
            max_batch=self.max_batch,
            steps=self.steps,
            num_templates=self.num_templates,
            mask_mean=self.mask_mean,
            warmup_fraction=0.0,
            seed=self.seed,
            schedulers=self.schedulers,
            traces=self.traces,
            loads=self.loads,
            interactive_share=self.interactive_share,
            serve_classes=self.serve_classes,
            interactive_target_s=targets_s["interactive"],
            batch_target_s=targets_s["batch"],
            burst_factor=self.burst_factor,
            burst_share=self.burst_share,
            burst_s=self.burst_s,
            round_steps=self.round_steps,
            max_wait_s=targets_s["max_wait"],
            max_parks_per_round=self.max_parks_per_round,
            shed=False,
        )

    def targets_s(self, service_s: float) -> dict[str, float]:
        """Targets and the starvation bound in seconds, given the single-job service time."""
        return {
            "interactive": self.interactive_target_s or self.interactive_x * service_s,
            "batch": self.batch_target_s or self.batch_x * service_s,
            "max_wait": self.max_wait_s or self.max_wait_x * service_s,
        }


@dataclass(frozen=True)
class Calibration:
    service_s: float  # one job alone on an idle worker: arrival -> latents handed on
    capacity_rps: float  # jobs per second of the saturated worker
    # the step clock after the calibration (each arm's clock starts there): its scale and its
    # shape per row count (JSON keys are strings)
    clock_scale: float
    clock_shape: dict[str, float]
    # the speed gauge's reference: the median measured / modelled step time (``speed_gauge``),
    # and per row count the median over its steps (for the record; noisy, not the reference)
    step_ratio: float
    step_ratios: dict[str, float]


@dataclass
class Outcome:
    """A run as ``route_deadlines.measure`` reads a simulation: request index -> seconds after the
    start when handed on, and -> its scheduler row (waits, parks, class); parks and resumes."""

    done_at: dict[int, float]
    finished: dict[int, Row]
    parks: int
    resumes: int
    refused: dict = field(default_factory=dict)  # no admission control in this bench
    accepted_late: set = field(default_factory=set)
    decisions: list = field(default_factory=list)
    predicted: dict = field(default_factory=dict)  # no router here: nothing predicted at placement

    def scheduler_counts(self) -> dict[str, int]:
        return {"parks": self.parks, "resumes": self.resumes}


# ----- one worker ---------------------------------------------------------------------------------
class _Worker:
    """A fresh engine worker fed by an in-process inbox; records when each job was handed on and
    keeps each job's scheduler row (its waits and parks stay readable after it leaves)."""

    def __init__(
        self,
        engine,
        blobs,
        caches,
        plan,
        clock: StepClock,
        join_rule: JoinRule | None,
        max_batch: int,
        name: str,
        forecast_refresh_s: float,
    ):
        self.blobs, self.caches = blobs, caches
        self.done: dict[str, float] = {}
        self.rows: dict[str, Row] = {}
        self.batch_sizes: dict[str, list[int]] = {}  # job id -> rows of each step it ran in
        # rows -> measured / modelled seconds of each step of that many rows (``speed_gauge``)
        self.step_ratios: dict[int, list[float]] = {}
        self.margins: list[float] = []  # the clock's planning margin after each step
        observe = clock.observe

        def observed(rows, seconds: float) -> None:  # the worker reports every step it ran
            for row in rows:
                self.batch_sizes.setdefault(row.job_id, []).append(len(rows))
            modelled = clock.modelled(rows)
            if modelled > 0:
                self.step_ratios.setdefault(len(rows), []).append(seconds / modelled)
            observe(rows, seconds)
            self.margins.append(clock.margin)

        clock.observe = observed  # type: ignore[method-assign]
        self.inbox = LocalInbox()
        self.sink = LocalSink(on_denoised=self._handed_on)
        self.worker = EngineWorker(
            engine,
            blobs,
            self.inbox,
            self.sink,
            worker_id=f"bench-{name}",
            max_batch=max_batch,
            caches=caches,
            plan=plan,
            clock=clock,
            join_rule=join_rule,
            forecast_refresh_s=forecast_refresh_s,
        )

    def _handed_on(self, denoised) -> None:
        self.done[denoised.job_id] = time.time()

    def close(self) -> None:
        """Its RAM tier and prefetch threads go (they must not weigh on the next run), and the
        final latents it wrote."""
        self.caches.close()
        for job in self.sink.denoised_jobs:
            self.blobs.delete(job.latents_ref)

    def serve(self, jobs: list[tuple[float, PreparedJob]], timeout_s: float) -> dict[str, float]:
        """Each job into the inbox at its epoch (a thread); the worker steps until every one is
        handed on. Job id -> epoch handed on."""

        def arrive() -> None:
            for at, job in jobs:
                time.sleep(max(0.0, at - time.time()))
                self.inbox.put(job)

        ids = [job.job_id for _, job in jobs]
        give_up = jobs[-1][0] + timeout_s
        threading.Thread(target=arrive, daemon=True).start()
        seen = -1
        scheduler = self.worker.scheduler
        while True:
            if len(self.done) != seen:
                seen = len(self.done)
                if all(j in self.done for j in ids):
                    return {j: self.done[j] for j in ids}
            lost = sum(self.worker.stats.jobs_by_status[s] for s in ("failed", "cancelled"))
            if lost or time.time() > give_up:
                failed = [e for e in self.sink.events if e.status in ("failed", "cancelled")]
                raise RuntimeError(
                    f"{sum(j not in self.done for j in ids)} jobs not handed on "
                    f"({lost} failed or cancelled: {[e.message for e in failed][:3]})"
                )
            self.worker.iterate(idle_poll_s=0.002)
            for rows in (scheduler.waiting, scheduler.running):
                for job_id, row in rows.items():
                    self.rows.setdefault(job_id, row)


@dataclass
class _Bench:
    """What every run shares: the model, the blob store, pre-processing; once calibrated, the
    targets and the workload; the current trace's inputs."""

    cfg: WorkerDeadlineConfig
    settings: Settings
    engine: object
    blobs: BlobStore
    stages: object
    inputs: BenchInputs | None = None
    calibration: Calibration | None = None
    targets_s: dict = field(default_factory=dict)
    workload: DeadlineBenchConfig | None = None

    def prepare(self, trace: list, prefix: str) -> list[PreparedJob]:
        """Template and mask files for ``trace`` and each request pre-processed (not timed)."""
        bench = self.cfg.bench()
        self.inputs = prepare_inputs(bench, self.settings, self.engine, trace, self.blobs)
        guidance = self.engine.spec.default_guidance
        return [
            self.stages.preprocess(edit_job(bench, r, self.inputs, prefix, guidance)) for r in trace
        ]

    def worker(self, scheduler: str, max_wait_s: float, name: str) -> tuple[_Worker, StepClock]:
        """A fresh worker with ``scheduler``'s plan, its clock and a cold RAM tier."""
        deadlines = arm_deadlines(self.settings, self.cfg, scheduler, max_wait_s)
        plan, clock, join_rule = arm_plan(self.settings, self.cfg, deadlines)
        caches = template_caches(self.engine, self.settings, self.inputs, self.cfg.ram_templates)
        worker = _Worker(
            self.engine,
            self.blobs,
            caches,
            plan,
            clock,
            join_rule,
            self.cfg.max_batch,
            name,
            deadlines.forecast_refresh_s,
        )
        return worker, clock


def _discard(blobs: BlobStore, prepared: list[PreparedJob]) -> None:
    """The pre-processed requests' files (post-processing deletes them in the service)."""
    for job in prepared:
        blobs.delete(job.prepared_ref)
        if job.paste is not None:
            blobs.delete(job.paste.mask_ref)


def calibrate(bench: _Bench) -> Calibration:
    """Single-job service time, the speed gauge's reference and the capacity on a fresh ``fifo``
    worker (module docstring). The reference's ladder: k jobs at once for k = 2..max_batch, so
    that steps of every row count are measured (the probes give one row)."""
    cfg = bench.cfg
    ladder = list(range(2, cfg.max_batch + 1))
    n = 1 + cfg.probe_jobs + sum(ladder) + (0 if cfg.capacity_rps > 0 else cfg.saturation_jobs)
    trace = counted_trace(1.0, float(n), cfg.num_templates, cfg.mask_mean, seed=cfg.seed + 1)
    prepared = bench.prepare(trace, "calibration")
    worker, clock = bench.worker("fifo", 1e9, "calibration")
    try:
        alone = []
        for job in prepared[: 1 + cfg.probe_jobs]:  # the first warms up
            at = time.time()
            alone.append(worker.serve([(at, job)], cfg.drain_timeout_s)[job.job_id] - at)
            if len(alone) == 1:
                worker.step_ratios.clear()  # the warm-up's steps are no reference
        alone.pop(0)
        rest = prepared[1 + cfg.probe_jobs :]
        for k in ladder:
            at = time.time()
            worker.serve([(at, job) for job in rest[:k]], cfg.drain_timeout_s)
            rest = rest[k:]
        capacity = cfg.capacity_rps
        if capacity <= 0:
            at = time.time()
            done = worker.serve([(at, job) for job in rest], cfg.drain_timeout_s)
            capacity = len(rest) / (max(done.values()) - at)
    finally:
        worker.close()
        _discard(bench.blobs, prepared)
    shape = {str(rows): factor for rows, factor in sorted(clock.shape.items())}
    measured = worker.step_ratios
    per_count = {str(rows): statistics.median(measured[rows]) for rows in sorted(measured)}
    reference = speed_gauge.reference(measured)
    return Calibration(statistics.median(alone), capacity, clock.scale, shape, reference, per_count)


def serve_trace(bench: _Bench, arm: str, trace: list, services: list, prepared: list) -> dict:
    """One arm on one trace: a fresh worker, every job at its arrival; ``measure``'s statistics
    plus the worker's step figures."""
    cal = bench.calibration
    worker, clock = bench.worker(arm, bench.targets_s["max_wait"], arm)
    clock.scale = cal.clock_scale
    clock.shape = {int(rows): factor for rows, factor in cal.clock_shape.items()}
    load_avg = os.getloadavg()[0]
    start = time.time() + 0.05
    jobs, index = [], {}
    for request, job in zip(trace, prepared):
        service = services[request.index]
        job_id = f"{arm}-{job.job_id}"
        index[job_id] = request.index
        level = ServiceLevel(service.service_class, start + service.deadline)
        at = start + request.arrival_s
        jobs.append((at, replace(job, job_id=job_id, service=level, submitted_at=at)))
    try:
        done = worker.serve(jobs, bench.cfg.drain_timeout_s)
    finally:
        worker.close()
    stats = worker.worker.stats
    outcome = Outcome(
        done_at={index[j]: at - start for j, at in done.items()},
        finished={index[j]: worker.rows[j] for j in done},
        parks=stats.parks,
        resumes=stats.resumes,
    )
    row = measure(bench.workload, outcome, trace, services)
    row.pop("decision_p50_ms")  # no routing decisions here
    sizes = {index[j]: worker.batch_sizes.get(j, []) for j in done}
    row["rows_per_step"] = rows_per_step(sizes, outcome.done_at, services)
    row["slowdown"] = speed_gauge.run_slowdown(cal.step_ratio, worker.step_ratios)
    classes = {j: services[index[j]].service_class for j in done}
    told = told_forecasts(worker.sink.events)
    row["forecast"] = forecast_errors(told, done, classes)
    snapshot = stats.snapshot()
    return row | {
        "makespan_s": max(done.values()) - start,
        "mean_step_ms": snapshot["mean_step_s"] * 1e3,
        # of which scheduling and planning (not the forward, not per-job work)
        "mean_overhead_ms": snapshot["mean_overhead_s"] * 1e3,
        # of which per-job work: admitting, parking, retiring rows and forecasting
        "mean_job_work_ms": snapshot["mean_job_work_s"] * 1e3,
        "mean_batch_rows": snapshot["mean_batch_rows"],
        # schedules at which a row was kept out of a free slot for a tighter one, per job
        "deferrals_per_job": snapshot["deferred_row_schedules_total"] / max(1, len(trace)),
        "clock_scale_end": clock.scale,
        "clock_shape_end": {str(rows): f for rows, f in sorted(clock.shape.items())},
        # the step time the plan took over the prediction (``StepClock.margin``), over the steps
        "mean_margin": float(np.mean(worker.margins)) if worker.margins else 1.0,
        "load_avg_1m": load_avg,  # this machine's load when the run began (other work shows)
    }


def rows_per_step(
    sizes: dict[int, list[int]], done_at: dict[int, float], services: list
) -> dict[str, dict[str, float]]:
    """Per class, the mean batch size of the steps its jobs ran, over the jobs that met their
    deadline and over those that missed it (0 where there is none): what a late job ran beside."""
    out: dict[str, dict[str, list[float]]] = {}
    for index, steps in sizes.items():
        service = services[index]
        met = done_at[index] <= service.deadline + 1e-9
        cls = out.setdefault(service.service_class, {"met": [], "missed": []})
        cls["met" if met else "missed"].append(statistics.fmean(steps) if steps else 0.0)
    return {
        cls: {k: statistics.fmean(v) if v else 0.0 for k, v in parts.items()}
        for cls, parts in sorted(out.items())
    }


def run_worker_deadline_bench(
    cfg: WorkerDeadlineConfig, settings: Settings, progress=print
) -> dict:
    """Calibration, then every arm on the identical traces per (process, load): a JSON-ready report
    ``{"config", "device", "calibration", "targets_s", "capacity_rps", "results", "comparison",
    "targets"}``."""
    from backend.bench.soak import machine
    from backend.tasks.core import CpuStages

    engine = build_engine(settings, cfg.model_id)  # a model built here uses every core
    torch.set_num_threads(cfg.torch_threads)
    blobs = open_blob_store(settings)
    bench = _Bench(cfg, settings, engine, blobs, CpuStages(settings, engine, blobs=blobs))
    bench.calibration = cal = calibrate(bench)
    bench.targets_s = targets_s = cfg.targets_s(cal.service_s)
    bench.workload = workload = cfg.workload(targets_s)
    progress(
        f"single job {cal.service_s * 1e3:.0f} ms, capacity {cal.capacity_rps:.2f} req/s; "
        f"targets: interactive {targets_s['interactive']:.2f} s, batch "
        f"{targets_s['batch']:.1f} s, starvation bound {targets_s['max_wait']:.1f} s"
    )
    results = []
    for kind in cfg.traces:
        for load in cfg.loads:
            rps = load * cal.capacity_rps
            trace = deadline_trace(workload, kind, rps, cfg.seed)
            services = services_of(workload, trace)
            trace = served(cfg.serve_classes, trace, services)
            prepared = bench.prepare(trace, f"{kind}-{load:g}")
            arrivals = np.array([r.arrival_s for r in trace])
            peak = np.histogram(arrivals, bins=np.arange(0.0, cfg.duration_s + 1.0))[0].max()
            try:
                for repeat in range(cfg.repeats):
                    for arm in rotated(cfg.schedulers, repeat):
                        row = {"trace": kind, "load": load, "scheduler": arm, "rps": rps}
                        row |= {"offered_rps": len(trace) / cfg.duration_s, "num_jobs": len(trace)}
                        row |= {"peak_1s_arrivals": int(peak), "repeat": repeat}
                        run = _run_arm(bench, arm, (trace, services, prepared), progress)
                        results.append(row | run)
                        progress(_line(results[-1]))
            finally:
                _discard(blobs, prepared)
    report = {
        "config": asdict(cfg),
        "device": f"{machine()}; the worker on {settings.engine.device}, "
        f"{cfg.torch_threads} torch thread{'s' if cfg.torch_threads > 1 else ''}",
        "calibration": asdict(cal),
        "targets_s": targets_s,
        "capacity_rps": cal.capacity_rps,
        "results": results,
    }
    report["comparison"] = comparison(report)
    report["comparison_mean"] = mean_comparison(report["comparison"])
    # the targets on the figures averaged over repeats; and on the worst single repeat
    mean_report = {"comparison": report["comparison_mean"], "results": results}
    report["targets"] = targets(mean_report, targets_s["max_wait"], cfg.serve_classes)
    report["targets_worst_repeat"] = targets(report, targets_s["max_wait"], cfg.serve_classes)
    report["speed_adjusted"] = speed_adjusted(report)
    return report


def _run_arm(bench: _Bench, arm: str, workload: tuple, progress) -> dict:
    """One arm on one trace (``serve_trace``), run again while the machine ran out of the speed
    band (``speed_gauge.in_band_run``)."""

    def again(slowdown: float) -> None:
        progress(f"{arm}: the machine ran x{slowdown:.2f} its calibrated step time; again")

    run = partial(serve_trace, bench, arm, *workload)
    return speed_gauge.in_band_run(run, bench.cfg.speed_band, bench.cfg.retries, again)


def rotated(arms: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """``arms`` in the order of run ``repeat``: rotated left by ``repeat``, so that over repeats
    each arm runs early and late in a cell (the machine's speed drifts over minutes) and each
    arm's run against fifo's is paired within one repeat."""
    k = repeat % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def _line(r: dict) -> str:
    c = r["classes"]
    return (
        f"{r['trace']} load {r['load']:g} ({r['rps']:.2f} req/s, {r['num_jobs']} jobs) "
        f"repeat {r['repeat']} "
        f"{r['scheduler']}: attainment interactive {shown_attainment(c['interactive'], '.1%')} "
        f"batch {shown_attainment(c['batch'], '.1%')}, "
        f"P95 {c['interactive']['p95_latency_s']:.2f} / "
        f"{c['batch']['p95_latency_s']:.2f} s, parks/job {r['parks_per_job']:.3f}, "
        f"longest batch wait {r['max_batch_wait_s']:.2f} s, machine x{r['slowdown']:.2f}; "
        f"interactive jobs ran beside "
        f"{r['rows_per_step'].get('interactive', {}).get('met', 0.0):.1f} rows (met) / "
        f"{r['rows_per_step'].get('interactive', {}).get('missed', 0.0):.1f} (missed)"
    )

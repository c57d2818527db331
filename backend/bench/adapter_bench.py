"""`maskserve bench adapters`: serving LoRA adapters three ways on the same traces, side by side.

Arms (every one a real worker of this repository in this process, fed the same requests):

* ``baseline`` -- what a user would write: one request at a time through the ordinary diffusers
  pipeline, loading the request's adapter files with ``load_lora_weights``, fusing them before the
  call and unfusing/unloading after (``BaselineWorker`` with ``max_batch`` 1 and adapter files);
* ``one-set`` -- what open servers do: MaskServe's engine worker (continuous batching, template
  caches) whose batches hold one adapter set each, adapters loaded before a row's first step
  while the loop waits (no prefetch, join deadline 0), from the same tiers and budgets;
* ``maskserve`` -- tiers with prefetch when a job is queued, asynchronous loading, late joining
  (join deadline ``join_by`` of the steps) and mixed-adapter batches;
* ``base-model`` -- ``maskserve`` on the same trace with every request's adapters removed: the
  throughput mixed-adapter batches are held against;
* ``join-if-pays`` -- ``maskserve`` with rows joining the running batch only when that lowers
  the rows' mean latency (``worker.join_when_it_pays`` on, whatever the settings say).

Requests: Poisson and bursty (MMPP) arrivals, Zipf templates and Zipf adapters over the catalogue
(``adapter_catalog``), 0-3 adapters per request, Beta mask ratios, own seeds. Pre-processing runs
on its own thread (the CPU workers' role), post-processing on the worker's thread as results land.
Latency is arrival -> result stored. All arms share one engine and one torch thread pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from backend.adapters.store import AdapterStore
from backend.bench.adapter_catalog import CatalogAdapter, build_catalog
from backend.bench.trace import TraceRequest, mmpp_trace, poisson_trace, zipf_weights
from backend.bench.worker_bench import BenchInputs, edit_job, prepare_inputs
from backend.blobs import BlobStore
from backend.cache import TieredActivationCache
from backend.config import Settings
from backend.engine.factory import CPU_STAGES, build_engine
from backend.protocol import AdapterUse, EditJob
from backend.tasks.core import CpuStages
from backend.worker.adapter_book import AdapterBook
from backend.worker.adapter_tiers import AdapterTiers, RowAdapters, store_loader
from backend.worker.baseline import BaselineWorker
from backend.worker.baseline_adapters import ADAPTER_PHASES
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker, _Job
from backend.worker.stats import percentile

ARMS = ("baseline", "one-set", "maskserve", "base-model", "join-if-pays")
DEFAULT_ARMS = ARMS[:-1]  # join-if-pays only when asked for
# adapters per request: 0..3 (Katz: over 95% of requests carry at least one, usually one or two)
ADAPTER_COUNT_SHARES = (0.05, 0.5, 0.35, 0.1)


@dataclass
class AdapterBenchConfig:
    model_id: str = "small-sd2-inpaint"
    size: int = 128
    steps: int = 20
    num_adapters: int = 200
    adapter_zipf: float = 1.0
    num_templates: int = 8
    mask_mean: float = 0.11
    max_batch: int = 8
    rps: tuple[float, ...] = (0.1, 0.2)
    burst_rps: float = 0.1  # the bursty trace's base rate (0: none)
    duration_s: float = 120.0
    max_requests: int = 60
    device_mb: int = 128
    host_mb: int = 512
    join_by: float = 0.2
    seed: int = 0
    arms: tuple[str, ...] = DEFAULT_ARMS
    # Poisson rates as fractions of the baseline's capacity, measured first (replaces ``rps``)
    loads: tuple[float, ...] = ()
    calibration_requests: int = 6  # served at once by the baseline to measure its capacity


@dataclass
class ArmResult:
    arm: str
    trace: str
    rps: float
    num_jobs: int
    avg_latency_s: float
    p95_latency_s: float
    throughput_rps: float
    mean_batch_rows: float
    failed: int = 0  # jobs that ended without a result (the log says why)
    rows_with_adapters: int = 0
    rows_blocked: int = 0
    hits: dict = field(default_factory=dict)
    disk_loads: int = 0
    device_loads: int = 0
    join_steps: dict = field(default_factory=dict)  # step -> rows that took an adapter then
    # baseline: mean seconds per request with adapters spent loading, fusing, unfusing them and
    # denoising (the pipeline call alone)
    phases: dict = field(default_factory=dict)
    # every arm: where a request's latency went, mean seconds (``latency_split``)
    split: dict = field(default_factory=dict)
    cached_share: float = 0.0  # finished rows that denoised reading their template's cache
    mean_step_s: float = 0.0  # the worker's mean step (forward pass of the batch)
    # the worker's mean step per batch size ("rows": seconds; JSON keys are strings)
    step_s_by_rows: dict[str, float] = field(default_factory=dict)


def request_adapters(
    trace: list[TraceRequest], catalog: list[CatalogAdapter], zipf: float, seed: int
) -> dict[int, list[AdapterUse]]:
    """Request index -> its adapters (0-3, Zipf over the catalogue, distinct, scales 0.6-1)."""
    rng = np.random.default_rng(seed + 17)
    weights = zipf_weights(len(catalog), zipf)
    uses = {}
    for request in trace:
        count = int(rng.choice(len(ADAPTER_COUNT_SHARES), p=ADAPTER_COUNT_SHARES))
        picked = rng.choice(len(catalog), size=count, replace=False, p=weights)
        uses[request.index] = [
            AdapterUse(
                catalog[i].adapter_id,
                catalog[i].sha256,
                round(float(rng.uniform(0.6, 1.0)), 3),
                catalog[i].nbytes,
            )
            for i in picked
        ]
    return uses


class OneSetWorker(EngineWorker):
    """The engine worker with one adapter set per forward (rows of other sets step apart)."""

    def _group_key(self, job: _Job) -> str:
        adapters = ",".join(sorted(f"{u.sha256}*{u.scale}" for u in job.message.adapters))
        return f"{super()._group_key(job)}:{adapters}"


def baseline_phases(denoised_jobs) -> dict[str, float]:
    """Mean seconds per baseline request with adapters: each adapter phase, and the pipeline call
    without them (``denoise_s`` covers the whole ``fused_adapters`` block)."""
    with_adapters = [d.timings for d in denoised_jobs if ADAPTER_PHASES[0] in d.timings]
    if not with_adapters:
        return {}
    means = {k: float(np.mean([t.get(k, 0.0) for t in with_adapters])) for k in ADAPTER_PHASES}
    denoise = float(np.mean([t["denoise_s"] for t in with_adapters]))
    return {**means, "pipeline_s": denoise - sum(means.values()), "requests": len(with_adapters)}


def latency_split(
    arrival: dict[str, float],
    queued: dict[str, float],
    denoised: dict[str, float],
    done: dict[str, float],
    worker_timings: dict[str, dict[str, float]],
) -> dict[str, float]:
    """Mean seconds per finished request, by stage (they sum to its latency): ``preprocess_s``,
    arrival to the worker's inbox (pre-processing runs on the arrivals' one thread, so a request
    also waits there for the ones before it); in the worker (``worker_timings``, the worker's
    own ``wait_s`` and ``denoise_s`` per job): ``queue_s``, received to admitted (waiting for a
    slot), ``admit_s``, the rest until its first step (the inbox, taking the template's cache,
    starting its state and adapters), ``denoise_s``, first step to final latents handed on; then
    ``postprocess_s``, decoding and writing the result (on the worker loop's thread: a batch does
    not step meanwhile)."""
    finished = [j for j in done if j in denoised and j in queued and j in worker_timings]
    if not finished:
        return {}
    in_worker = {j: denoised[j] - queued[j] for j in finished}
    wait = {j: worker_timings[j].get("wait_s", 0.0) for j in finished}
    steps = {j: worker_timings[j].get("denoise_s", 0.0) for j in finished}
    stages = {
        "preprocess_s": [queued[j] - arrival[j] for j in finished],
        "queue_s": [wait[j] for j in finished],
        "admit_s": [in_worker[j] - wait[j] - steps[j] for j in finished],
        "denoise_s": [steps[j] for j in finished],
        "postprocess_s": [done[j] - denoised[j] for j in finished],
    }
    return {stage: float(np.mean(seconds)) for stage, seconds in stages.items()}


class _Sink(LocalSink):
    """A local sink that also keeps the ids of jobs that ended without a result."""

    def __init__(self, on_denoised):
        super().__init__(on_denoised=on_denoised)
        self.failed: set[str] = set()

    def event(self, event) -> None:
        super().event(event)
        if event.status in ("failed", "cancelled"):
            self.failed.add(event.job_id)


class _Arm:
    """One arm on one trace: arrivals (pre-processed on their own thread), the worker loop,
    completion times."""

    def __init__(self, bench: _Bench, arm: str, trace_name: str, rps: float):
        self.bench, self.arm, self.label = bench, arm, f"{arm}-{trace_name}-{rps:.4g}"
        self.trace_name, self.rps = trace_name, rps
        cfg = bench.cfg
        self.arrival: dict[str, float] = {}
        self.queued: dict[str, float] = {}  # pre-processed, in the worker's inbox
        self.denoised: dict[str, float] = {}  # final latents handed on by the worker
        self.done: dict[str, float] = {}
        self.lock = threading.Lock()
        self.inbox = LocalInbox()
        self.sink = _Sink(self._post)
        self.rows: RowAdapters | None = None
        common = dict(worker_id=f"bench-{arm}", max_batch=cfg.max_batch)
        if arm == "baseline":
            self.stages = bench.baseline_stages
            self.worker: EngineWorker = BaselineWorker(
                bench.engine,
                bench.blobs,
                self.inbox,
                self.sink,
                adapter_files=bench.source_of,
                **{**common, "max_batch": 1},
            )
            return
        self.stages = bench.stages
        book = AdapterBook(cfg.device_mb << 20, cfg.host_mb << 20)
        tiers = AdapterTiers(bench.engine.adapters, book, bench.loader)
        one_set = arm == "one-set"
        self.rows = RowAdapters(tiers, 0.0 if one_set else cfg.join_by, prefetch=not one_set)
        self.caches = TieredActivationCache(bench.engine.cache_root, 1 << 34, 1 << 40)
        worker_class = OneSetWorker if one_set else EngineWorker
        # the serving worker's step clock (``worker.service``; imports redis)
        from backend.worker.service import step_clock

        clock = step_clock(bench.settings)
        self.worker = worker_class(
            bench.engine,
            bench.blobs,
            self.inbox,
            self.sink,
            caches=self.caches,
            adapters=self.rows,
            clock=clock,
            join_rule=clock.join_rule(
                arm == "join-if-pays" or bench.settings.worker.join_when_it_pays
            ),
            **common,
        )

    def _post(self, denoised) -> None:
        handed_on = time.time()
        self.stages.postprocess(denoised)
        with self.lock:
            self.denoised[denoised.job_id] = handed_on
            self.done[denoised.job_id] = time.time()

    def _arrive(self, trace: list[TraceRequest], jobs: dict[int, EditJob], start: float) -> None:
        for request in trace:
            time.sleep(max(0.0, start + request.arrival_s - time.time()))
            job = replace(jobs[request.index], job_id=f"{self.label}-{request.index}")
            with self.lock:
                self.arrival[job.job_id] = time.time()
            prepared = self.stages.preprocess(replace(job, submitted_at=time.time()))
            with self.lock:
                self.queued[job.job_id] = time.time()
            self.inbox.put(prepared)

    def run(self, trace: list[TraceRequest], jobs: dict[int, EditJob]) -> ArmResult:
        for sha in self.bench.engine.adapters.ids():  # every arm starts with nothing resident
            self.bench.engine.adapters.drop(sha)
        start = time.time()
        arrivals = threading.Thread(target=self._arrive, args=(trace, jobs, start), daemon=True)
        arrivals.start()
        with tqdm(total=len(trace), desc=f"{self.label:28s}", leave=False) as bar:
            while len(self.done) + len(self.sink.failed) < len(trace):
                self.worker.iterate(idle_poll_s=0.002)
                bar.update(len(self.done) - bar.n)
        arrivals.join()
        if self.rows is not None:
            self.rows.tiers.close()
            self.caches.close()
        return self._result(len(trace))

    def _result(self, count: int) -> ArmResult:
        latencies = [self.done[j] - self.arrival[j] for j in self.done]
        if not latencies:
            raise RuntimeError(f"every job of {self.label} failed: the log says why")
        span = max(self.done.values()) - min(self.arrival.values())
        stats = self.worker.stats.snapshot()
        result = ArmResult(
            arm=self.arm,
            trace=self.trace_name,
            rps=self.rps,
            num_jobs=count,
            avg_latency_s=float(np.mean(latencies)),
            p95_latency_s=percentile(latencies, 95),
            throughput_rps=len(latencies) / span,
            mean_batch_rows=stats["mean_batch_rows"],
            failed=len(self.sink.failed),
            mean_step_s=stats["mean_step_s"],
            step_s_by_rows={
                str(rows): seconds
                for rows, seconds in self.worker.stats.mean_step_s_by_rows().items()
            },
        )
        finished = self.sink.denoised_jobs
        if finished:
            result.cached_share = sum(d.used_cache for d in finished) / len(finished)
        timings = {d.job_id: d.timings for d in self.sink.denoised_jobs}
        result.split = latency_split(self.arrival, self.queued, self.denoised, self.done, timings)
        if self.arm == "baseline":
            result.phases = baseline_phases(self.sink.denoised_jobs)
        if self.rows is not None:
            snapshot = self.rows.tiers.snapshot()
            result.rows_with_adapters = snapshot["rows_with_adapters"]
            result.rows_blocked = snapshot["rows_blocked"]
            result.hits = snapshot["hits"]
            result.disk_loads = snapshot["disk_loads"]
            result.device_loads = snapshot["device_loads"]
            steps: dict[int, int] = {}
            for denoised in self.sink.denoised_jobs:
                for step in denoised.adapter_steps.values():
                    steps[step] = steps.get(step, 0) + 1
            result.join_steps = dict(sorted(steps.items()))
        return result


class _Bench:
    """What every arm shares: the engine, stores, catalogue, template caches, stages."""

    def __init__(self, cfg: AdapterBenchConfig, settings: Settings, work: Path):
        self.cfg = cfg
        engine_settings = settings.engine.model_copy(update={"model_id": cfg.model_id})
        self.settings = settings.model_copy(update={"engine": engine_settings})
        self.engine = build_engine(settings, cfg.model_id)
        # pre/post-processing hold their own copy of the text encoders and VAE (as CPU workers
        # do): they run beside the worker loop and must share no pipeline state with it
        stages_engine = build_engine(settings, cfg.model_id, role=CPU_STAGES)
        self.blobs = BlobStore(work / "blobs")
        store = AdapterStore(work / "adapters")
        self.catalog = build_catalog(
            cfg.model_id, work / "adapter-files", store, cfg.num_adapters, seed=cfg.seed
        )
        self.sources = {entry.sha256: entry.source for entry in self.catalog}
        self.loader = store_loader(store.content_of)
        self.stages = CpuStages(settings, stages_engine)
        baseline = settings.worker.model_copy(update={"batching": "baseline"})
        self.baseline_stages = CpuStages(
            settings.model_copy(update={"worker": baseline}), stages_engine
        )

    def source_of(self, sha: str) -> Path:
        return self.sources[sha]


def _traces(cfg: AdapterBenchConfig) -> list[tuple[str, float, list[TraceRequest]]]:
    made = [
        (
            "poisson",
            rps,
            poisson_trace(rps, cfg.duration_s, cfg.num_templates, cfg.mask_mean, seed=cfg.seed),
        )
        for rps in cfg.rps
    ]
    if cfg.burst_rps:
        bursty = mmpp_trace(
            cfg.burst_rps, cfg.duration_s, cfg.num_templates, cfg.mask_mean, seed=cfg.seed
        )
        made.append(("bursty", cfg.burst_rps, bursty))
    for name, rps, trace in made:
        if not trace:
            raise ValueError(
                f"the {name} trace at {rps:.4g} requests/s has no request in {cfg.duration_s:g} "
                "s: raise --duration-s (or the rate)"
            )
    return [(name, rps, trace[: cfg.max_requests]) for name, rps, trace in made]


def run_adapter_bench(
    cfg: AdapterBenchConfig,
    settings: Settings,
    work: Path,
    on_result: Callable[[list[ArmResult]], None] | None = None,
) -> dict:
    """Every arm on every trace; returns the config, the catalogue's facts and the results.
    ``on_result`` is called with the results so far after each run (a long run that is stopped
    keeps what it measured)."""
    torch.set_num_threads(2)
    # given rates: a trace without requests fails before the model is built
    traces = None if cfg.loads else _traces(cfg)
    bench = _Bench(cfg, settings, work)
    capacity = None
    if cfg.loads:
        capacity = baseline_capacity(bench, settings)
        cfg = replace(cfg, rps=tuple(load * capacity for load in cfg.loads))
        tqdm.write(f"baseline capacity {capacity:.4f} requests/s: rates {cfg.rps}")
        traces = _traces(cfg)
    results = []
    for name, rps, trace in traces or []:
        inputs = prepare_inputs(cfg, settings, bench.engine, trace, bench.blobs)
        uses = request_adapters(trace, bench.catalog, cfg.adapter_zipf, cfg.seed)
        jobs = _jobs(cfg, trace, inputs, bench, uses)
        for arm in cfg.arms:
            arm_jobs = jobs
            if arm == "base-model":
                arm_jobs = {i: replace(job, adapters=[]) for i, job in jobs.items()}
            results.append(_Arm(bench, arm, name, rps).run(trace, arm_jobs))
            if on_result is not None:
                on_result(results)
    ranks = [entry.rank for entry in bench.catalog]
    return {
        "baseline_capacity_rps": capacity,
        "rps": list(cfg.rps),
        "catalog": {
            "adapters": len(bench.catalog),
            "ranks": {str(r): ranks.count(r) for r in sorted(set(ranks))},
            "mean_mb": float(np.mean([e.nbytes for e in bench.catalog]) / 2**20),
        },
        "results": results,
    }


def baseline_capacity(bench: _Bench, settings: Settings) -> float:
    """The baseline's capacity in requests/s: ``calibration_requests`` requests (adapters drawn as
    in the traces) arriving at once, served one at a time after a warm-up request; requests over
    the time from their arrival to the last result. "The baseline's saturation" is this rate."""
    cfg = bench.cfg
    count = cfg.calibration_requests
    # a dense Poisson draw (about 100 x count requests) gives the templates, masks and seeds of
    # the first count + 1; every arrival is moved to 0
    drawn = poisson_trace(100.0, float(count), cfg.num_templates, cfg.mask_mean, seed=cfg.seed + 1)
    trace = [replace(r, arrival_s=0.0) for r in drawn[: count + 1]]
    inputs = prepare_inputs(cfg, settings, bench.engine, trace, bench.blobs)
    uses = request_adapters(trace, bench.catalog, cfg.adapter_zipf, cfg.seed + 1)
    jobs = _jobs(cfg, trace, inputs, bench, uses)
    _Arm(bench, "baseline", "warmup", 0.0).run(trace[:1], jobs)
    return _Arm(bench, "baseline", "calibration", 0.0).run(trace[1:], jobs).throughput_rps


def _jobs(
    cfg: AdapterBenchConfig,
    trace: list[TraceRequest],
    inputs: BenchInputs,
    bench: _Bench,
    uses: dict[int, list[AdapterUse]],
) -> dict[int, EditJob]:
    guidance = bench.engine.spec.default_guidance
    return {
        r.index: replace(edit_job(cfg, r, inputs, "adapters", guidance), adapters=uses[r.index])
        for r in trace
    }

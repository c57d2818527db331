"""`maskserve bench worker`: one engine worker under a Poisson trace, batching modes side by side.

Every mode replays the same trace (arrival times, Zipf template choice, Beta mask ratios, seeds)
against a fresh worker whose RAM cache tier starts cold and holds fewer templates than the trace
uses, so the working set spills to disk. Pre/post-processing run in a separate CPU process (the
role Celery workers play in the service) except in ``inline`` mode, where the worker loop runs them
itself. The worker and the CPU process get one torch thread each (two cores here), so ``inline``
differs from ``continuous`` only by where pre/post-processing run.

Latency = arrival -> result stored. Reported per mode: average, P50, P95 latency, throughput,
queueing time (arrival -> admitted, minus pre-processing), time per step, batching overhead per
step (loop time minus the denoiser's forward), cache hit rates per tier, plus a PNG plot.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from backend import protocol
from backend.bench.trace import TraceRequest, poisson_trace
from backend.blobs import BlobStore
from backend.blobs.factory import open_blob_store
from backend.cache import TieredActivationCache
from backend.config import Settings
from backend.engine.factory import CPU_STAGES, build_engine, edit_params
from backend.imaging.masks import synthetic_mask
from backend.protocol import EditJob
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from backend.worker.stats import percentile
from templates_store.samples import sample_template

PROMPT = "a red leather armchair"


@dataclass
class BenchConfig:
    model_id: str = "tiny-sd2-inpaint"
    modes: tuple[str, ...] = ("continuous", "static", "inline")
    rps: float = 2.0
    duration_s: float = 30.0
    num_templates: int = 24
    # RAM tier budget, in templates (fewer than the trace uses: spills to disk)
    ram_templates: int = 6
    mask_mean: float = 0.11
    steps: int = 20
    size: int = 256
    max_batch: int = 8
    seed: int = 0
    burst_factor: float = 1.0


@dataclass
class ModeResult:
    mode: str
    label: str
    num_jobs: int
    avg_latency_s: float
    p50_latency_s: float
    p95_latency_s: float
    throughput_rps: float
    avg_queue_s: float
    avg_pre_s: float
    avg_post_s: float
    mean_step_s: float
    mean_overhead_ms: float
    mean_job_work_ms: float
    p50_overhead_ms: float
    mean_batch_rows: float
    cache: dict = field(default_factory=dict)


# ----- CPU process (pre/post-processing), the role of a Celery worker -----------------------------
_STAGES = None


def _init_cpu_process(settings_json: str, model_id: str) -> None:
    global _STAGES
    torch.set_num_threads(1)
    from backend.tasks.core import CpuStages

    settings = Settings.model_validate_json(settings_json)
    # what a Celery child holds: the text encoders and VAE, no denoiser
    _STAGES = CpuStages(settings, build_engine(settings, model_id, device="cpu", role=CPU_STAGES))


def _pre_in_process(job_json: str) -> str:
    return protocol.encode(_STAGES.preprocess(protocol.decode(job_json)))


def _post_in_process(denoised_json: str) -> tuple[float, float]:
    """(finish time, seconds spent) of one post-processing."""
    started = time.time()
    _STAGES.postprocess(protocol.decode(denoised_json))
    return time.time(), time.time() - started


# ----- set-up -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchInputs:
    """What every mode replays: blob refs of the templates and of each request's mask, and the mean
    size of the templates' cache entries (the RAM budget is counted in them)."""

    template_refs: list[str]
    mask_refs: dict[int, str]  # request index -> its mask (a trace may skip indices)
    mean_entry_bytes: float


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def prepare_inputs(
    cfg: BenchConfig, settings: Settings, engine, trace: list[TraceRequest], blobs: BlobStore
) -> BenchInputs:
    """Template and mask files for the trace, and every template's cache recorded on disk (not
    timed)."""
    params = edit_params(engine.spec, settings, steps=cfg.steps, size=cfg.size)
    template_refs, entry_bytes = [], []
    for index in tqdm(range(cfg.num_templates), desc="recording template caches"):
        image = sample_template(cfg.size, cfg.size, seed=1000 + index)
        template_refs.append(blobs.put("templates", f"bench-{index}.png", _png(image)))
        entry_bytes.append(
            (engine.lookup(image, params) or engine.prepare_template(image, params)).bytes_total
        )
    from PIL import Image

    mask_refs = {
        r.index: blobs.put(
            "masks",
            f"bench-{r.index}.png",
            _png(
                Image.fromarray(
                    synthetic_mask(cfg.size, cfg.size, r.mask_ratio, seed=r.seed).astype(np.uint8)
                    * 255
                )
            ),
        )
        for r in trace
    }
    # The RAM budget is counted in the trace's own entries (the cache directory may hold entries of
    # other models and resolutions, which must not inflate it).
    return BenchInputs(template_refs, mask_refs, sum(entry_bytes) / len(entry_bytes))


def template_caches(
    engine, settings: Settings, inputs: BenchInputs, ram_templates: int
) -> TieredActivationCache:
    """A fresh tiered cache (cold RAM tier) holding ``ram_templates`` of the trace's entries in
    RAM; the disk tier holds every recorded entry."""
    # slack over the mean entry (every file, trajectory included)
    entry_bytes = inputs.mean_entry_bytes * 1.05
    return TieredActivationCache(
        engine.cache_root, int(ram_templates * entry_bytes), 1 << 40, policy=settings.cache.policy
    )


def edit_job(
    cfg: BenchConfig, request: TraceRequest, inputs: BenchInputs, mode: str, guidance: float
) -> EditJob:
    return EditJob(
        job_id=f"{mode}-{request.index}",
        model_id=cfg.model_id,
        template_ref=inputs.template_refs[request.template],
        mask_ref=inputs.mask_refs[request.index],
        prompt=PROMPT,
        seed=request.seed,
        steps=cfg.steps,
        guidance=guidance,
        resolution=cfg.size,
        submitted_at=time.time(),
    )


# ----- one mode -----------------------------------------------------------------------------------
class _Run:
    """Drives one worker through the trace; records arrival and completion times per job."""

    def __init__(
        self, cfg, settings, engine, blobs, mode, ram_templates, inputs: BenchInputs, pool
    ):
        self.cfg, self.mode, self.pool, self.inputs = cfg, mode, pool, inputs
        self.arrival: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.post_s: list[float] = []
        self.lock = threading.Lock()
        self.inbox = LocalInbox()
        self.sink = LocalSink(on_denoised=None if mode == "inline" else self._post)
        self.caches = template_caches(engine, settings, inputs, ram_templates)
        stages = None
        if mode == "inline":
            from backend.tasks.core import CpuStages

            stages = _TimedStages(CpuStages(settings, engine), self)
        self.worker = EngineWorker(
            engine,
            blobs,
            self.inbox,
            self.sink,
            worker_id=f"bench-{mode}",
            mode=mode,
            max_batch=cfg.max_batch,
            caches=self.caches,
            stages=stages,
        )

    def _post(self, denoised) -> None:
        future = self.pool.submit(_post_in_process, protocol.encode(denoised))
        future.add_done_callback(lambda f, job_id=denoised.job_id: self._finished(job_id, f))

    def _finished(
        self, job_id: str, future: Future | None = None, at: float = 0.0, post_s: float = 0.0
    ) -> None:
        if future is not None:
            at, post_s = future.result()
        with self.lock:
            self.done[job_id] = at
            self.post_s.append(post_s)

    def _arrive(self, trace: list[TraceRequest], start: float) -> None:
        guidance = self.worker.engine.spec.default_guidance
        for request in trace:
            time.sleep(max(0.0, start + request.arrival_s - time.time()))
            job = edit_job(self.cfg, request, self.inputs, self.mode, guidance)
            with self.lock:
                self.arrival[job.job_id] = time.time()
            if self.mode == "inline":
                self.inbox.put(job)
            else:
                future = self.pool.submit(_pre_in_process, protocol.encode(job))
                future.add_done_callback(lambda f: self.inbox.put(protocol.decode(f.result())))

    def run(self, trace: list[TraceRequest]) -> dict:
        start = time.time()
        arrivals = threading.Thread(target=self._arrive, args=(trace, start), daemon=True)
        arrivals.start()
        with tqdm(total=len(trace), desc=f"{self.mode:10s}", leave=False) as bar:
            while len(self.done) < len(trace):
                self.worker.iterate(idle_poll_s=0.002)
                if bar.n != len(self.done):
                    bar.update(len(self.done) - bar.n)
        arrivals.join()
        return self._summary()

    def _summary(self) -> dict:
        jobs = {e.job_id: e for e in self.sink.denoised_jobs}
        latencies = [self.done[j] - self.arrival[j] for j in self.done]
        timings = [j.timings for j in jobs.values()]
        stats = self.worker.stats.snapshot()
        span = max(self.done.values()) - min(self.arrival.values())
        mean = lambda key: float(np.mean([t.get(key, 0.0) for t in timings])) if timings else 0.0  # noqa: E731
        return dict(
            num_jobs=len(latencies),
            avg_latency_s=float(np.mean(latencies)),
            p50_latency_s=percentile(latencies, 50),
            p95_latency_s=percentile(latencies, 95),
            throughput_rps=len(latencies) / span,
            avg_queue_s=mean("queue_s") + mean("wait_s"),
            avg_pre_s=mean("pre_s"),
            avg_post_s=float(np.mean(self.post_s)) if self.post_s else 0.0,
            mean_step_s=stats["mean_step_s"],
            mean_overhead_ms=stats["mean_overhead_s"] * 1e3,
            mean_job_work_ms=stats["mean_job_work_s"] * 1e3,
            p50_overhead_ms=stats["p50_overhead_s"] * 1e3,
            mean_batch_rows=stats["mean_batch_rows"],
            cache=self.caches.metrics.snapshot(),
        )


class _TimedStages:
    """Inline mode: the worker loop runs pre/post itself; completion is when post returns."""

    def __init__(self, stages, run: _Run):
        self.stages, self.run = stages, run

    def preprocess(self, job):
        return self.stages.preprocess(job)

    def postprocess(self, denoised) -> None:
        started = time.time()
        self.stages.postprocess(denoised)
        self.run._finished(denoised.job_id, at=time.time(), post_s=time.time() - started)


def run_worker_bench(cfg: BenchConfig, settings: Settings) -> list[ModeResult]:
    torch.set_num_threads(1)
    engine = build_engine(settings, cfg.model_id)
    blobs = open_blob_store(settings)
    trace = poisson_trace(
        cfg.rps,
        cfg.duration_s,
        cfg.num_templates,
        cfg.mask_mean,
        seed=cfg.seed,
        burst_factor=cfg.burst_factor,
    )
    inputs = prepare_inputs(cfg, settings, engine, trace, blobs)
    context = multiprocessing.get_context("spawn")  # never fork a process that holds torch threads
    results = []
    with ProcessPoolExecutor(
        1,
        mp_context=context,
        initializer=_init_cpu_process,
        initargs=(settings.model_dump_json(), cfg.model_id),
    ) as pool:
        pool.submit(time.time).result()  # start the CPU process (loads its model) before timing
        runs = [(mode, mode, cfg.ram_templates) for mode in cfg.modes]
        if "continuous" in cfg.modes:
            runs.append(("continuous", "continuous, all templates in RAM", cfg.num_templates))
        for mode, label, ram_templates in runs:
            run = _Run(cfg, settings, engine, blobs, mode, ram_templates, inputs, pool)
            try:
                summary = run.run(trace)
            finally:
                # its prefetch threads and RAM tier must not weigh on the next mode
                run.caches.close()
            results.append(ModeResult(mode=mode, label=label, **summary))
    return results


def write_outputs(cfg: BenchConfig, results: list[ModeResult], json_path: Path) -> Path:
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(
        json.dumps({"config": asdict(cfg), "results": [asdict(r) for r in results]}, indent=1)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [r.label for r in results]
    x = np.arange(len(results))
    for offset, (name, key) in zip(
        (-0.25, 0, 0.25),
        (("average", "avg_latency_s"), ("P50", "p50_latency_s"), ("P95", "p95_latency_s")),
    ):
        ax.bar(x + offset, [getattr(r, key) for r in results], width=0.25, label=name)
    ax.set_xticks(x, labels, rotation=12, fontsize=8)
    ax.set_ylabel("latency (s)")
    ax.set_title(
        f"{cfg.model_id}: {cfg.rps} req/s for {cfg.duration_s:.0f} s, mask mean {cfg.mask_mean}"
    )
    ax.legend()
    fig.tight_layout()
    plot = json_path.with_suffix(".png")
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    return plot

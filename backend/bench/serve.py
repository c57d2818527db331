"""`maskserve bench serve`: MaskServe against the ordinary pipeline, end to end, under load.

Three arms serve the same traces through the same stack (REST API, Redis, Celery pre/post
workers, dispatcher, engine worker), each in a stack of its own started with its settings
(``ARM_ENV``) in a fresh data directory:

* ``baseline``: the worker runs the ordinary diffusers pipeline (static batches of up to
  ``max_batch`` requests of one model, size and steps; no cache, every token computed), routed
  round robin;
* ``nocache``: MaskServe's continuous batching with the cache off (``use_cache=false``: every
  token computed);
* ``full``: MaskServe as shipped; every template's cache is prepared before timing. The
  ``full-cold`` variant (``--cold``) replays the lowest rate to a fresh stack whose caches were
  never prepared (recorded on first edit, as a new deployment meets its templates).

Per arm: upload the templates (and a warm-up template no measured request uses), run
``warmup`` jobs on the warm-up template (not measured: first-call costs), time ``single`` jobs
one at a time (the arm's own single-request latency, which sets its SLO: ``--slo-factor`` x it,
unless ``--slo`` gives seconds), then replay every Poisson rate in rising order and the bursty
traces. The same requests (arrival, template, mask, prompt, seed) go to every arm. With
``stop_after_saturation`` an arm whose P95 breaks its SLO at one rate skips the higher ones
(they would only queue). Results of the first ``quality`` done requests of the lowest rate are
fetched and compared with the baseline's (``backend.bench.serve_report``).

With ``--url`` (and ``--api-key``) the command drives a stack already running instead; it
cannot restart it per arm, so it measures only the arms given with ``--arms`` that the running
stack serves as they need (``baseline`` needs a stack started with ``MASKSERVE_BATCHING=baseline``),
and no cold variant.
"""

from __future__ import annotations

import io
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from backend.bench.serve_load import Replay, RequestBank, Workload, png_bytes, wait_done
from backend.bench.serve_stats import ARMS, ServeRecord, meets_slo, slo_bound, summarize_group
from backend.bench.soak import SoakConfig, Target, machine
from backend.bench.trace import TraceRequest, mmpp_trace, poisson_trace
from backend.client import MaskServeClient
from backend.config import Settings
from backend.worker.stats import percentile
from templates_store.samples import sample_template

# arm -> settings of every role of its stack (over the bench's own: its key, no rate limits)
ARM_ENV = {
    "baseline": {"MASKSERVE_BATCHING": "baseline", "MASKSERVE_ROUTING_POLICY": "round_robin"},
    "nocache": {"MASKSERVE_BATCHING": "continuous"},
    "full": {"MASKSERVE_BATCHING": "continuous"},
}
COLD = "full-cold"
WARMUP_TEMPLATE_SEED = 999  # the warm-up template: no measured request edits it
TEMPLATE_SEED = 3000


@dataclass(frozen=True)
class ServeConfig:
    model_id: str = "tiny-sd2-inpaint"
    size: int = 128
    steps: int = 20
    rps: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    burst_rps: tuple[float, ...] = (1.0,)  # mean rates of the bursty (MMPP) traces
    burst_factor: float = 10.0
    duration_s: float = 60.0  # of each trace (bounded by max_requests too)
    max_requests: int = 200
    templates: int = 8
    mask_mean: float = 0.11
    zipf: float = 1.1
    seed: int = 0
    arms: tuple[str, ...] = ARMS
    cold: bool = True
    slo_s: float = 0.0  # > 0: every arm's P95 bound in seconds
    slo_factor: float = 5.0  # else: this x the arm's single-request latency
    warmup: int = 2
    single: int = 3
    quality: int = 24
    drain_s: float = 300.0
    max_batch: int = 8
    stop_after_saturation: bool = True
    cpu_workers: int = 1
    data_dir: str = ""  # parent of each arm's data directory ("": temporary directories)
    url: str = ""
    api_key: str = ""

    def __post_init__(self) -> None:
        checks = {
            "--rps": bool(self.rps) and all(r > 0 for r in self.rps),
            "--burst-rps": all(r > 0 for r in self.burst_rps),
            "--burst-factor": self.burst_factor >= 1,
            "--duration-s": self.duration_s > 0,
            "--max-requests": 1 <= self.max_requests <= 500,
            "--templates": self.templates >= 1,
            "--mask-mean": 0 < self.mask_mean < 1,
            "--steps": self.steps >= 1,
            "--size": self.size >= 8,
            "--slo-factor": self.slo_factor > 1,
            "--single": self.single >= 1,
            "--quality": self.quality >= 0,
            "--drain-s": self.drain_s > 0,
            "--max-batch": 1 <= self.max_batch <= 64,
        }
        bad = [name for name, ok in checks.items() if not ok]
        unknown = sorted(set(self.arms) - set(ARMS))
        if bad or unknown or not self.arms:
            raise ValueError(
                f"bad bench serve settings: {', '.join(bad) or 'arms'} out of range"
                + (f"; unknown arms {unknown}: use {', '.join(ARMS)}" if unknown else "")
            )
        if self.url and not self.api_key:
            raise ValueError("--url needs --api-key (a key of that stack)")


@dataclass
class ArmResult:
    """What one arm's stack gave: its records, single-request latency, fetched result images."""

    arm: str
    records: list[ServeRecord] = field(default_factory=list)
    single_s: float | None = None
    skipped: list[str] = field(default_factory=list)  # traces not run: saturated below them
    quality_trace: str = ""  # the trace whose results were fetched for the quality comparison
    images: dict[int, np.ndarray] = field(default_factory=dict)  # its request index -> RGB
    started_s: float = 0.0  # seconds the stack took to be ready


def build_traces(cfg: ServeConfig) -> dict[str, list[TraceRequest]]:
    """Every trace of the run, by name (``poisson@R``, ``bursty@R``), bounded in requests; the
    same seeds for every arm."""
    args = (cfg.duration_s, cfg.templates, cfg.mask_mean)
    traces = {
        f"poisson@{r:g}": poisson_trace(r, *args, seed=cfg.seed + i, zipf_exponent=cfg.zipf)
        for i, r in enumerate(sorted(cfg.rps))
    }
    for i, r in enumerate(cfg.burst_rps):
        traces[f"bursty@{r:g}"] = mmpp_trace(
            r, *args, seed=cfg.seed + 100 + i, zipf_exponent=cfg.zipf, burst_factor=cfg.burst_factor
        )
    return {name: requests[: cfg.max_requests] for name, requests in traces.items()}


def single_trace(cfg: ServeConfig) -> list[TraceRequest]:
    """The requests timed one at a time (their own seeds; arrival times unused)."""
    rng = np.random.default_rng(cfg.seed + 7)
    return [
        TraceRequest(i, 0.0, i % cfg.templates, cfg.mask_mean, int(rng.integers(2**31 - 1)))
        for i in range(cfg.single)
    ]


def run_serve(cfg: ServeConfig, settings: Settings, progress: bool = True) -> dict:
    """Every arm in turn (then the cold variant); returns the raw results for the report."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    traces, bank = build_traces(cfg), RequestBank(cfg.size)
    # a running stack (--url) cannot be made cold again: the variant needs a fresh one
    cold = cfg.cold and "full" in cfg.arms and not cfg.url
    arms = list(cfg.arms) + ([COLD] if cold else [])
    results = []
    started = time.time()
    for arm in arms:
        results.append(run_arm(arm, cfg, settings, traces, bank, progress))
    return {
        "config": asdict(cfg) | {"api_key": "***" if cfg.api_key else ""},
        "machine": machine(),
        "started_at": started,
        "wall_s": time.time() - started,
        "arm_env": {arm: ARM_ENV[arm.removesuffix("-cold")] for arm in arms},
        "traces": {name: len(requests) for name, requests in traces.items()},
        "results": results,
    }


def run_arm(
    arm: str,
    cfg: ServeConfig,
    settings: Settings,
    traces: dict[str, list[TraceRequest]],
    bank: RequestBank,
    progress: bool,
) -> ArmResult:
    """Start the arm's stack, warm it, time it, replay its traces, fetch its quality images."""
    result = ArmResult(arm)
    # each arm's caches in its own data directory: none inherits another's (the cold one least)
    env = ARM_ENV[arm.removesuffix("-cold")]
    target = Target(_stack_config(cfg, arm), settings, env, own_cache=True)
    began = time.monotonic()
    try:
        target.start()
        result.started_s = time.monotonic() - began
        workload = Workload(cfg.model_id, cfg.size, cfg.steps, use_cache=arm != "nocache")
        with MaskServeClient(target.base_url, target.api_key, timeout=120.0) as client:
            templates, warm = _upload_templates(client, cfg)
            if arm == "full":
                _prepare(client, cfg, templates)
            _warm_up(client, cfg, warm, workload, bank)
            replay = Replay(client, workload, templates, bank, arm, progress)
            _time_single(replay, cfg, result)
            _replay_traces(replay, cfg, traces, result, cold=arm == COLD)
            _fetch_quality(client, cfg, traces, result)
    finally:
        target.stop()
        if target.made_data_dir:  # caches of big models take gigabytes per arm
            shutil.rmtree(target.data_dir, ignore_errors=True)
    return result


def _stack_config(cfg: ServeConfig, arm: str) -> SoakConfig:
    """The stack settings ``Target`` starts an arm with (its data directory under ``data_dir``)."""
    data_dir = str(Path(cfg.data_dir) / arm) if cfg.data_dir else ""
    return SoakConfig(
        model_id=cfg.model_id,
        steps=cfg.steps,
        size=cfg.size,
        templates=cfg.templates,
        cpu_workers=cfg.cpu_workers,
        retention_s=24 * 3600.0,  # results are fetched after the replays: keep them
        data_dir=data_dir,
        url=cfg.url,
        api_key=cfg.api_key,
    )


def _upload_templates(client: MaskServeClient, cfg: ServeConfig) -> tuple[list[str], str]:
    def upload(seed: int, name: str) -> str:
        image = sample_template(cfg.size, cfg.size, seed=seed)
        return client.upload_template(png_bytes(image), name=name, tags=["bench-serve"])["id"]

    measured = [upload(TEMPLATE_SEED + i, f"serve-{i}") for i in range(cfg.templates)]
    return measured, upload(WARMUP_TEMPLATE_SEED, "serve-warmup")


def _prepare(client: MaskServeClient, cfg: ServeConfig, templates: list[str]) -> None:
    """Record every measured template's cache for the run's settings, before any timing."""
    for template_id in templates:
        accepted = client.prepare_template(template_id, cfg.model_id, cfg.steps, cfg.size)
        wait_done(client, accepted["job_id"], cfg.drain_s)


def _warm_up(client, cfg: ServeConfig, template_id: str, workload: Workload, bank) -> None:
    """Jobs on the warm-up template, one at a time, not measured (first-call costs)."""
    replay = Replay(client, workload, [template_id], bank, "warm-up", progress=False)
    for i in range(cfg.warmup):
        request = TraceRequest(i, 0.0, 0, cfg.mask_mean, 90_000 + i)
        [record] = replay.run("warmup", [request], cfg.drain_s)
        if record.status != "done":
            raise RuntimeError(
                f"warm-up job {record.job_id} ended {record.status}: {record.message}"
            )


def _time_single(replay: Replay, cfg: ServeConfig, result: ArmResult) -> None:
    """The arm's single-request latency: the median of ``single`` jobs sent one at a time."""
    for request in single_trace(cfg):
        result.records += replay.run("single", [request], cfg.drain_s)
    done = [r.latency_s for r in result.records if r.status == "done" and r.latency_s]
    result.single_s = percentile(done, 50) if done else None


def _replay_traces(replay, cfg: ServeConfig, traces, result: ArmResult, cold: bool) -> None:
    slo = slo_bound(result.single_s, cfg.slo_factor, cfg.slo_s)
    poisson = [name for name in traces if name.startswith("poisson@")]
    names = poisson[:1] if cold else poisson + [n for n in traces if n.startswith("bursty@")]
    saturated = False
    for name in names:
        if saturated and name.startswith("poisson@"):
            result.skipped.append(name)
            continue
        records = replay.run(name, traces[name], cfg.drain_s)
        result.records += records
        figures = summarize_group(records)
        if cfg.stop_after_saturation and (slo is None or not meets_slo(figures, slo)):
            saturated = name.startswith("poisson@")


def _fetch_quality(client: MaskServeClient, cfg: ServeConfig, traces, result: ArmResult) -> None:
    """Result images of the first ``quality`` requests of the lowest rate that this arm did."""
    lowest = result.quality_trace = next(name for name in traces if name.startswith("poisson@"))
    done = [r for r in result.records if r.trace == lowest and r.status == "done"]
    for record in sorted(done, key=lambda r: r.index)[: cfg.quality]:
        image = Image.open(io.BytesIO(client.result_bytes(record.job_id)))
        result.images[record.index] = np.asarray(image.convert("RGB"))

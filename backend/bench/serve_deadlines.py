"""`maskserve bench serve-deadlines`: interactive edits inside a burst of batch jobs, on the real
stack, under the worker's step schedulers side by side (issue 20's last measured item).

Each arm, a step scheduler (``MASKSERVE_STEP_SCHEDULER``: ``fifo``, ``edf``, ``slack``), alone
or with one variant of the stack's settings (``VARIANTS``: ``<scheduler>-cpu-arrival``, the CPU
workers first in first out; ``-no-tail``, ``-no-urgent``, ``-margin``, ``-no-keep``), gets a
stack of its own, started fresh by ``bench serve``'s machinery (``serve.py``: ``Target`` with the
arm's settings, a fresh data directory; templates uploaded and their caches prepared, warm-up
jobs, then the single-job latency: the median of ``single`` jobs sent one at a time). Then the
scenario, replayed through REST by ``serve_load.Replay``:

* ``batch_jobs`` jobs of class ``batch`` submitted at once (the burst), each with a generous
  deadline (``batch_deadline_s``);
* ``interactive_jobs`` jobs of class ``interactive`` arriving inside the burst: the first
  ``start_x`` single-job latencies after it, then one every ``every_x``; each with a deadline of
  ``interactive_x`` single-job latencies (or ``interactive_deadline_s`` seconds).

The schedule (arrivals, deadlines, templates, masks, seeds) is fixed from the first scheduler's
single-job latency and replayed unchanged to every other: the same requests everywhere.

From the job records (``GET /v1/jobs/{id}``) and event streams, per class and scheduler: deadline
attainment (``met_deadline``; a refused job counts as missed), mean and P95 latency (``total_s``),
each job's margin (deadline minus ``done_at``: > 0 early, < 0 late by that much), jobs parked
(events ``parked at step``), 429s, jobs accepted late, makespan and throughput, mean stage times;
from the worker's ``/metrics``: parks, resumes, steps, rows and seconds per step. The pure parts
(``plan_burst``, ``outcomes``, ``summarize``, ``compare``, ``worker_during``) take no stack.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from backend.bench.serve_deadlines_plot import plot, shown
from backend.bench.serve_stats import ServeRecord
from backend.bench.trace import TraceRequest
from backend.config import Settings
from backend.worker.stats import percentile

SCHEDULERS = ("fifo", "edf", "slack")
# an arm is a scheduler, or a scheduler and one of these variants of the stack's settings
VARIANTS = {
    # the CPU workers take tasks first in, first out, not by service level
    "-cpu-arrival": {"MASKSERVE_CPU_SERVICE_ORDER": "false"},
    # the engine workers plan rows to end at their deadlines, not a finish tail before them
    "-no-tail": {"MASKSERVE_FINISH_TAIL": "false"},
    # the engine workers park rows for waiting ones at planning rounds only
    "-no-urgent": {"MASKSERVE_URGENT_PARKS": "false"},
    # the engine workers plan on the 0.9 quantile of their recent steps' measured / predicted
    "-margin": {"MASKSERVE_PLAN_QUANTILE": "0.9"},
    # the next ready row takes the free slot of a row whose template's cache is being read
    "-no-keep": {"MASKSERVE_KEEP_SLOT_WHILE_READING": "false"},
}
ARMS = (*SCHEDULERS, *(s + v for v in VARIANTS for s in SCHEDULERS))
CLASSES = ("interactive", "batch")
BURST = "burst"  # the replay's trace name
PARKED = "parked at step"  # how a parked row's event message begins (worker loop)
# an engine worker's /metrics samples read before and after the scenario -> their short names
WORKER_METRICS = {
    "maskserve_worker_parks_total": "parks",
    "maskserve_worker_resumes_total": "resumes",
    # rows passed over for a free slot because their template's cache was not in RAM yet
    "maskserve_worker_held_row_schedules_total": "held",
    "maskserve_worker_steps_total": "steps",
    "maskserve_worker_mean_step_s": "mean_step_s",  # these three: means over the worker's life
    "maskserve_worker_mean_overhead_s": "mean_overhead_s",
    "maskserve_worker_mean_batch_rows": "mean_batch_rows",
    "maskserve_worker_finish_tail_s": "finish_tail_s",  # a gauge: the reserve it plans with
}
GAUGES = ("finish_tail_s",)  # the largest over workers, the latest over time
METRICS_SETTLE_S = 2.5  # > 2 x worker.service.HEARTBEAT_EVERY_S: its /metrics are that stale
STAGES = ("queue_s", "pre_s", "wait_s", "denoise_s", "post_s")  # a job's timings, total_s apart


# what each setting means (also the command's help: one flag per field of ``BurstConfig``)
HELP = {
    "model_id": "the model every stack serves",
    "size": "edit resolution (square), px",
    "steps": "denoising steps of every job",
    "batch_jobs": "batch jobs submitted at once: the burst",
    "interactive_jobs": "interactive jobs arriving inside the burst",
    "interactive_x": "an interactive job's deadline: this x the single-job latency",
    "interactive_deadline_s": "> 0: an interactive job's deadline in seconds instead",
    "batch_deadline_s": "a batch job's deadline, s (generous: none should be refused)",
    "start_x": "the first interactive arrival after the burst, in single-job latencies",
    "every_x": "between interactive arrivals, in single-job latencies",
    "schedulers": f"comma-separated, any of {', '.join(ARMS)}; the first sets the schedule",
    "templates": "gallery templates the jobs edit (caches prepared before timing)",
    "mask_mean": "mean mask ratio (Beta draws)",
    "zipf": "template popularity exponent",
    "seed": "seed of templates, masks and job seeds",
    "single": "jobs timed one at a time: their median is the single-job latency",
    "warmup": "jobs before timing (not measured)",
    "drain_s": "wait for the last jobs after the last arrival, s",
    "data_dir": "parent of each stack's data directory (default: temporary ones)",
}


@dataclass(frozen=True)
class BurstConfig:
    model_id: str = "tiny-sd2-inpaint"
    size: int = 128
    steps: int = 20
    batch_jobs: int = 24
    interactive_jobs: int = 6
    interactive_x: float = 3.0
    interactive_deadline_s: float = 0.0
    batch_deadline_s: float = 600.0
    start_x: float = 1.0
    every_x: float = 2.0
    schedulers: tuple[str, ...] = ("fifo", "slack")
    templates: int = 4
    mask_mean: float = 0.11
    zipf: float = 1.1
    seed: int = 0
    warmup: int = 2
    single: int = 3
    drain_s: float = 300.0
    data_dir: str = ""

    def __post_init__(self) -> None:
        checks = {
            "--batch-jobs": 1 <= self.batch_jobs <= 400,
            "--interactive-jobs": 1 <= self.interactive_jobs <= 100,
            "--interactive-x": self.interactive_x > 0,
            "--interactive-deadline-s": self.interactive_deadline_s >= 0,
            "--batch-deadline-s": self.batch_deadline_s > 0,
            "--start-x": self.start_x >= 0,
            "--every-x": self.every_x >= 0,
            "--steps": self.steps >= 1,
            "--size": self.size >= 8,
            "--templates": self.templates >= 1,
            "--mask-mean": 0 < self.mask_mean < 1,
            "--single": self.single >= 1,
            "--drain-s": self.drain_s > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        unknown = sorted(set(self.schedulers) - set(ARMS))
        if unknown or not self.schedulers:
            bad.append(f"--schedulers ({', '.join(unknown) or 'none'}; use {', '.join(ARMS)})")
        if bad:
            raise ValueError(f"bad bench serve-deadlines settings: {', '.join(bad)}")


@dataclass(frozen=True)
class Planned:
    """One request of the scenario with its service level."""

    request: TraceRequest
    service_class: str
    deadline_s: float


# ----- the scenario (pure) -----------------------------------------------------------------------
def plan_burst(cfg: BurstConfig, single_s: float) -> list[Planned]:
    """The burst at 0 s, then the interactive jobs inside it, in arrival order; templates, masks
    and seeds from ``cfg.seed`` alone (the same whatever ``single_s``)."""
    import numpy as np

    from backend.bench.trace import _requests

    interactive = [(cfg.start_x + i * cfg.every_x) * single_s for i in range(cfg.interactive_jobs)]
    arrivals = [0.0] * cfg.batch_jobs + interactive
    rng = np.random.default_rng([cfg.seed, 20])
    requests = _requests(rng, arrivals, cfg.templates, cfg.mask_mean, cfg.zipf)
    tight = cfg.interactive_deadline_s or cfg.interactive_x * single_s
    return [
        Planned(r, "batch", cfg.batch_deadline_s)
        if r.index < cfg.batch_jobs
        else Planned(r, "interactive", round(tight, 3))
        for r in requests
    ]


def outcomes(
    plan: list[Planned], records: list[ServeRecord], jobs: dict[str, dict], parks: dict[str, int]
) -> list[dict]:
    """One row per planned request: its class, deadline, what became of it (``records`` by index,
    the job records ``jobs`` and parks by job id)."""
    by_index = {record.index: record for record in records}
    rows = []
    for planned in plan:
        record = by_index[planned.request.index]
        job = jobs.get(record.job_id, {})
        done = record.status == "done" and record.latency_s is not None
        margin = None
        if done and job.get("deadline") and job.get("done_at"):
            margin = job["deadline"] - job["done_at"]
        elif done:
            margin = planned.deadline_s - record.latency_s
        rows.append(
            {
                "index": planned.request.index,
                "service_class": planned.service_class,
                "arrival_s": planned.request.arrival_s,
                "submitted_s": record.submitted_s,
                "finished_s": record.finished_s if done else None,
                "deadline_s": planned.deadline_s,
                "status": record.status,
                "job_id": record.job_id,
                "latency_s": record.latency_s if done else None,
                "met": bool(job.get("met_deadline")) if done else False,
                "margin_s": margin,
                "refused_429": record.status == "refused" and record.message.startswith("HTTP 429"),
                "accepted_late": bool(job.get("late")),
                "parks": parks.get(record.job_id, 0),
                "timings": record.timings,
                "message": record.message,
            }
        )
    return rows


def class_figures(rows: list[dict]) -> dict:
    """Attainment (met / submitted), latency, margins, parks, 429s of one class's rows; its
    makespan (first submission to last finish), throughput (done / makespan) and the mean seconds
    of each stage of a done job (queue: waiting for pre-processing; wait: in the worker's queue or
    parked; denoise: from its first step to its last)."""
    done = [r for r in rows if r["latency_s"] is not None]
    figures: dict = {
        "jobs": len(rows),
        "done": len(done),
        "met": sum(r["met"] for r in rows),
        "attainment": sum(r["met"] for r in rows) / len(rows) if rows else None,
        "refused_429": sum(r["refused_429"] for r in rows),
        "accepted_late": sum(r["accepted_late"] for r in rows),
        "parked_jobs": sum(r["parks"] > 0 for r in rows),
        "parks": sum(r["parks"] for r in rows),
    }
    if not done:
        return figures
    latencies = [r["latency_s"] for r in done]
    margins = [r["margin_s"] for r in done if r["margin_s"] is not None]
    makespan = max(r["finished_s"] for r in done) - min(r["submitted_s"] for r in rows)
    return figures | {
        "mean_s": sum(latencies) / len(latencies),
        "p95_s": percentile(latencies, 95),
        "max_s": max(latencies),
        "margin_min_s": min(margins) if margins else None,
        "margin_mean_s": sum(margins) / len(margins) if margins else None,
        "makespan_s": makespan,
        "throughput_rps": len(done) / makespan if makespan > 0 else None,
        "stages_s": {s: sum(r["timings"].get(s, 0.0) for r in done) / len(done) for s in STAGES},
    }


def summarize(rows: list[dict]) -> dict[str, dict]:
    """``class_figures`` per service class present, and of every job (``all``: the makespan of
    the whole scenario; no margins, which mean nothing across classes)."""
    classes = [c for c in CLASSES if any(r["service_class"] == c for r in rows)]
    figures = {c: class_figures([r for r in rows if r["service_class"] == c]) for c in classes}
    every = class_figures(rows)
    return figures | {"all": {k: v for k, v in every.items() if not k.startswith("margin_")}}


# the comparison with fifo: figure -> (class, its figure, how: points, difference or ratio)
COMPARED = {
    "interactive_attainment_points": ("interactive", "attainment", "points"),
    "interactive_margin_mean_gain_s": ("interactive", "margin_mean_s", "difference"),
    "batch_throughput_ratio": ("batch", "throughput_rps", "ratio"),
    "batch_makespan_ratio": ("batch", "makespan_s", "ratio"),
    "all_makespan_ratio": ("all", "makespan_s", "ratio"),
}


def compare(summaries: dict[str, dict[str, dict]], base: str = "fifo") -> dict[str, dict]:
    """Each other scheduler against ``base`` (``COMPARED``; None where a figure is missing)."""
    ref = summaries.get(base)
    return {
        name: {
            key: _against(summary.get(c, {}).get(fig), ref.get(c, {}).get(fig), how)
            for key, (c, fig, how) in COMPARED.items()
        }
        for name, summary in summaries.items()
        if ref is not None and name != base
    }


def _against(mine, theirs, how: str):
    if mine is None or theirs is None:
        return None
    if how == "ratio":
        return mine / theirs if theirs else None
    return (mine - theirs) * (100.0 if how == "points" else 1.0)


def count_parks(events: list[dict]) -> int:
    return sum(str(e.get("message", "")).startswith(PARKED) for e in events)


def metric_values(text: str) -> dict[str, float]:
    """The unlabelled samples of ``WORKER_METRICS`` in a Prometheus text exposition, by short
    name."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        WORKER_METRICS[sample.name]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in WORKER_METRICS and not sample.labels
    }


def worker_totals(values: dict[str, float]) -> dict[str, float]:
    """A worker's readings as totals that add up over workers and subtract over time."""
    steps = values.get("steps", 0.0)
    return {
        "parks": values.get("parks", 0.0),
        "resumes": values.get("resumes", 0.0),
        "held": values.get("held", 0.0),
        "steps": steps,
        "step_s": values.get("mean_step_s", 0.0) * steps,
        "overhead_s": values.get("mean_overhead_s", 0.0) * steps,
        "rows": values.get("mean_batch_rows", 0.0) * steps,
        "finish_tail_s": values.get("finish_tail_s", 0.0),
    }


def worker_during(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the workers did between two readings of ``worker_totals``: parks, resumes, rows held
    for a cache read (one per row and schedule), steps, per step the mean time, batching overhead
    and rows, and the finish tail they planned with at the end."""
    d = {key: value - before.get(key, 0.0) for key, value in after.items() if key not in GAUGES}
    steps = d.get("steps", 0.0)
    means = {"mean_step_s": "step_s", "mean_overhead_s": "overhead_s", "mean_batch_rows": "rows"}
    return (
        {key: d.get(key, 0.0) for key in ("parks", "resumes", "held", "steps")}
        | {mean: d.get(total, 0.0) / steps if steps else None for mean, total in means.items()}
        | {gauge: after.get(gauge, 0.0) for gauge in GAUGES}
    )


# ----- the real stack ----------------------------------------------------------------------------
class LevelledClient:
    """A ``MaskServeClient`` whose ``submit`` adds each request's service level (looked up by its
    seed, unique in the scenario): ``Replay`` submits through it unchanged."""

    def __init__(self, client, plan: list[Planned]):
        self._client = client
        self._levels = {p.request.seed: p for p in plan}

    def submit(self, mask, prompt: str = "", **params) -> dict:
        level = self._levels[params["seed"]]
        params |= {"service_class": level.service_class, "deadline_s": level.deadline_s}
        return self._client.submit(mask, prompt, **params)

    def __getattr__(self, name):
        return getattr(self._client, name)


@dataclass
class ArmRun:
    """What one scheduler's stack gave."""

    scheduler: str
    single_s: float | None = None
    started_s: float = 0.0
    records: list[ServeRecord] = field(default_factory=list)
    jobs: dict[str, dict] = field(default_factory=dict)
    parks: dict[str, int] = field(default_factory=dict)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # before / after burst
    wall_s: float = 0.0


def arm_env(arm: str) -> dict[str, str]:
    """The stack settings of ``arm`` (``ARMS``)."""
    env = {"MASKSERVE_BATCHING": "continuous", "MASKSERVE_STEP_SCHEDULER": arm}
    for suffix, settings in VARIANTS.items():
        if arm.endswith(suffix):
            env |= settings | {"MASKSERVE_STEP_SCHEDULER": arm.removesuffix(suffix)}
    return env


def run_burst_bench(cfg: BurstConfig, settings: Settings, progress: bool = True) -> dict:
    """Every scheduler in turn; returns the report (``build_report``)."""
    from backend.bench.serve_load import RequestBank
    from backend.bench.soak import machine

    logging.getLogger("httpx").setLevel(logging.WARNING)
    bank, plan, runs = RequestBank(cfg.size), None, []
    started = time.time()
    for scheduler in cfg.schedulers:
        run = ArmRun(scheduler)
        plan = _run_arm(run, cfg, settings, bank, plan, progress)
        runs.append(run)
    return build_report(cfg, plan or [], runs, machine(), time.time() - started)


def _run_arm(run: ArmRun, cfg, settings, bank, plan: list[Planned] | None, progress) -> list:
    """Start the scheduler's stack, run the scenario on it (``_drive``), stop it and remove its
    data directory; returns the plan (made on the first arm)."""
    from backend.bench.serve import ServeConfig, _stack_config
    from backend.bench.soak import Target
    from backend.client import MaskServeClient

    serve_cfg = ServeConfig(
        model_id=cfg.model_id, size=cfg.size, steps=cfg.steps, templates=cfg.templates,
        mask_mean=cfg.mask_mean, zipf=cfg.zipf, seed=cfg.seed, warmup=cfg.warmup,
        single=cfg.single, drain_s=cfg.drain_s, data_dir=cfg.data_dir, cold=False, quality=0,
    )  # fmt: skip
    # each stack records its own caches in its own data directory: none inherits another's
    stack_cfg = _stack_config(serve_cfg, run.scheduler)
    target = Target(stack_cfg, settings, arm_env(run.scheduler), own_cache=True)
    began = time.monotonic()
    try:
        target.start()
        run.started_s = time.monotonic() - began
        with MaskServeClient(target.base_url, target.api_key, timeout=120.0) as client:
            return _drive(run, cfg, serve_cfg, client, target, bank, plan, progress)
    finally:
        target.stop()
        if target.made_data_dir:
            shutil.rmtree(target.data_dir, ignore_errors=True)
        run.wall_s = time.monotonic() - began


def _drive(run: ArmRun, cfg, serve_cfg, client, target, bank, plan, progress) -> list[Planned]:
    """Templates (caches prepared), warm-up and the single-job latency as ``bench serve`` does
    them, then the scenario; the job records and each job's parks from its event stream."""
    from backend.bench.serve import ArmResult, _prepare, _time_single, _upload_templates, _warm_up
    from backend.bench.serve_load import Replay, Workload

    workload = Workload(cfg.model_id, cfg.size, cfg.steps)
    templates, warm = _upload_templates(client, serve_cfg)
    _prepare(client, serve_cfg, templates)
    _warm_up(client, serve_cfg, warm, workload, bank)
    single = ArmResult(run.scheduler)
    _time_single(Replay(client, workload, templates, bank, run.scheduler, False), serve_cfg, single)
    run.single_s = single.single_s
    if plan is None:
        if not run.single_s:
            raise RuntimeError(f"{run.scheduler}: no single-job latency measured")
        plan = plan_burst(cfg, run.single_s)
    run.counters["before"] = _worker_counters(target)
    levelled = LevelledClient(client, plan)
    replay = Replay(levelled, workload, templates, bank, run.scheduler, progress)
    run.records = replay.run(BURST, [p.request for p in plan], cfg.drain_s)
    run.counters["after"] = _worker_counters(target)
    for job_id in (record.job_id for record in run.records if record.job_id):
        run.jobs[job_id] = client.get(job_id)
        run.parks[job_id] = count_parks(list(client.events(job_id, timeout=30)))
    return plan


def _worker_counters(target) -> dict[str, float]:
    """``worker_totals`` summed over the stack's engine workers' ``/metrics``, once they show the
    steps run so far (a worker serves the stats of its latest heartbeat, rebuilt every second)."""
    import httpx

    time.sleep(METRICS_SETTLE_S)
    totals: dict[str, float] = {}
    for name, url in target.stack.metrics_urls().items():
        if name.startswith("worker"):
            reading = worker_totals(metric_values(httpx.get(url, timeout=10).text))
            totals = {
                key: (max if key in GAUGES else sum)((totals.get(key, 0.0), value))
                for key, value in reading.items()
            }
    return totals


# ----- the report --------------------------------------------------------------------------------
def build_report(cfg: BurstConfig, plan, runs: list[ArmRun], device: str, wall_s: float) -> dict:
    arms = {}
    for run in runs:
        rows = outcomes(plan, run.records, run.jobs, run.parks)
        arms[run.scheduler] = {
            "env": arm_env(run.scheduler),
            "single_s": run.single_s,
            "stack_start_s": run.started_s,
            "wall_s": run.wall_s,
            "summary": summarize(rows),
            "worker": worker_during(run.counters.get("before", {}), run.counters.get("after", {})),
            "jobs": rows,
            "records": [asdict(r) for r in run.records],
        }
    return {
        "config": asdict(cfg),
        "machine": device,
        "wall_s": wall_s,
        "schedule": {
            "single_s_from": cfg.schedulers[0],
            "single_s": runs[0].single_s if runs else None,
            "requests": [
                asdict(p.request) | {"service_class": p.service_class, "deadline_s": p.deadline_s}
                for p in plan
            ],
        },  # fmt: skip
        "arms": arms,
        "comparison": compare({name: arm["summary"] for name, arm in arms.items()}),
    }


def summary_text(report: dict) -> str:
    """The printed table: per scheduler and class, then every interactive job side by side."""
    width = max(9, *(len(name) for name in report["arms"]))  # arm names line up
    lines = [
        f"{'scheduler':{width}s} class        jobs done 429     met attain  mean s   P95 s  "
        "margin min/mean s parked makespan s jobs/s"
    ]
    for name, arm in report["arms"].items():
        for cls, f in arm["summary"].items():
            margins = f"{shown(f.get('margin_min_s'))} / {shown(f.get('margin_mean_s'))}"
            lines.append(
                f"{name:{width}s} {cls:11s} {f['jobs']:4d} {f['done']:4d} {f['refused_429']:3d} "
                f"{f['met']:3d}/{f['jobs']:<3d} {shown(f['attainment'], '.0%'):>6s} "
                f"{shown(f.get('mean_s')):>7s} {shown(f.get('p95_s')):>7s} {margins:>17s} "
                f"{f['parked_jobs']:6d} {shown(f.get('makespan_s')):>10s} "
                f"{shown(f.get('throughput_rps')):>6s}"
            )
        w = arm["worker"]
        lines.append(
            f"{name:{width}s} single-job latency {shown(arm['single_s'])} s; the worker during the "
            f"scenario: {w['parks']:g} parks, {w['resumes']:g} resumes, "
            f"{w.get('held', 0):g} rows held for a cache read, {w['steps']:g} steps of "
            f"{shown(w['mean_batch_rows'])} rows, {shown(w['mean_step_s'])} s each "
            f"(batching overhead {shown(w['mean_overhead_s'])} s); finish tail "
            f"{shown(w.get('finish_tail_s'), '.3f')} s"
        )
    by_arm = {name: {r["index"]: r for r in arm["jobs"]} for name, arm in report["arms"].items()}
    lines.append("interactive jobs: arrival, deadline; latency per scheduler (margin: + early)")
    for request in report["schedule"]["requests"]:
        if request["service_class"] == "interactive":
            cells = [
                f"{name} {shown(rows[request['index']]['latency_s'])} s "
                f"({shown(rows[request['index']]['margin_s'], '+.2f')})"
                for name, rows in by_arm.items()
            ]
            lines.append(
                f"  #{request['index']:<3d} at {request['arrival_s']:6.2f} s, deadline "
                f"{request['deadline_s']:.2f} s: " + "; ".join(cells)
            )
    for name, c in report["comparison"].items():
        lines.append(
            f"{name} vs fifo: interactive attainment "
            f"{shown(c['interactive_attainment_points'], '+.2f')} points, mean margin "
            f"{shown(c['interactive_margin_mean_gain_s'], '+.2f')} s; batch throughput "
            f"x{shown(c['batch_throughput_ratio'])}, makespan x{shown(c['batch_makespan_ratio'])}; "
            f"every job done x{shown(c['all_makespan_ratio'])} as late"
        )
    return "\n".join(lines)


# ----- the command -------------------------------------------------------------------------------
def add_serve_deadlines_parser(bench_sub) -> None:
    """One flag per field of ``BurstConfig`` (``--model`` for ``model_id``), its default."""
    parser = bench_sub.add_parser(
        "serve-deadlines",
        help="interactive jobs inside a burst of batch jobs on the real stack, step schedulers "
        "side by side: attainment and margins (docs/bench/serve-deadlines.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(BurstConfig):
        flag = "--model" if f.name == "model_id" else "--" + f.name.replace("_", "-")
        listed = isinstance(f.default, tuple)
        kind, default = (str, ",".join(f.default)) if listed else (type(f.default), f.default)
        parser.add_argument(flag, dest=f.name, type=kind, default=default, help=HELP.get(f.name))
    parser.add_argument("--json", default="docs/bench/serve-deadlines.json", help="and its .png")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=cmd_bench_serve_deadlines)


def cmd_bench_serve_deadlines(args, settings: Settings) -> int:
    values = {f.name: getattr(args, f.name) for f in fields(BurstConfig)}
    values["schedulers"] = tuple(s.strip() for s in values["schedulers"].split(",") if s.strip())
    try:
        cfg = BurstConfig(**values)
    except ValueError as exc:
        return _failed(str(exc), 2)
    try:
        report = run_burst_bench(cfg, settings, progress=not args.no_progress)
    except RuntimeError as exc:  # a stack never got ready, or a warm-up job failed
        return _failed(f"bench serve-deadlines stopped: {exc}", 1)
    print(summary_text(report))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def _failed(reason: str, status: int) -> int:
    print(f"error: {reason}", file=sys.stderr)
    return status

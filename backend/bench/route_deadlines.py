"""`maskserve bench route-deadlines`: worker step schedulers side by side under deadlines, in the
route simulation (``route_sim``, ``route_deadlines_sim``: simulated time, no model runs).

Workload: the route bench's cluster (N workers, fitted cost profile, Zipf templates, Beta masks,
shared disk tier, cold RAM tiers) and a mix of service classes: ``interactive_share`` of the
requests (default 30%) are ``interactive`` with a tight target (``interactive_target_s``), the
rest ``batch`` with a loose one (``batch_target_s``); a request's deadline is its arrival plus its
class's target (defaults: ``Settings.deadlines``). Two arrival processes per load level:

* ``poisson``: plain Poisson arrivals;
* ``bursty``: a two-state MMPP (``trace.mmpp_trace``): bursts at ``burst_factor`` x the mean rate
  holding ``burst_share`` of the time in stays of ``burst_s`` seconds on average; the calm rate
  keeps the mean (the defaults, 20x for 3 s, 2% of the time, put bursts at about 33x the calm
  rate, inside the 10-90x ROCK saw).

Both are conditioned on their count (``trace.counted_trace``), so a trace offers exactly the
intended rate, and the bursts fall at the same times at every load.

Loads are fractions of the cluster's capacity as the route bench measures it
(``route_bench.saturation_rps``: completions per second of the overloaded cluster, FIFO), or of
``capacity_rps``. Every arm replays the identical trace at each (process, load):

* ``fifo``: today's continuous batching (arrival order);
* ``edf``: waiting rows in precedence order (least slack first), no parking;
* ``slack``: the full scheduler: rounds of ``round_steps``, parking within the bounds.

Routing is ``mask_aware`` with deadlines on (``backend.dispatch.deadline_cost``) for every arm;
an arm named with the suffix ``-blind`` (``slack-blind``) routes without them (the router's choice
before deadlines), to measure what deadline routing adds. Admission control (``shed``) applies
the API's rule to every arm alike.

A machine whose speed drifts (``drift_cv``, ``drift_tau_s``: each worker's own, ``machine_drift``)
and workers that learn their step time on a step clock (``step_clock``) bring the simulation
closer to the engine worker on a noisy CPU, and so does a real worker's measured growth of a step
with its rows (``step_shape``, ``backend.bench.step_shape``); all are off by default.

Latency = arrival -> last denoising step (pre/post-processing are outside the simulation and the
same for every arm). Statistics count the jobs that arrive after the warm-up
(``warmup_fraction`` of the run; every job is simulated). Per class: SLO attainment (the share of
accepted jobs finished by their deadline), P50/P95 latency, throughput (completions per second
inside the measured window), 429 rate (refused / arrived); per run: parks and resumes per job, the
longest wait (queued plus parked) of any batch job and the jobs waiting past ``max_wait_s``
(starved).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from backend.bench.machine_drift import DriftSpec
from backend.bench.route_bench import (
    RouteBenchConfig,
    capacity_rps,
    cost_model_for,
    saturation_rps,
)
from backend.bench.route_deadlines_sim import (
    ARMS,
    DeadlineClusterSimulation,
    Service,
    ShedRule,
    StepPlan,
)
from backend.bench.seeds import seed_span
from backend.bench.trace import counted_trace, service_classes
from backend.config_deadlines import DeadlineSettings
from backend.dispatch.router import Router
from backend.worker.stats import percentile

TRACES = ("poisson", "bursty")
BLIND = "-blind"  # an arm's suffix: its router is not shown the deadlines (the ablation)
CLASSES = ("interactive", "batch")
TARGET_LOADS = (0.8, 1.0)  # the targets hold at loads in this range
_D = DeadlineSettings()


@dataclass
class DeadlineBenchConfig:
    # the cluster (as ``RouteBenchConfig``)
    model_id: str = "small-flux-fill"
    device: str = "cpu"
    mode: str = "kv"
    profiles_dir: str = "profiles"
    duration_s: float = 600.0
    num_workers: int = 8
    max_batch: int = 8
    steps: int = 20
    num_templates: int = 200
    ram_templates: int = 8
    prerecorded: float = 0.8
    zipf_exponent: float = 1.1
    mask_mean: float = 0.11
    disk_read_s_per_byte: float = 1e-9
    noise_cv: float = 0.05
    # each worker's machine drifts (``machine_drift``; cv 0: it does not); the capacity is
    # measured without drift
    drift_cv: float = 0.0
    drift_tau_s: float = 5.0
    step_clock: bool = False  # workers calibrate their step predictions as the engine worker does
    # a measured worker's growth of a step with its rows (``step_shape``; () = the profile's)
    step_shape: tuple[float, ...] = ()
    capacity_rps: float = 0.0  # > 0: loads are fractions of this rate (else measured)
    warmup_fraction: float = 0.25
    seed: int = 0
    # the comparison
    schedulers: tuple[str, ...] = ARMS
    traces: tuple[str, ...] = TRACES
    loads: tuple[float, ...] = (0.5, 0.8, 0.9, 1.0, 1.2)
    # the workload's classes
    interactive_share: float = 0.3
    # the classes served; the trace's jobs of other classes never arrive (only "interactive": the
    # same interactive jobs with the cluster to themselves, a reference for how many of them this
    # device can serve on time at all; its runs judge no target)
    serve_classes: tuple[str, ...] = CLASSES
    interactive_target_s: float = _D.interactive_target_s
    batch_target_s: float = _D.batch_target_s
    # bursts (``bursty``)
    burst_factor: float = 20.0
    burst_share: float = 0.02
    burst_s: float = 3.0
    # the step scheduler's bounds and admission control (``Settings.deadlines``)
    round_steps: int = _D.round_steps
    max_wait_s: float = _D.max_wait_s
    max_parks_per_round: int = _D.max_parks_per_round
    urgent_parks: bool = _D.urgent_parks
    park_by_deadline: bool = _D.park_by_deadline
    keep_slot_while_reading: bool = _D.keep_slot_while_reading
    shed: bool = True
    shed_classes: tuple[str, ...] = tuple(_D.shed_classes)
    late_factor: float = _D.late_factor
    max_queue: int = _D.max_queue

    def route(self) -> RouteBenchConfig:
        """The cluster as the route bench configures it."""
        return RouteBenchConfig(
            model_id=self.model_id,
            device=self.device,
            mode=self.mode,
            profiles_dir=self.profiles_dir,
            policies=("mask_aware",),
            loads=self.loads,
            duration_s=self.duration_s,
            num_workers=self.num_workers,
            max_batch=self.max_batch,
            steps=self.steps,
            num_templates=self.num_templates,
            ram_templates=self.ram_templates,
            prerecorded=self.prerecorded,
            zipf_exponent=self.zipf_exponent,
            mask_mean=self.mask_mean,
            burst_factor=1.0,
            disk_read_s_per_byte=self.disk_read_s_per_byte,
            noise_cv=self.noise_cv,
            step_shape=self.step_shape,
            capacity_rps=self.capacity_rps,
            warmup_fraction=self.warmup_fraction,
            seed=self.seed,
        )


def deadline_trace(cfg: DeadlineBenchConfig, kind: str, rps: float, seed: int) -> list:
    """Arrivals of ``kind`` (``poisson`` or ``bursty``) offering exactly ``rps`` over the run
    (``trace.counted_trace``: the process conditioned on its count; bursts fall at the same times
    at every load)."""
    if kind not in TRACES:
        raise ValueError(f"trace must be one of {TRACES}, got {kind!r}")
    bursts = (
        {"burst_factor": cfg.burst_factor, "burst_share": cfg.burst_share, "burst_s": cfg.burst_s}
        if kind == "bursty"
        else {}
    )
    return counted_trace(
        rps,
        cfg.duration_s,
        cfg.num_templates,
        cfg.mask_mean,
        seed=seed,
        zipf_exponent=cfg.zipf_exponent,
        **bursts,
    )


def services_of(cfg: DeadlineBenchConfig, trace: list) -> list[Service]:
    """Each request's class and deadline (arrival + its class's target), by request index."""
    classes = service_classes(len(trace), cfg.interactive_share, cfg.seed)
    target = {"interactive": cfg.interactive_target_s, "batch": cfg.batch_target_s}
    return [Service(c, req.arrival_s + target[c]) for c, req in zip(classes, trace)]


def check_serve_classes(serve_classes: tuple[str, ...]) -> None:
    """A clear error unless ``serve_classes`` is a non-empty set of known classes."""
    if not serve_classes or set(serve_classes) - set(CLASSES):
        raise ValueError(
            f"classes to serve must be some of {', '.join(CLASSES)}, got {list(serve_classes)}"
        )


def served(serve_classes: tuple[str, ...], trace: list, services: list[Service]) -> list:
    """The requests of ``trace`` whose class is in ``serve_classes`` (indices kept: ``services``
    stays indexed by request index)."""
    return [r for r in trace if services[r.index].service_class in serve_classes]


def shown_attainment(stats: dict, spec: str = ".0%") -> str:
    """A class's attainment as tables and progress lines show it: "-" for a class with no accepted
    job (a run of other classes), whose attainment of 1.0 is vacuous."""
    return format(stats["attainment"], spec) if stats["accepted"] else "-"


def _pct(values: list[float], q: float) -> float:
    return float(percentile(values, q)) if values else 0.0


def measure(
    cfg: DeadlineBenchConfig, sim: DeadlineClusterSimulation, trace: list, services: list[Service]
) -> dict:
    """One run's statistics (module docstring)."""
    warm = cfg.warmup_fraction * cfg.duration_s
    window = cfg.duration_s - warm
    per_class: dict[str, dict] = {}
    for cls in CLASSES:
        reqs = [r for r in trace if services[r.index].service_class == cls]
        measured = [r for r in reqs if r.arrival_s >= warm]
        accepted = [r for r in measured if r.index not in sim.refused]
        lat = [sim.done_at[r.index] - r.arrival_s for r in accepted if r.index in sim.done_at]
        met = [
            r
            for r in accepted
            if r.index in sim.done_at and sim.done_at[r.index] <= services[r.index].deadline + 1e-9
        ]
        # queued plus parked: the rest of a job's latency is its steps (and per-job work)
        waits = [sim.finished[r.index].wait_s for r in accepted if r.index in sim.finished]
        done_at = [sim.done_at[r.index] for r in reqs if r.index in sim.done_at]
        # the router's predicted finish against the finish (> 0: later than predicted)
        late_by = [
            sim.done_at[r.index] - sim.predicted[r.index]
            for r in accepted
            if r.index in sim.done_at and r.index in sim.predicted
        ]
        in_window = sum(1 for t in done_at if warm <= t < cfg.duration_s)
        span = max(done_at, default=0.0) - (trace[0].arrival_s if trace else 0.0)
        per_class[cls] = {
            "jobs": len(measured),
            "accepted": len(accepted),
            "completed": len(lat),
            "attainment": len(met) / len(accepted) if accepted else 1.0,
            "p50_latency_s": _pct(lat, 50),
            "p95_latency_s": _pct(lat, 95),
            "avg_latency_s": float(np.mean(lat)) if lat else 0.0,
            "avg_wait_s": float(np.mean(waits)) if waits else 0.0,
            "throughput_rps": in_window / window if window > 0 else 0.0,
            # every job of the class over the whole run: first arrival -> its last completion
            "run_throughput_rps": len(done_at) / span if span > 0 else 0.0,
            "shed_rate": (len(measured) - len(accepted)) / len(measured) if measured else 0.0,
            "accepted_late": sum(1 for r in accepted if r.index in sim.accepted_late),
            # None where nothing was predicted (the worker bench has no router)
            "finish_vs_predicted_mean_s": float(np.mean(late_by)) if late_by else None,
            "finish_error_p95_s": _pct([abs(e) for e in late_by], 95) if late_by else None,
        }
    done = list(sim.finished.values())
    batch_waits = [j.wait_s for j in done if j.service_class == "batch"]
    counts = sim.scheduler_counts()
    accepted_all = len(trace) - len(sim.refused)
    in_window_all = sum(1 for t in sim.done_at.values() if warm <= t < cfg.duration_s)
    return {
        "classes": per_class,
        "throughput_rps": in_window_all / window if window > 0 else 0.0,
        "completed": len(sim.done_at),
        "accepted": accepted_all,
        "refused": {
            why: sum(1 for w in sim.refused.values() if w == why) for why in ("queue", "deadline")
        },
        "parks_per_job": counts["parks"] / accepted_all if accepted_all else 0.0,
        "resumes_per_job": counts["resumes"] / accepted_all if accepted_all else 0.0,
        "parked_jobs": sum(1 for j in done if j.parks),
        "max_batch_wait_s": max(batch_waits, default=0.0),
        "max_wait_s": max((j.wait_s for j in done), default=0.0),
        "starved_jobs": sum(1 for j in done if j.wait_s > cfg.max_wait_s),
        "decision_p50_ms": _pct([d * 1e3 for d in sim.decisions], 50),
    }


def run_deadline_bench(cfg: DeadlineBenchConfig, progress=None) -> dict:
    """Every arm on the identical traces per (process, load): a JSON-ready report
    ``{"config", "capacity_rps", "results": [...], "comparison", "targets"}``."""
    unknown = {a for a in cfg.schedulers if a.removesuffix(BLIND) not in ARMS}
    if unknown:
        raise ValueError(
            f"unknown schedulers {sorted(unknown)}; expected some of {ARMS}, each optionally "
            f"with {BLIND} (routing not shown the deadlines)"
        )
    check_serve_classes(cfg.serve_classes)
    route = cfg.route()
    truth, routing = cost_model_for(route, "exact"), cost_model_for(route)
    rng = np.random.default_rng([cfg.seed, 99])  # the route bench's prerecorded templates
    prerecorded = {f"tpl{i}" for i in range(cfg.num_templates) if rng.random() < cfg.prerecorded}
    capacity = (
        cfg.capacity_rps
        if cfg.capacity_rps > 0
        else saturation_rps(route, truth, routing, prerecorded)
    )
    shed = ShedRule(cfg.shed_classes, cfg.late_factor, cfg.max_queue) if cfg.shed else None
    results = []
    for kind in cfg.traces:
        for load in cfg.loads:
            rps = load * capacity
            trace = deadline_trace(cfg, kind, rps, cfg.seed)
            services = services_of(cfg, trace)
            trace = served(cfg.serve_classes, trace, services)
            for arm in cfg.schedulers:
                scheduler = arm.removesuffix(BLIND)
                plan = StepPlan(
                    scheduler,
                    cfg.round_steps,
                    cfg.max_wait_s,
                    cfg.max_parks_per_round,
                    urgent_parks=cfg.urgent_parks,
                    park_by_deadline=cfg.park_by_deadline,
                    keep_slot_while_reading=cfg.keep_slot_while_reading,
                    clock=cfg.step_clock,
                )
                router = Router("mask_aware", {(cfg.model_id, cfg.device): routing})
                sim = DeadlineClusterSimulation(
                    route,
                    truth,
                    router,
                    trace,
                    prerecorded,
                    services,
                    plan,
                    routing,
                    shed,
                    blind=arm != scheduler,
                    drift=DriftSpec(cfg.drift_cv, cfg.drift_tau_s),
                )
                sim.run()
                row = {"trace": kind, "load": load, "scheduler": arm, "rps": rps}
                row |= {"offered_rps": len(trace) / cfg.duration_s, "num_jobs": len(trace)}
                results.append(row | measure(cfg, sim, trace, services))
                # rows per step over every worker's steps (the worker bench's figure of the name)
                results[-1]["mean_batch_rows"] = float(np.mean(sim.batch_rows or [0]))
                if progress:
                    c = results[-1]["classes"]
                    progress(
                        f"{kind} load {load:.2f} ({rps:.2f} req/s) {arm}: attainment "
                        f"interactive {c['interactive']['attainment']:.1%} "
                        f"batch {c['batch']['attainment']:.1%}, "
                        f"P95 {c['interactive']['p95_latency_s']:.1f} / "
                        f"{c['batch']['p95_latency_s']:.1f} s, "
                        f"parks/job {results[-1]['parks_per_job']:.3f}"
                    )
    report = {
        "config": asdict(cfg),
        "capacity_rps": capacity,
        "capacity_bound_rps": capacity_rps(route, routing),
        "results": results,
    }
    report["comparison"] = comparison(report)
    report["targets"] = targets(report, cfg.max_wait_s, cfg.serve_classes)
    return report


def summarize_seeds(reports: list[dict]) -> dict:
    """Several seeds' reports (same arms, processes and loads) as one: every figure of a run the
    mean over seeds, except the longest waits (``max_*``: the max) and the starved jobs (the sum);
    then ``comparison`` and ``targets`` of those means, and ``targets_per_seed``."""
    if not reports:
        raise ValueError("no reports to summarize")
    keys = [[(r["trace"], r["load"], r["scheduler"]) for r in rep["results"]] for rep in reports]
    if any(k != keys[0] for k in keys):
        raise ValueError("reports to summarize must cover the same processes, loads and arms")

    def merge(values: list, key: str = ""):
        first = values[0]
        if isinstance(first, dict):
            return {k: merge([v[k] for v in values], k) for k in first}
        if isinstance(first, bool) or not isinstance(first, int | float) or key == "load":
            return first
        if key.startswith("max_"):
            return max(values)
        return sum(values) if key == "starved_jobs" else float(np.mean(values))

    summary = {
        "config": reports[0]["config"],
        "seeds": [rep["config"]["seed"] for rep in reports],
        "capacity_rps": float(np.mean([rep["capacity_rps"] for rep in reports])),
        "capacity_bound_rps": reports[0]["capacity_bound_rps"],
        "results": [merge(list(runs)) for runs in zip(*(rep["results"] for rep in reports))],
        "targets_per_seed": {str(rep["config"]["seed"]): rep["targets"] for rep in reports},
    }
    summary["comparison"] = comparison(summary)
    config = reports[0]["config"]
    summary["targets"] = targets(summary, config["max_wait_s"], tuple(config["serve_classes"]))
    return summary


def comparison(report: dict) -> list[dict]:
    """Per (process, load), each other arm against ``fifo``: interactive and batch attainment
    (points), P95 per class (ratio), batch throughput (ratio). Runs that carry a ``repeat``
    (the worker bench's) are paired with fifo's run of the same repeat, and say which."""
    by = {(r["trace"], r["load"], r["scheduler"], r.get("repeat")): r for r in report["results"]}
    out = []
    for (kind, load, arm, repeat), r in by.items():
        base = by.get((kind, load, "fifo", repeat))
        if arm == "fifo" or base is None:
            continue
        c, b = r["classes"], base["classes"]
        out.append(
            ({} if repeat is None else {"repeat": repeat})
            | {
                "trace": kind,
                "load": load,
                "scheduler": arm,
                "interactive_points": 100
                * (c["interactive"]["attainment"] - b["interactive"]["attainment"]),
                "batch_points": 100 * (c["batch"]["attainment"] - b["batch"]["attainment"]),
                "interactive_p95_ratio": _ratio(
                    c["interactive"]["p95_latency_s"], b["interactive"]["p95_latency_s"]
                ),
                "batch_p95_ratio": _ratio(c["batch"]["p95_latency_s"], b["batch"]["p95_latency_s"]),
                "batch_throughput_ratio": _ratio(
                    c["batch"]["throughput_rps"], b["batch"]["throughput_rps"]
                ),
            }
        )
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def targets(report: dict, max_wait_s: float, serve_classes: tuple[str, ...] = CLASSES) -> dict:
    """The issue's targets for the full scheduler (``slack``) at loads in ``TARGET_LOADS``, per
    process: interactive attainment >= 30 points above FIFO, batch throughput within 5% of FIFO,
    no job waiting past the starvation bound. Each: met, and the worst value measured. None ({})
    for runs that served only some classes (``serve_classes``): those are references."""
    if set(serve_classes) != set(CLASSES):
        return {}
    lo, hi = TARGET_LOADS
    rows = [c for c in report["comparison"] if c["scheduler"] == "slack" and lo <= c["load"] <= hi]
    runs = [r for r in report["results"] if r["scheduler"] == "slack" and lo <= r["load"] <= hi]
    out: dict[str, dict] = {}
    for kind in sorted({r["trace"] for r in rows}):
        mine = [c for c in rows if c["trace"] == kind]
        mine_runs = [r for r in runs if r["trace"] == kind]
        gain = min(c["interactive_points"] for c in mine)
        tput = min(c["batch_throughput_ratio"] for c in mine)
        wait = max(r["max_wait_s"] for r in mine_runs)
        out[kind] = {
            "interactive_points_min": gain,
            "interactive_30_points": gain >= 30.0,
            "batch_throughput_ratio_min": tput,
            "batch_throughput_within_5pct": tput >= 0.95,
            "max_wait_s": wait,
            "starved_jobs": sum(r["starved_jobs"] for r in mine_runs),
            "no_job_starved": all(r["starved_jobs"] == 0 for r in mine_runs),
        }
    return out


def table(report: dict) -> str:
    """The report as Markdown, one table per arrival process; a cell "a / b / c" holds the
    schedulers' values in the report's order (fifo / edf / slack by default)."""
    arms = list(dict.fromkeys(r["scheduler"] for r in report["results"]))
    by = {(r["trace"], r["load"], r["scheduler"]): r for r in report["results"]}
    cmp = {(c["trace"], c["load"], c["scheduler"]): c for c in report["comparison"]}
    last = "slack" if "slack" in arms else arms[-1]
    vs = f"{last} vs fifo" if last != "fifo" and "fifo" in arms else ""
    names = " / ".join(arms)
    head = [
        "load",
        f"interactive SLO ({names})",
        *([f"interactive {vs} (points)"] if vs else []),
        f"batch SLO ({names})",
        f"interactive P95 s ({names})",
        f"batch P95 s ({names})",
        *([f"interactive P95 {vs}", f"batch throughput {vs}"] if vs else []),
        f"parks/job ({names})",
        f"max batch wait s ({names})",
        f"batch 429 ({names})",
    ]
    lines = []
    for kind in dict.fromkeys(r["trace"] for r in report["results"]):
        lines += [f"**{kind}**", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for load in sorted({r["load"] for r in report["results"] if r["trace"] == kind}):
            rs = [by[(kind, load, a)] for a in arms]

            def each(fmt, get, rs=rs):
                return " / ".join(fmt.format(get(r)) for r in rs)

            cells = [
                f"{load:g}",
                each("{}", lambda r: shown_attainment(r["classes"]["interactive"])),
            ]
            c = cmp.get((kind, load, last))
            if vs:
                cells.append(f"{c['interactive_points']:+.0f}" if c else "")
            cells += [
                each("{}", lambda r: shown_attainment(r["classes"]["batch"])),
                each("{:.1f}", lambda r: r["classes"]["interactive"]["p95_latency_s"]),
                each("{:.1f}", lambda r: r["classes"]["batch"]["p95_latency_s"]),
            ]
            if vs:
                cells += (
                    [f"x{c['interactive_p95_ratio']:.2f}", f"x{c['batch_throughput_ratio']:.3f}"]
                    if c
                    else ["", ""]
                )
            cells += [
                each("{:.3f}", lambda r: r["parks_per_job"]),
                each("{:.0f}", lambda r: r["max_batch_wait_s"]),
                each("{:.1%}", lambda r: r["classes"]["batch"]["shed_rate"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_outputs(report: dict, json_path: Path) -> Path:
    """The report as JSON at ``json_path`` and a plot beside it (.png): SLO attainment against load
    per scheduler, one panel per (process, class served); returns the plot's path."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["trace"] for r in report["results"]))
    arms = list(dict.fromkeys(r["scheduler"] for r in report["results"]))
    # a class no run served (``serve_classes``) gets no panel
    served = [c for c in CLASSES if any(r["classes"][c]["accepted"] for r in report["results"])]
    fig, axes = plt.subplots(
        len(kinds),
        len(served),
        figsize=(5 * len(served), 3.6 * len(kinds)),
        squeeze=False,
        sharey=True,
    )
    for row, kind in enumerate(kinds):
        for col, cls in enumerate(served):
            ax = axes[row][col]
            for arm in arms:
                rs = sorted(
                    (
                        r
                        for r in report["results"]
                        if r["trace"] == kind
                        and r["scheduler"] == arm
                        and r["classes"][cls]["accepted"]  # a class not served has no curve
                    ),
                    key=lambda r: r["load"],
                )
                ax.plot(
                    [r["load"] for r in rs],
                    [100 * r["classes"][cls]["attainment"] for r in rs],
                    marker="o",
                    label=arm,
                )
            ax.set_title(f"{kind}: {cls}", fontsize=10)
            ax.set_xlabel(f"load (fraction of {report['capacity_rps']:.2f} req/s)")
            ax.set_ylabel("SLO attainment (%)")
            ax.set_ylim(0, 102)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    c = report["config"]
    title = (
        f"{c['model_id']}: {c['num_workers']} workers x batch {c['max_batch']}, "
        f"{c['interactive_share']:.0%} interactive (target {c['interactive_target_s']:g} s), "
        f"batch target {c['batch_target_s']:g} s; "
        f"bursts {c['burst_factor']:g}x the mean rate for {c['burst_s']:g} s"
        + (f"; mean of seeds {seed_span(report['seeds'])}" if "seeds" in report else "")
    )
    # about 11 characters of 10 pt text to the inch: the title fits the figure's width
    fig.suptitle("\n".join(textwrap.wrap(title, int(11 * fig.get_figwidth()))), fontsize=10)
    return save_beside(fig, json_path)


def save_beside(fig, json_path: Path) -> Path:
    """``fig`` laid out, written as a PNG beside ``json_path`` (same name) and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    plot = json_path.with_suffix(".png")
    fig.savefig(plot, dpi=110)
    plt.close(fig)
    return plot

"""`maskserve bench route`: routing policies side by side in a discrete-event cluster simulation.

Pure Python (numpy and matplotlib only): no model runs. The fitted cost profile of one model is
the ground truth of time:

* N workers (default 8), each running the serving worker's own scheduler, admission rules and
  cache manager on simulated time (``backend.bench.route_sim``): step-level continuous batching
  (max batch 8), prefetch-gated admission (a row whose read is in flight keeps its place while
  rows behind it take free slots, so no read stalls a batch), one recording per template and
  worker. A step takes the exact Algorithm-1 plan latency (``plan.solve_plan`` over
  ``costs.batch_unit_costs``) of the batch's rows, times a lognormal noise factor (``noise_cv``:
  the fitted lines are not exact, and the router only sees the fit) and, with ``step_shape``, by
  a measured machine's growth of a step with its rows (``backend.bench.step_shape``).
* Templates: a shared disk tier (one host's cache directory) holds a random ``prerecorded``
  fraction of the templates at the start; every worker has an LRU RAM tier of ``ram_templates``
  entries (fewer than the trace uses). A read from disk takes ``disk_read_s_per_byte`` per byte of
  the template's trajectory cache, one read at a time per worker; a template on no disk is
  recorded by the row that finds it missing, published on the shared disk when that row finishes
  and read into the recorder's RAM.
* Arrivals: ``trace.poisson_trace`` (bursty Poisson, Zipf templates, Beta mask ratios with the
  production mean 0.11), its nominal rate corrected so that the trace offers the intended rate
  (``offered_trace``). Every policy replays the identical trace at each load level, a fraction of
  the capacity: the measured saturation throughput (``saturation_rps``: the cluster overloaded,
  deep queues, so prefetches hide most disk reads; an optimistic capacity) or, without
  ``calibrate``, the bound ``workers * max_batch / (steps * T(full batch at the mean mask))``.
* The router sees every worker's live state at each arrival (what heartbeats plus its own
  dispatch log give a real router).

Latency = arrival -> last denoising step (pre/post-processing run elsewhere and are the same for
every policy). Every run starts cold (empty RAM tiers, a fifth of the templates never recorded), and
while it warms its capacity is well below the steady capacity that ``saturation_rps`` measures after
the same warm-up: at 0.95 of it the first minutes are an overload whose backlog takes most of a
1800 s run to drain. So the latency statistics, like the capacity, count the jobs that arrive after
the warm-up (``warmup_fraction`` of the run, a quarter; every job is still simulated, for every
policy alike); ``p95_all_latency_s`` keeps the P95 over every job, cold start included. Reported per
policy and load: average, P50, P95 latency, throughput, queueing (arrival -> admission), cache
outcomes, decision time; and the P95 reduction of mask_aware vs each baseline.
``decision_time`` times ``Router.choose`` alone on fresh random 8x8 clusters.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from backend.bench.route_sim import ClusterSimulation
from backend.bench.trace import mask_ratios, poisson_trace, zipf_weights
from backend.costmodel import profiles
from backend.costmodel.costs import CostProfile, RowWork, batch_unit_costs
from backend.dispatch.router import (
    POLICIES,
    AdapterNeed,
    JobRequest,
    Router,
    RoutingCostModel,
    RowState,
    WorkerView,
    default_rows_per_request,
)
from backend.worker.stats import percentile

BASELINES = tuple(p for p in POLICIES if p != "mask_aware")
# mask_aware with the router shown no adapters (its adapter term off): the simulation's ablation
ADAPTER_BLIND = "mask_aware_no_adapters"


@dataclass
class RouteBenchConfig:
    model_id: str = "small-flux-fill"
    device: str = "cpu"
    mode: str = "kv"
    profiles_dir: str = "profiles"
    policies: tuple[str, ...] = POLICIES
    loads: tuple[float, ...] = (0.5, 0.65, 0.8, 0.95)  # fractions of the capacity
    calibrate: bool = True  # capacity = measured saturation throughput (else the all-in-RAM bound)
    duration_s: float = 600.0  # simulated seconds of arrivals per load level
    num_workers: int = 8
    max_batch: int = 8
    steps: int = 20
    num_templates: int = 200
    ram_templates: int = 8  # per worker
    prerecorded: float = 0.8  # fraction of templates already on disk at the start
    zipf_exponent: float = 1.1
    mask_mean: float = 0.11
    burst_factor: float = 2.0
    disk_read_s_per_byte: float = 1e-9
    noise_cv: float = 0.05
    # a measured machine's steps (``step_shape``): factor i-1 multiplies the profile's latency of
    # a step of i rows (the last one beyond); () = the profile's own growth with rows
    step_shape: tuple[float, ...] = ()
    # > 0: loads are fractions of this rate instead of a measured capacity
    capacity_rps: float = 0.0
    # what-if: the profile's cache-load slope times this (a slower host -> device path)
    load_scale: float = 1.0
    # what-if, > 0: set load_scale so that a mean-mask request's loads = this x its compute
    load_ratio: float = 0.0
    # the dispatcher holds a job until a worker has slack (else queues it at once)
    late_binding: bool = False
    queue_depth: int = 0  # with late_binding: waiting rows a worker may hold beyond max_batch
    warmup_fraction: float = 0.25  # latency statistics over arrivals after this share of the run
    seed: int = 0
    # LoRA adapters (0: none, the scenario as before): each request draws 0..adapters_per_request
    # (uniform) distinct adapters by Zipf popularity; adapter i has rank 8, 16, 32 or 64 (seeded)
    # and adapter_mb_per_rank MiB per rank
    num_adapters: int = 0
    adapters_per_request: int = 3
    adapter_zipf: float = 1.1
    adapter_mb_per_rank: float = 4.0  # rank 64: 256 MiB, rank 8: 32 MiB
    adapter_device_mb: int = 1024  # per worker, as adapters.device_mb
    adapter_host_mb: int = 4096  # per worker, as adapters.host_mb
    adapter_policy: str = "lfu"
    adapter_join_by: float = 0.2  # as adapters.join_by
    adapter_read_gbps: float = 1.0  # registry -> host RAM
    adapter_copy_gbps: float = 0.0  # host -> device; 0: the profile's fitted cache-load slope


@dataclass
class PolicyResult:
    policy: str
    load: float
    rps: float
    num_jobs: int
    completed: int
    avg_latency_s: float
    p50_latency_s: float
    p95_latency_s: float
    throughput_rps: float
    avg_queue_s: float
    mean_batch_rows: float
    # ram_hits, disk_reads, dense_rows (recordings), held (row-steps a row was held, slot free)
    cache: dict = field(default_factory=dict)
    decision_ms: dict = field(default_factory=dict)  # p50, p95 of Router.choose in this run
    measured_jobs: int = 0  # the jobs arriving after the warm-up (the latency statistics' sample)
    p95_all_latency_s: float = 0.0  # P95 over every job, the cold start included


def load_profile(cfg: RouteBenchConfig) -> CostProfile:
    """The measured profile ``cfg`` names, as fitted (no what-if applied)."""
    return profiles.load_profile(cfg.profiles_dir, cfg.model_id, cfg.device, cfg.mode)


def load_compute_ratio(profile: CostProfile, mask_ratio: float) -> float:
    """Seconds one request of ``mask_ratio`` spends copying its template's cache of every unit,
    over its compute with the cache: what sequential loading adds to an edit, as a fraction."""
    rows = [RowWork(mask_ratio, "t")] * default_rows_per_request(profile.model_id)
    costs = batch_unit_costs(profile, rows)
    return sum(c.load_s for c in costs) / sum(c.compute_cached_s for c in costs)


def _scaled_loads(profile: CostProfile, scale: float) -> CostProfile:
    return replace(profile, load=replace(profile.load, slope=profile.load.slope * scale))


def load_scale_for_ratio(profile: CostProfile, ratio: float, mask_ratio: float) -> float:
    """The multiplier of the profile's load slope at which ``load_compute_ratio`` is ``ratio``
    (found by bisection: the ratio grows with the slope, piecewise linearly where a fitted
    intercept clamps a unit's load at 0). FlashPS (section 2.3, Fig. 4-left) measured sequential
    loading adding 102% to an SDXL edit on an H800 over PCIe Gen5: ``ratio`` 1.02 puts a CPU
    profile in that regime."""
    if not ratio > 0:
        raise ValueError(f"load_ratio must be > 0, got {ratio}")
    unreachable = ValueError(
        f"load_ratio {ratio} is not reachable by scaling the load slope of "
        f"{profile.model_id} at mask ratio {mask_ratio}"
    )
    if not profile.load.slope > 0 or ratio <= load_compute_ratio(
        _scaled_loads(profile, 0.0), mask_ratio
    ):
        raise unreachable
    lo, hi = 0.0, 1.0
    # a request that reads no cache (mask ratio 1, no cached unit) never gets there
    for _ in range(200):
        if load_compute_ratio(_scaled_loads(profile, hi), mask_ratio) >= ratio:
            break
        lo, hi = hi, hi * 2
    else:
        raise unreachable
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (
            (mid, hi)
            if load_compute_ratio(_scaled_loads(profile, mid), mask_ratio) < ratio
            else (lo, mid)
        )
    return hi


def cost_model_for(cfg: RouteBenchConfig, planner: str = "greedy") -> RoutingCostModel:
    """The cost model of ``cfg``'s profile, with the load what-if (``load_ratio`` or
    ``load_scale``) applied: a what-if, not a measured device, stated as such wherever reported."""
    profile = load_profile(cfg)
    scale = cfg.load_scale
    if cfg.load_ratio:
        if scale != 1.0:
            raise ValueError("give load_ratio or load_scale, not both")
        scale = load_scale_for_ratio(profile, cfg.load_ratio, cfg.mask_mean)
    if scale != 1.0:
        if not scale > 0:
            raise ValueError(f"load_scale must be > 0, got {scale}")
        profile = _scaled_loads(profile, scale)
    return RoutingCostModel.from_profile(
        profile,
        disk_read_s_per_byte=cfg.disk_read_s_per_byte,
        planner=planner,
        adapter_read_s_per_byte=1e-9 / cfg.adapter_read_gbps,
        adapter_copy_s_per_byte=1e-9 / cfg.adapter_copy_gbps if cfg.adapter_copy_gbps else None,
        adapter_join_by=cfg.adapter_join_by,
    )


def adapter_sizes(cfg: RouteBenchConfig) -> list[int]:
    """Bytes of each adapter of the catalogue (rank 8, 16, 32 or 64, seeded)."""
    rng = np.random.default_rng([cfg.seed, 17])
    ranks = rng.choice([8, 16, 32, 64], size=cfg.num_adapters)
    return [int(r * cfg.adapter_mb_per_rank * (1 << 20)) for r in ranks]


def request_adapters(cfg: RouteBenchConfig, trace) -> dict[int, tuple[AdapterNeed, ...]]:
    """Each request's adapters (index -> (sha, bytes) ...): 0 to ``adapters_per_request``
    (uniform) distinct ones drawn by Zipf popularity, the same for every policy."""
    sizes, weights = adapter_sizes(cfg), zipf_weights(cfg.num_adapters, cfg.adapter_zipf)
    rng = np.random.default_rng([cfg.seed, 23])
    out = {}
    for req in trace:
        count = min(int(rng.integers(0, cfg.adapters_per_request + 1)), cfg.num_adapters)
        picks = rng.choice(cfg.num_adapters, size=count, replace=False, p=weights)
        out[req.index] = tuple(AdapterNeed(f"lora{i}", sizes[i]) for i in picks)
    return out


def capacity_rps(cfg: RouteBenchConfig, model: RoutingCostModel) -> float:
    """Jobs per second of the cluster with full batches of mean-mask rows, all templates in RAM
    (an upper bound: disk reads and recordings are not counted)."""
    full = [(cfg.mask_mean, f"cap{i}", True) for i in range(cfg.max_batch)]
    return cfg.num_workers * cfg.max_batch / (cfg.steps * model.step_latency(full))


def saturation_rps(
    cfg: RouteBenchConfig, truth: RoutingCostModel, routing: RoutingCostModel, prerecorded: set[str]
) -> float:
    """Measured capacity: completions per second while the cluster is overloaded (arrivals at 1.5x
    ``capacity_rps`` for ``duration_s``, fewest_requests routing, the first quarter as warm-up):
    what the cluster sustains with this trace's disk reads and recordings."""
    trace = offered_trace(cfg, 1.5 * capacity_rps(cfg, routing), cfg.seed + 1)
    sim = ClusterSimulation(cfg, truth, Router("fewest_requests"), trace, prerecorded)
    sim.run()
    start = cfg.duration_s / 4
    done = sum(1 for t in sim.done_at.values() if start <= t < cfg.duration_s)
    return done / (cfg.duration_s - start)


def offered_trace(cfg: RouteBenchConfig, rps: float, seed: int) -> list:
    """A ``poisson_trace`` whose realised arrival rate is ``rps`` (within 1%): with bursts the
    trace's nominal rate is not its mean (rate * f and rate / f alternate), so the nominal rate is
    corrected until the trace offers the intended load."""
    nominal = rps
    for _ in range(6):
        trace = poisson_trace(
            nominal,
            cfg.duration_s,
            cfg.num_templates,
            cfg.mask_mean,
            seed=seed,
            zipf_exponent=cfg.zipf_exponent,
            burst_factor=cfg.burst_factor,
        )
        realised = len(trace) / cfg.duration_s
        if not trace or abs(realised - rps) <= 0.01 * rps:
            break
        nominal *= rps / realised
    return trace


def _summary(values: list[float], q: float) -> float:
    return float(percentile(values, q)) if values else 0.0


def run_route_bench(cfg: RouteBenchConfig, progress=None) -> dict:
    """Every policy on the identical trace per load level. Returns a JSON-ready report:
    ``{"config", "capacity_rps", "capacity_bound_rps", "results": [PolicyResult as dict],
    "p95_reduction": {load: {baseline: frac}}, "p95_all_reduction": the same over every job}``.
    ``progress``: optional callable(str) told about each finished run."""
    unknown = set(cfg.policies) - set(POLICIES) - {ADAPTER_BLIND}
    if unknown:
        raise ValueError(
            f"unknown routing policies {sorted(unknown)}; expected some of {', '.join(POLICIES)}"
        )
    truth, routing = cost_model_for(cfg, "exact"), cost_model_for(cfg)
    rng = np.random.default_rng([cfg.seed, 99])
    prerecorded = {f"tpl{i}" for i in range(cfg.num_templates) if rng.random() < cfg.prerecorded}
    bound = capacity_rps(cfg, routing)
    capacity = (
        cfg.capacity_rps
        if cfg.capacity_rps > 0
        else saturation_rps(cfg, truth, routing, prerecorded)
        if cfg.calibrate
        else bound
    )
    results: list[PolicyResult] = []
    for load in cfg.loads:
        rps = load * capacity
        trace = offered_trace(cfg, rps, cfg.seed)
        for policy in cfg.policies:
            router = Router(
                "mask_aware" if policy == ADAPTER_BLIND else policy,
                {(cfg.model_id, cfg.device): routing},
                allow_queueing=not cfg.late_binding,
                queue_depth=cfg.queue_depth if cfg.late_binding else 0,
            )
            sim = ClusterSimulation(
                cfg, truth, router, trace, prerecorded, adapter_blind=policy == ADAPTER_BLIND
            )
            sim.run()
            every = [sim.done_at[r.index] - r.arrival_s for r in trace if r.index in sim.done_at]
            warm = cfg.warmup_fraction * cfg.duration_s
            lat = [
                sim.done_at[r.index] - r.arrival_s
                for r in trace
                if r.index in sim.done_at and r.arrival_s >= warm
            ]
            span = (max(sim.done_at.values()) - trace[0].arrival_s) if sim.done_at else 0.0
            ms = [d * 1e3 for d in sim.decisions]
            results.append(
                PolicyResult(
                    policy,
                    load,
                    rps,
                    len(trace),
                    len(sim.done_at),
                    float(np.mean(lat)) if lat else 0.0,
                    _summary(lat, 50),
                    _summary(lat, 95),
                    len(sim.done_at) / span if span > 0 else 0.0,
                    float(np.mean(sim.queue_s)) if sim.queue_s else 0.0,
                    float(np.mean(sim.batch_rows)) if sim.batch_rows else 0.0,
                    dict(sim.counts),
                    {"p50": _summary(ms, 50), "p95": _summary(ms, 95)},
                    len(lat),
                    _summary(every, 95),
                )
            )
            if progress:
                r = results[-1]
                progress(
                    f"load {load:.2f} ({rps:.2f} req/s) {policy}: P95 {r.p95_latency_s:.2f} s "
                    f"(every job: {r.p95_all_latency_s:.2f} s), avg {r.avg_latency_s:.2f} s, "
                    f"{r.completed}/{r.num_jobs} jobs"
                )
    return {
        "config": asdict(cfg),
        "capacity_rps": capacity,
        "capacity_bound_rps": bound,
        "load_compute_ratio": load_compute_ratio(routing.profile, cfg.mask_mean),
        "results": [asdict(r) for r in results],
        "p95_reduction": p95_reduction(results),
        "p95_all_reduction": p95_reduction(results, "p95_all_latency_s"),
    }


def p95_reduction(
    results: list[PolicyResult], metric: str = "p95_latency_s"
) -> dict[str, dict[str, float]]:
    """Per load: (P95 of baseline - P95 of mask_aware) / P95 of baseline, for every baseline run
    (``metric``: ``p95_latency_s``, after the warm-up, or ``p95_all_latency_s``, every job)."""
    out: dict[str, dict[str, float]] = {}
    by = {(r.policy, r.load): r for r in results}
    for (policy, load), ours in by.items():
        if policy != "mask_aware":
            continue
        mine = getattr(ours, metric)
        out[f"{load:g}"] = {
            b: (getattr(by[(b, load)], metric) - mine) / getattr(by[(b, load)], metric)
            for b in BASELINES
            if (b, load) in by and getattr(by[(b, load)], metric) > 0
        }
    return out


def summarize_seeds(reports: list[dict]) -> dict:
    """Several seeds' ``run_route_bench`` reports (same policies and loads) as one report: per load
    and policy the mean over seeds of the rate, average and P95 latency (``results``, so
    ``write_outputs`` plots the means), and per load the P95 cut of mask_aware against each other
    policy and against the best other one of each seed (``cuts``: mean, min, max over seeds of
    (P95 other - P95 mask_aware) / P95 other)."""
    if not reports:
        raise ValueError("no reports to summarize")
    keys = [[(r["load"], r["policy"]) for r in rep["results"]] for rep in reports]
    if any(k != keys[0] for k in keys):
        raise ValueError("reports to summarize must cover the same loads and policies")
    by_seed = [{(r["load"], r["policy"]): r for r in rep["results"]} for rep in reports]
    results = [
        {
            "load": load,
            "policy": policy,
            **{
                f: float(np.mean([b[(load, policy)][f] for b in by_seed]))
                for f in ("rps", "avg_latency_s", "p95_latency_s", "p95_all_latency_s")
            },
        }
        for load, policy in keys[0]
    ]
    cuts: dict[str, dict[str, dict[str, float]]] = {}
    loads = sorted({load for load, _ in keys[0]})
    others = [p for p in dict.fromkeys(p for _, p in keys[0]) if p != "mask_aware"]
    if "mask_aware" in {p for _, p in keys[0]} and others:
        for load in loads:
            per: dict[str, list[float]] = {p: [] for p in (*others, "best_other")}
            for b in by_seed:
                mine = b[(load, "mask_aware")]["p95_latency_s"]
                for p in others:
                    per[p].append(1 - mine / b[(load, p)]["p95_latency_s"])
                per["best_other"].append(
                    1 - mine / min(b[(load, p)]["p95_latency_s"] for p in others)
                )
            cuts[f"{load:g}"] = {
                p: {"mean": float(np.mean(v)), "min": min(v), "max": max(v)} for p, v in per.items()
            }
    return {
        "seeds": [rep["config"]["seed"] for rep in reports],
        "capacity_rps": float(np.mean([rep["capacity_rps"] for rep in reports])),
        "load_compute_ratio": reports[0].get("load_compute_ratio"),
        "results": results,
        "cuts": cuts,
    }


def summary_table(summary: dict) -> str:
    """The summary as a Markdown table: mean P95 (s) per policy, mask_aware's mean P95 cut (and
    its range over seeds) against the best other policy, then its mean cut against each other."""
    policies = list(dict.fromkeys(r["policy"] for r in summary["results"]))
    others = [p for p in policies if p != "mask_aware"] if summary["cuts"] else []
    head = ["load (req/s)", *policies] + (
        ["cut vs best other", *(f"vs {p}" for p in others)] if others else []
    )
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for load in sorted({r["load"] for r in summary["results"]}):
        rows = {r["policy"]: r for r in summary["results"] if r["load"] == load}
        p95 = {p: rows[p]["p95_latency_s"] for p in policies}
        best = min(p95.values())
        cells = [f"{load:g} ({rows[policies[0]]['rps']:.2f})"]
        cells += [f"**{p95[p]:.1f}**" if p95[p] == best else f"{p95[p]:.1f}" for p in policies]
        if others:
            cut = summary["cuts"][f"{load:g}"]
            b = cut["best_other"]
            cells.append(f"{b['mean']:.0%} ({b['min']:.0%} to {b['max']:.0%})")
            cells += [f"{cut[p]['mean']:.0%}" for p in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decision_time(
    cost_model: RoutingCostModel,
    policy: str = "mask_aware",
    num_workers: int = 8,
    rows_per_worker: int = 8,
    max_batch: int = 8,
    decisions: int = 2000,
    seed: int = 0,
) -> dict:
    """p50 / p95 / mean milliseconds of ``Router.choose`` (time.perf_counter around the call only).

    Every decision sees a fresh random cluster (no memo carries over between views): each worker
    has ``rows_per_worker`` rows (a random half or more running, the rest waiting), Beta mask
    ratios with mean 0.11, Zipf templates, 8 in RAM and 3/4 of 64 on disk."""
    rng = np.random.default_rng(seed)
    router = Router(policy, {(cost_model.model_id, cost_model.device): cost_model})
    weights = zipf_weights(64, 1.1)
    cases = []
    for d in range(decisions):
        masks = mask_ratios(rng, num_workers * rows_per_worker + 1, 0.11)
        tpls = rng.choice(64, size=num_workers * (rows_per_worker + 8) + 1, p=weights)
        views = []
        for w in range(num_workers):
            rows = [
                RowState(
                    f"{d}.{w}.{i}",
                    float(masks[w * rows_per_worker + i]),
                    int(rng.integers(1, 21)),
                    f"tpl{tpls[w * rows_per_worker + i]}",
                )
                for i in range(rows_per_worker)
            ]
            n_run = int(rng.integers(rows_per_worker // 2, min(rows_per_worker, max_batch) + 1))
            ram = frozenset(f"tpl{t}" for t in tpls[num_workers * rows_per_worker + w * 8 :][:8])
            views.append(
                WorkerView(
                    f"w{w:02d}",
                    cost_model.model_id,
                    cost_model.device,
                    max_batch,
                    tuple(rows[:n_run]),
                    tuple(rows[n_run:]),
                    ram,
                    frozenset(f"tpl{t}" for t in range(48)),
                )
            )
        cases.append(
            (
                JobRequest(f"j{d}", cost_model.model_id, float(masks[-1]), 20, f"tpl{tpls[-1]}"),
                views,
            )
        )
    times = []
    gc.collect()  # the cases above are many small objects: start the timing with a clean heap
    for job, views in cases:
        started = time.perf_counter()
        router.choose(job, views)
        times.append((time.perf_counter() - started) * 1e3)
    return {
        "policy": policy,
        "workers": num_workers,
        "rows_per_worker": rows_per_worker,
        "decisions": decisions,
        "p50_ms": percentile(times, 50),
        "p95_ms": percentile(times, 95),
        "mean_ms": float(np.mean(times)),
        "max_ms": max(times),
    }


def write_outputs(cfg: RouteBenchConfig, report: dict, json_path: Path) -> Path:
    """The report as JSON at ``json_path`` and a plot (average and P95 latency vs load per policy)
    next to it as PNG; returns the plot's path."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for policy in cfg.policies:
        rows = sorted(
            (r for r in report["results"] if r["policy"] == policy), key=lambda r: r["load"]
        )
        loads = [r["load"] for r in rows]
        axes[0].plot(loads, [r["avg_latency_s"] for r in rows], marker="o", label=policy)
        axes[1].plot(loads, [r["p95_latency_s"] for r in rows], marker="o", label=policy)
    for ax, name in zip(axes, ("average", "P95")):
        ax.set_xlabel(f"load (fraction of {report['capacity_rps']:.2f} req/s)")
        ax.set_ylabel(f"{name} latency (s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    what_if = (
        "\nwhat-if, not a measured device: cache loads "
        f"{report['load_compute_ratio']:.2f}x a mean-mask request's compute"
        if cfg.load_ratio or cfg.load_scale != 1.0
        else ""
    )
    fig.suptitle(
        f"{cfg.model_id}: {cfg.num_workers} workers x batch {cfg.max_batch}, "
        f"mask mean {cfg.mask_mean}, burst x{cfg.burst_factor:g}, {cfg.num_templates} templates, "
        f"{cfg.ram_templates} in RAM per worker" + what_if
    )
    fig.tight_layout()
    plot = json_path.with_suffix(".png")
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    return plot

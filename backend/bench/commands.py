"""`maskserve bench ...`: the benchmark commands (engine, launch-proxy, batch-ops, demo, worker,
worker-deadlines, route, route-deadlines, soak, crop, serve, adapter-quality) and their arguments.

Each command imports its benchmark module only when it runs, so `maskserve --help` stays light.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from backend.bench.adapter_bench_cli import add_adapters_parser  # light: argparse only
from backend.bench.adapter_quality_cli import add_adapter_quality_parser  # light: argparse only
from backend.bench.crop_bench import add_crop_parser  # light: numpy only
from backend.bench.route_deadlines_cli import add_route_deadlines_parser  # light: argparse only
from backend.bench.serve_cli import add_serve_parser  # light: argparse only
from backend.bench.serve_deadlines import add_serve_deadlines_parser  # light: the stack lazily
from backend.bench.step_launches_cli import add_step_launches_parser  # light: argparse only
from backend.bench.worker_deadlines_cli import add_worker_deadlines_parser  # light: argparse only
from backend.config import Settings
from backend.dispatch.router import POLICIES as ROUTING_POLICIES
from backend.models.catalog import DEFAULT_MODEL


def cmd_bench_engine(args, settings: Settings) -> int:
    from backend.bench.engine_arms import FRESH_PROCESS_ARM, arm_names
    from backend.bench.engine_bench import run_engine_bench, write_outputs
    from backend.engine.factory import DTYPES

    arms = arm_names(args.arms)
    if args.fresh_process_baseline and FRESH_PROCESS_ARM not in arms:
        arms.append(FRESH_PROCESS_ARM)
    batches = request_counts(args.batch, "--batch")
    if args.fresh_process_baseline and args.in_memory:
        raise ValueError("--fresh-process-baseline loads a saved model directory: not --in-memory")
    ratios = [float(r) for r in args.mask_ratios.split(",")]
    partial = Path(args.json).with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    report = run_engine_bench(
        args.model,
        ratios,
        args.steps,
        settings.paths.resolved_models_dir(),
        settings.paths.resolved_cache_dir(),
        modes=tuple(args.modes.split(",")),
        repeats=args.repeats,
        resolution=args.size,
        device=settings.engine.device,
        dtype=DTYPES[settings.engine.dtype],
        in_memory=args.in_memory,
        arms=tuple(arms),
        batches=tuple(batches),
        compile_mode=args.compile_mode,
        partial_json=partial,
    )
    plot = write_outputs(report, Path(args.json))
    partial.unlink(missing_ok=True)
    for name, meta in report.arms.items():
        check = meta.get("compile_check")
        if check:
            verdict = "ok" if check["within_tolerance"] else "OVER"
            print(
                f"{name}: built in {meta['build_s']:.1f}s, warm-up {meta['warmup_s']} s; "
                f"{check['compared']} vs eager max |diff| {check['max_abs_difference']:.3g} (bound "
                f"{check['tolerance']:.3g}) {verdict}"
            )

    def times(value: float | None) -> str:
        return "    -" if value is None else f"{value:5.2f}x"

    for r in report.records:
        print(
            f"{r.model:18s} m={r.mask_ratio:<5} B={r.batch:<2} {r.arm:22s} {r.mode:6s} "
            f"{r.edit_s:7.3f}s  step {r.step_s * 1000:8.2f} ms  {r.edits_per_s:7.3f} edits/s  "
            f"vs ordinary {times(r.speedup)}  vs compiled {times(r.speedup_vs_compiled)}  "
            f"(ideal {r.ideal_speedup:5.2f}x)"
            + (f"  ssim {r.ssim:.3f} psnr {r.psnr:.1f}" if r.ssim is not None else "")
            + (f"  peak GPU {r.peak_gpu_bytes / 2**30:.2f} GiB" if r.peak_gpu_bytes else "")
        )
    print(f"wrote {args.json} and {plot}")
    return 0


def cmd_bench_launch_proxy(args, settings: Settings) -> int:
    from backend.bench.launch_proxy import run_launch_proxy, write_launch_proxy

    if args.repeats < 1:
        raise ValueError(f"--repeats: at least 1, got {args.repeats}")
    (rows,) = request_counts(str(args.rows), "--rows")
    records = run_launch_proxy(
        tuple(args.models.split(",")),
        settings.paths.resolved_models_dir(),
        settings.paths.resolved_cache_dir() / "launch-proxy",
        size=args.size,
        rows=rows,
        repeats=args.repeats,
        mask_ratio=args.mask_ratio,
        compile_mode=args.compile_mode,
    )
    plot = write_launch_proxy(records, Path(args.json))
    for r in records:
        print(
            f"{r.model:18s} {r.size} px {r.rows} rows: ordinary forward eager {r.eager_ms:.2f} ms "
            f"({r.eager_operators} operators launched), compiled {r.compiled_ms:.2f} ms "
            f"({r.compiled_operators}): {r.speedup:.2f}x, max |diff| {r.max_abs_difference:.2g}, "
            f"compiled in {r.compile_s:.0f} s; mask-aware step (m={r.mask_ratio}) eager exact "
            f"{r.maskaware_step_ms:.2f} ms ({r.maskaware_operators}), eager bucketed "
            f"{r.bucketed_step_ms:.2f} ms ({r.bucketed_operators}), compiled "
            f"{r.compiled_step_ms:.2f} ms ({r.compiled_step_operators}; compiled in "
            f"{r.compiled_step_compile_s:.0f} s, max |diff| "
            f"{r.compiled_step_max_abs_difference:.2g}): {r.compiled_step_vs_eager:.2f}x the "
            f"eager step (target 2x), {r.compiled_step_vs_dense:.2f}x the compiled forward "
            "(target 1x)"
        )
    print(f"wrote {args.json} and {plot}")
    return 0


def cmd_bench_exactness(args, settings: Settings) -> int:
    from backend.bench.exactness import CHECKED_DTYPES, run_exactness, write_records
    from backend.engine.factory import DTYPES

    dtypes = args.dtypes.split(",")
    for dtype in dtypes:
        if dtype not in CHECKED_DTYPES:
            raise ValueError(f"--dtypes: {dtype!r} is none of {', '.join(CHECKED_DTYPES)}")
    records = []
    for dtype in dtypes:
        records += run_exactness(
            settings.paths.resolved_models_dir(),
            settings.paths.resolved_cache_dir() / "exactness",
            device=settings.engine.device,
            dtype=DTYPES[dtype],
        )
    write_records(records, Path(args.json))
    for r in records:
        verdict = ("ok, " if r.within_tolerance else "OVER ") + f"bound {r.tolerance:.3g}"
        print(
            f"{r.model:18s} {r.dtype:8s} {r.check:18s} {r.mode:6s} max |diff| "
            f"{r.max_abs_diff:.3g} (latents up to {r.reference_max_abs:.3g}) {verdict}"
        )
    print(f"wrote {args.json}")
    return 0 if all(r.within_tolerance for r in records) else 1


def request_counts(text: str, flag: str = "--requests") -> list[int]:
    """``flag``'s batch sizes, e.g. ``1,2,4,8``; ValueError naming ``flag`` for anything else."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"{flag}: positive counts separated by commas, got {text!r}")
    return counts


def cmd_bench_batch_ops(args, settings: Settings) -> int:
    from backend.bench.batch_ops import run_batch_ops, summary_lines, write_batch_ops
    from backend.engine.factory import DTYPES

    records = run_batch_ops(
        args.model,
        request_counts(args.requests),
        settings.paths.resolved_models_dir(),
        settings.paths.resolved_cache_dir(),
        size=args.size,
        mode=args.mode,
        steps=args.steps,
        repeats=args.repeats,
        device=settings.engine.device,
        dtype=DTYPES[settings.engine.dtype],
        compare=args.compare,
        adapters=args.adapters,
    )
    plot = write_batch_ops(records, Path(args.json))
    print("\n".join(summary_lines(records)))
    print(f"wrote {args.json} and {plot}")
    return 0


def cmd_bench_step_trace(args, settings: Settings) -> int:
    from backend.bench.step_trace import run_step_trace, summary_lines, write_step_trace
    from backend.engine.factory import DTYPES

    records = run_step_trace(
        args.model,
        request_counts(args.requests),
        settings.paths.resolved_models_dir(),
        settings.paths.resolved_cache_dir(),
        size=args.size,
        mode=args.mode,
        steps=args.steps,
        repeats=args.repeats,
        device=settings.engine.device,
        dtype=DTYPES[settings.engine.dtype],
        trace_dir=Path(args.trace) if args.trace else None,
        attention=args.attention,
    )
    plot = write_step_trace(records, Path(args.json))
    print("\n".join(summary_lines(records)))
    print(f"wrote {args.json} and {plot}")
    return 0


def cmd_bench_demo(args, settings: Settings) -> int:
    from backend.bench.demo_quality import run_demo_bench, write_outputs

    records, grid = run_demo_bench(
        args.model,
        settings.paths.resolved_models_dir(),
        examples=args.examples,
        per_ratio=args.per_ratio,
        margin=settings.engine.mask_margin_tokens if args.margin is None else args.margin,
    )
    summary = write_outputs(records, grid, Path(args.json))
    for source in ("painted", "sweep"):
        for arm, row in summary.get(source, {}).items():
            print(
                f"{source:8s} {arm:8s} colour agreement {row['colour_agreement']:6.1%}  "
                f"closer than template {row['closer_than_template']:6.1%}  "
                f"outside identical {row['outside_identical']:6.1%}  ({row['cases']} edits)"
            )
    for mode, by_ratio in summary["fidelity"].items():
        for ratio, row in by_ratio.items():
            print(
                f"{mode:6s} m~{ratio:<5} SSIM {row['ssim_mean']:.3f} "
                f"(mask {row['ssim_masked_mean']:.3f}, min {row['ssim_masked_min']:.3f})  "
                f"PSNR {row['psnr_mean']:.1f} dB "
                f"(mask {row['psnr_masked_mean']:.1f} dB)  n={row['cases']}"
            )
    print(f"wrote {args.json}, its .png and -grid.png")
    return 0


def cmd_bench_worker(args, settings: Settings) -> int:
    from backend.bench.worker_bench import BenchConfig, run_worker_bench, write_outputs

    modes = ("continuous", "static", "inline") if args.mode == "all" else (args.mode,)
    cfg = BenchConfig(
        model_id=args.model,
        modes=modes,
        rps=args.rps,
        duration_s=args.duration,
        num_templates=args.templates,
        ram_templates=args.ram_templates,
        mask_mean=args.mask_mean,
        steps=args.steps,
        size=args.size,
        max_batch=args.max_batch,
        seed=args.seed,
        burst_factor=args.burst,
    )
    results = run_worker_bench(cfg, settings)
    plot = write_outputs(cfg, results, Path(args.json))
    base = {r.mode: r for r in results if r.label == r.mode}.get("continuous")
    for r in results:
        vs = f"  P95 {r.p95_latency_s / base.p95_latency_s:4.2f}x continuous" if base else ""
        # Rows join only once their cache is in RAM (prefetch-gated admission), so every acquire is
        # a RAM hit: what spilling costs shows in the disk reads and RAM evictions.
        reads, evictions = r.cache.get("prefetches", 0), r.cache.get("ram_evictions", 0)
        read_mb = r.cache.get("bytes_loaded", 0) / 2**20
        print(
            f"{r.label:34s} n={r.num_jobs:3d} avg {r.avg_latency_s:6.2f}s "
            f"p50 {r.p50_latency_s:6.2f}s p95 {r.p95_latency_s:6.2f}s{vs}  "
            f"{r.throughput_rps:5.2f} req/s  queue {r.avg_queue_s:5.2f}s  "
            f"step {r.mean_step_s * 1e3:6.1f} ms  overhead {r.mean_overhead_ms:5.2f} ms "
            f"(+ job work {r.mean_job_work_ms:5.2f} ms)  "
            f"rows {r.mean_batch_rows:4.2f}  disk reads {reads} ({read_mb:.0f} MiB)  "
            f"RAM evictions {evictions}"
        )
    print(f"wrote {args.json} and {plot}")
    return 0


def cmd_bench_route(args, settings: Settings) -> int:
    if args.real:
        return _bench_route_real(args, settings)
    from dataclasses import replace

    from backend.bench.route_bench import (
        RouteBenchConfig,
        cost_model_for,
        decision_time,
        run_route_bench,
        summarize_seeds,
        summary_table,
        write_outputs,
    )
    from backend.bench.seeds import parse_seeds

    cfg = RouteBenchConfig(
        model_id=args.model,
        device=args.device_kind,
        mode=args.mode,
        profiles_dir=args.profiles_dir or str(settings.paths.profiles_dir),
        policies=tuple(args.policies.split(",")) if args.policies else ROUTING_POLICIES,
        loads=tuple(float(x) for x in args.loads.split(",")),
        duration_s=args.duration,
        num_workers=args.workers,
        max_batch=args.max_batch,
        steps=args.steps,
        num_templates=args.templates,
        ram_templates=args.ram_templates,
        prerecorded=args.prerecorded,
        mask_mean=args.mask_mean,
        burst_factor=args.burst,
        disk_read_s_per_byte=1e-9 / args.disk_gbps,
        seed=args.seed,
        late_binding=args.late_binding,
        queue_depth=args.queue_depth,
        capacity_rps=args.capacity_rps,
        load_scale=args.load_scale,
        load_ratio=args.load_ratio,
    )
    seeds = parse_seeds(args.seeds, args.seed)
    json_path, reports = Path(args.json), []
    for seed in seeds:
        one = replace(cfg, seed=seed)
        report = run_route_bench(one, progress=lambda line, s=seed: print(f"seed {s}: {line}"))
        if args.decisions and not reports:
            report["decision_time_ms"] = decision_time(
                cost_model_for(one), decisions=args.decisions
            )
            print(f"decision time (8 workers x 8 rows): {report['decision_time_ms']}")
        path = (
            json_path
            if len(seeds) == 1
            else json_path.with_name(f"{json_path.stem}-seed{seed}{json_path.suffix}")
        )
        write_outputs(one, report, path)
        reports.append(report)
    summary = summarize_seeds(reports)
    if len(seeds) > 1:
        write_outputs(cfg, summary, json_path)
    print(
        f"cache loads of a mean-mask request: {summary['load_compute_ratio']:.3g}x its compute"
        + (" (what-if, not a measured device)" if cfg.load_ratio or cfg.load_scale != 1.0 else "")
    )
    print(
        f"mean over seeds {summary['seeds']}, capacity {summary['capacity_rps']:.2f} req/s; "
        f"P95 latency (s), and the P95 cut of mask_aware:"
    )
    print(summary_table(summary))
    print(
        f"wrote {json_path} and {json_path.with_suffix('.png')}"
        + (" (the mean; one JSON and plot per seed beside it)" if len(seeds) > 1 else "")
    )
    return 0


def _bench_route_real(args, settings: Settings) -> int:
    from backend.bench.route_real import RealRouteConfig, run_real_route_bench, write_real_outputs

    cfg = RealRouteConfig(
        policies=tuple(args.policies.split(",")) if args.policies else ROUTING_POLICIES,
        workers=args.real_workers,
        rps=args.real_rps,
        duration_s=args.real_duration,
        mask_mean=args.mask_mean,
        seed=args.seed,
    )
    report = run_real_route_bench(cfg, settings)
    write_real_outputs(report, Path(args.json))
    print(f"wrote {args.json}")
    return 0


def add_bench_parsers(bench: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommands, each with its ``func``."""
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    engine = bench_sub.add_parser(
        "engine", help="ordinary pipeline (eager, compiled) vs mask-aware edit, by arms"
    )
    engine.add_argument("--model", required=True)
    engine.add_argument("--mask-ratios", default="0.05,0.1,0.2,0.35,0.5,1.0")
    engine.add_argument("--steps", type=int, default=20)
    engine.add_argument("--modes", default="kv,hidden")
    engine.add_argument("--repeats", type=int, default=1)
    engine.add_argument("--size", type=int, default=None)
    engine.add_argument("--json", required=True)
    engine.add_argument(
        "--device", default=None, help="cpu or cuda[:N] (default: MASKSERVE_DEVICE or cpu)"
    )
    engine.add_argument(
        "--arms",
        default="ordinary,ordinary-compiled,maskaware",
        help="arms timed side by side, by commas (backend/bench/engine_arms.py)",
    )
    engine.add_argument(
        "--batch", default="1", help="requests served by one call, by commas, e.g. 1,8"
    )
    engine.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode of the compiled arms (default: max-autotune on CUDA, which "
        "captures CUDA graphs; inductor's default elsewhere)",
    )
    engine.add_argument(
        "--fresh-process-baseline",
        action="store_true",
        help="add the arm ordinary-fresh-process: the plain diffusers pipeline in a process "
        "importing nothing of MaskServe (scripts/plain_pipeline.py), taking turns with the others",
    )
    engine.add_argument(
        "--in-memory",
        action="store_true",
        help="build a built model (tiny, small, arch) without saving it (arch-flux-fill's float32 "
        "files are 68 GB)",
    )
    engine.set_defaults(func=cmd_bench_engine)

    proxy = bench_sub.add_parser(
        "launch-proxy",
        help="CPU proxy of the launch-bound GPU step: ordinary forward eager vs compiled, the "
        "mask-aware step eager (exact, bucketed) and compiled, operators launched",
    )
    proxy.add_argument(
        "--models", default="tiny-sd2-inpaint,tiny-sdxl-inpaint,tiny-flux-fill", help="by commas"
    )
    proxy.add_argument("--size", type=int, default=64, help="px")
    proxy.add_argument("--rows", type=int, default=2, help="denoiser rows per forward")
    proxy.add_argument("--repeats", type=int, default=20)
    proxy.add_argument("--mask-ratio", type=float, default=0.2, help="of the mask-aware step")
    proxy.add_argument(
        "--compile-mode", default=None, help="torch.compile mode (inductor's default)"
    )
    proxy.add_argument("--json", required=True)
    proxy.set_defaults(func=cmd_bench_launch_proxy)

    exactness = bench_sub.add_parser(
        "exactness", help="mask-aware vs ordinary latents of the tiny models on a device and dtype"
    )
    exactness.add_argument("--dtypes", default="float32,bfloat16")
    exactness.add_argument("--json", required=True)
    exactness.add_argument(
        "--device", default=None, help="cpu or cuda[:N] (default: MASKSERVE_DEVICE or cpu)"
    )
    exactness.set_defaults(func=cmd_bench_exactness)

    batch_ops = bench_sub.add_parser(
        "batch-ops", help="one step's operators and time as its batch grows, in two engine forms"
    )
    batch_ops.add_argument(
        "--compare",
        choices=("attention", "lora"),
        default="attention",
        help="attention: grouped against padded; lora: adapters grouped against stacked",
    )
    batch_ops.add_argument(
        "--adapters", type=int, default=None, help="per request (default: 2 with --compare lora)"
    )
    batch_ops.add_argument("--model", default="tiny-sd2-inpaint")
    batch_ops.add_argument("--size", type=int, default=None)
    batch_ops.add_argument("--requests", default="1,2,4,8")
    batch_ops.add_argument("--mode", choices=("kv", "hidden"), default="kv")
    batch_ops.add_argument("--steps", type=int, default=20, help="of each edit (its cache's size)")
    batch_ops.add_argument("--repeats", type=int, default=5)
    batch_ops.add_argument("--json", required=True)
    batch_ops.set_defaults(func=cmd_bench_batch_ops)

    step_trace = bench_sub.add_parser(
        "step-trace",
        help="where one step's time goes: the dense step against the cached one (device timeline)",
    )
    step_trace.add_argument("--model", default="tiny-sd2-inpaint")
    step_trace.add_argument("--size", type=int, default=None)
    step_trace.add_argument("--requests", default="1,8")
    step_trace.add_argument("--mode", choices=("kv", "hidden"), default="kv")
    step_trace.add_argument(
        "--attention",
        choices=("auto", "grouped", "padded"),
        default="auto",
        help="the rows' attention in the cached step (auto: padded on CUDA, grouped on a CPU)",
    )
    step_trace.add_argument("--steps", type=int, default=20, help="of each edit (its cache's size)")
    step_trace.add_argument("--repeats", type=int, default=5)
    step_trace.add_argument("--trace", default=None, help="a directory for the Chrome traces")
    step_trace.add_argument("--json", required=True)
    step_trace.set_defaults(func=cmd_bench_step_trace)

    demo = bench_sub.add_parser(
        "demo", help="does the model paint the prompt; mask-aware vs ordinary on held-out scenes"
    )
    demo.add_argument("--model", default=DEFAULT_MODEL)
    demo.add_argument("--examples", type=int, default=100, help="held-out painted-mask edits")
    demo.add_argument("--per-ratio", type=int, default=8, help="blob-mask edits per mask ratio")
    demo.add_argument("--margin", type=int, default=None, help="mask margin in tokens")
    demo.add_argument("--json", default="docs/bench/demo-quality.json")
    demo.set_defaults(func=cmd_bench_demo)

    worker_bench = bench_sub.add_parser(
        "worker", help="one engine worker under a Poisson trace, batching modes side by side"
    )
    worker_bench.add_argument(
        "--mode", choices=["continuous", "static", "inline", "all"], default="all"
    )
    worker_bench.add_argument("--model", default="tiny-sd2-inpaint")
    worker_bench.add_argument(
        "--rps", type=float, default=2.0, help="mean arrival rate (requests/s)"
    )
    worker_bench.add_argument(
        "--duration", type=float, default=30.0, help="seconds of arrivals per mode"
    )
    worker_bench.add_argument(
        "--mask-mean",
        type=float,
        default=0.11,
        help="mean mask ratio: 0.11 production trace, 0.19 public trace",
    )
    worker_bench.add_argument(
        "--templates", type=int, default=24, help="templates in the Zipf popularity"
    )
    worker_bench.add_argument(
        "--ram-templates", type=int, default=6, help="RAM tier budget in templates"
    )
    worker_bench.add_argument("--steps", type=int, default=20)
    worker_bench.add_argument("--size", type=int, default=256)
    worker_bench.add_argument("--max-batch", type=int, default=8)
    worker_bench.add_argument(
        "--burst", type=float, default=1.0, help="burstiness (1 = plain Poisson)"
    )
    worker_bench.add_argument("--seed", type=int, default=0)
    worker_bench.add_argument("--json", required=True)
    worker_bench.set_defaults(func=cmd_bench_worker)
    add_worker_deadlines_parser(bench_sub)

    route = bench_sub.add_parser(
        "route",
        help="routing policies side by side (discrete-event simulation "
        "driven by the fitted cost models)",
    )
    route.add_argument("--model", default="small-flux-fill")
    route.add_argument(
        "--device-kind", default="cpu", help="the profile's device kind (cpu or cuda)"
    )
    route.add_argument("--mode", choices=["kv", "hidden"], default="kv")
    route.add_argument("--profiles-dir", default=None)
    route.add_argument("--policies", default=None, help="comma list (default: all)")
    route.add_argument(
        "--loads", default="0.5,0.65,0.8,0.95", help="fractions of the measured capacity"
    )
    route.add_argument(
        "--duration", type=float, default=600.0, help="simulated seconds of arrivals per run"
    )
    route.add_argument("--workers", type=int, default=8)
    route.add_argument("--max-batch", type=int, default=8)
    route.add_argument("--steps", type=int, default=20)
    route.add_argument("--templates", type=int, default=200)
    route.add_argument("--ram-templates", type=int, default=8, help="per worker")
    route.add_argument(
        "--prerecorded", type=float, default=0.8, help="share of templates on disk at the start"
    )
    route.add_argument("--mask-mean", type=float, default=0.11)
    route.add_argument("--burst", type=float, default=2.0)
    route.add_argument("--disk-gbps", type=float, default=1.0)
    route.add_argument("--seed", type=int, default=0)
    route.add_argument(
        "--seeds",
        default="",
        help="seeds and ranges (0,1,2 or 3-12): one run per seed, then the mean table over them "
        "(--json is the mean; one JSON per seed beside it)",
    )
    route.add_argument(
        "--late-binding",
        action="store_true",
        help="the dispatcher holds jobs until a worker has slack (as MASKSERVE_LATE_BINDING)",
    )
    route.add_argument(
        "--queue-depth",
        type=int,
        default=0,
        help="with --late-binding: waiting rows a worker "
        "may hold beyond its batch (as MASKSERVE_QUEUE_DEPTH)",
    )
    route.add_argument(
        "--load-scale",
        type=float,
        default=1.0,
        help="what-if: multiply the profile's cache-load slope (e.g. a PCIe-bound GPU); "
        "not a measurement",
    )
    route.add_argument(
        "--load-ratio",
        type=float,
        default=0.0,
        help="what-if: scale the cache-load slope so that a mean-mask request's sequential "
        "cache loads take this x its compute (FlashPS measured 1.02 on an H800); not a measurement",
    )
    route.add_argument(
        "--capacity-rps",
        type=float,
        default=0.0,
        help="loads as fractions of this rate (default: the measured saturation throughput)",
    )
    route.add_argument(
        "--decisions", type=int, default=2000, help="routing decisions timed (0: skip)"
    )
    route.add_argument(
        "--real",
        action="store_true",
        help="instead of simulating, run each policy on real CPU worker processes (small scale)",
    )
    route.add_argument("--real-workers", type=int, default=2)
    route.add_argument("--real-rps", type=float, default=3.0)
    route.add_argument("--real-duration", type=float, default=30.0)
    route.add_argument("--json", required=True)
    route.set_defaults(func=cmd_bench_route)
    add_route_deadlines_parser(bench_sub)
    add_soak_parser(bench_sub)
    add_crop_parser(bench_sub)
    add_step_launches_parser(bench_sub)
    add_serve_parser(bench_sub)
    add_serve_deadlines_parser(bench_sub)
    add_adapter_quality_parser(bench_sub)
    add_adapters_parser(bench_sub)


def cmd_bench_soak(args, settings: Settings) -> int:
    from backend.bench.soak import SoakConfig, run_soak
    from backend.bench.soak_report import summary, write_outputs

    cfg = SoakConfig(
        minutes=args.minutes,
        sample_s=args.sample_s,
        load=args.load,
        model_id=args.model,
        steps=args.steps,
        size=args.size,
        templates=args.templates,
        mask_mean=args.mask_mean,
        seed=args.seed,
        capacity_s=args.capacity_s,
        capacity_clients=args.capacity_clients,
        capacity_rps=args.capacity_rps,
        drain_s=args.drain_s,
        cpu_workers=args.cpu_workers,
        retention_s=args.retention_s,
        data_dir=args.data_dir,
        url=args.url,
        api_key=args.api_key,
        redis_url=args.redis_url,
    )
    try:
        report = run_soak(cfg, settings, progress=not args.no_progress)
    except RuntimeError as exc:  # the stack never got ready, or refused or failed its warm-up
        print(f"error: soak stopped: {exc}", file=sys.stderr)
        return 1
    print(summary(report))
    written = write_outputs(
        report, Path(args.json) if args.json else None, Path(args.png) if args.png else None
    )
    if written:
        print("wrote " + " and ".join(str(p) for p in written))
    return 0 if report["passed"] else 1


def add_soak_parser(bench_sub) -> None:
    soak = bench_sub.add_parser(
        "soak",
        help="the whole stack at a share of its measured capacity for minutes: fails when a "
        "role's memory or files, Redis, the disk or the latency grow, or a job is lost",
    )
    soak.add_argument("--minutes", type=float, default=30.0)
    soak.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples")
    soak.add_argument("--load", type=float, default=0.8, help="share of the measured capacity")
    soak.add_argument("--model", default="tiny-sd2-inpaint")
    soak.add_argument("--steps", type=int, default=4)
    soak.add_argument("--size", type=int, default=128)
    soak.add_argument("--templates", type=int, default=6, help="templates uploaded at the start")
    soak.add_argument("--mask-mean", type=float, default=0.11)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--capacity-s", type=float, default=60.0, help="closed-loop phase length")
    soak.add_argument("--capacity-clients", type=int, default=4)
    soak.add_argument(
        "--capacity-rps", type=float, default=0.0, help="skip the capacity phase: use this rate"
    )
    soak.add_argument(
        "--drain-s", type=float, default=180.0, help="wait for the last jobs; later: lost"
    )
    soak.add_argument("--cpu-workers", type=int, default=1)
    soak.add_argument(
        "--retention-s",
        type=float,
        default=120.0,
        help="blob retention of the stack the soak starts (short: the janitor's bound shows)",
    )
    soak.add_argument(
        "--data-dir", default="", help="of the stack the soak starts (default: a fresh temp dir)"
    )
    soak.add_argument("--url", default="", help="soak a running stack instead of starting one")
    soak.add_argument("--api-key", dest="api_key", default="", help="with --url")
    soak.add_argument("--redis-url", dest="redis_url", default="", help="with --url: sample it")
    soak.add_argument("--json", default="", help="e.g. docs/bench/soak/soak.json")
    soak.add_argument("--png", default="", help="e.g. docs/bench/soak/soak.png")
    soak.add_argument("--no-progress", action="store_true", help="no progress bar")
    soak.set_defaults(func=cmd_bench_soak)

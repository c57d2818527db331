"""`maskserve` command line: models, templates, edits, profiles, benchmarks, and `up`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from backend.config import Settings, SettingsError, load_settings

log = logging.getLogger("maskserve")


def _engine(settings: Settings, model_id: str | None = None):
    from backend.engine.factory import build_engine

    engine = build_engine(settings, model_id)
    return engine, engine.spec


def _params(spec, args, settings: Settings):
    from backend.engine.factory import edit_params

    return edit_params(spec, settings, steps=args.steps, size=args.size, mode=args.mode)


def cmd_models(args, settings: Settings) -> int:
    from backend.models import known_model_ids, materialize

    if args.action == "list":
        print("\n".join(known_model_ids()))
        return 0
    path = materialize(args.model, settings.paths.resolved_models_dir())
    print(path)
    return 0


def _open_image(path: str):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path)
    except FileNotFoundError:
        raise SystemExit(f"error: no such file: {path}")
    except UnidentifiedImageError:
        raise SystemExit(f"error: {path} is not an image PIL can read (use PNG, JPEG or WebP)")


def cmd_prepare(args, settings: Settings) -> int:
    engine, spec = _engine(settings, args.model)
    params = _params(spec, args, settings)
    started = time.perf_counter()
    cache = engine.prepare_template(_open_image(args.image), params)
    print(
        json.dumps(
            {
                "cache": str(cache.path),
                "bytes": cache.bytes_total,
                "seconds": round(time.perf_counter() - started, 3),
            }
        )
    )
    return 0


def cmd_edit(args, settings: Settings) -> int:
    engine, spec = _engine(settings, args.model)
    params = _params(spec, args, settings)
    result = engine.edit(
        _open_image(args.image), _open_image(args.mask), args.prompt, args.seed, params
    )
    result.image.save(args.out)
    print(
        json.dumps(
            {
                "out": args.out,
                "seed": result.seed,
                "mask_ratio": round(result.mask_ratio, 4),
                "used_cache": result.used_cache,
                "timings": {k: round(v, 3) for k, v in result.timings.items()},
            }
        )
    )
    return 0


def cmd_bench_engine(args, settings: Settings) -> int:
    from backend.bench.engine_bench import run_engine_bench, write_outputs
    from backend.engine.factory import DTYPES

    ratios = [float(r) for r in args.mask_ratios.split(",")]
    records = run_engine_bench(
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
    )
    plot = write_outputs(records, Path(args.json))
    for r in records:
        print(
            f"{r.model:18s} {r.mode:6s} m={r.mask_ratio:<5} ordinary {r.ordinary_s:7.3f}s  mask-aware "
            f"{r.maskaware_s:7.3f}s  speedup {r.speedup:5.2f}x (ideal {r.ideal_speedup:5.2f}x)  "
            f"ssim {r.ssim:.3f} psnr {r.psnr:.1f}"
        )
    print(f"wrote {args.json} and {plot}")
    return 0


def cmd_profile(args, settings: Settings) -> int:
    from backend.costmodel.profiles import profile_path
    from backend.engine.profiler import measure_profile

    engine, spec = _engine(settings, args.model)
    size = args.size or spec.default_resolution
    for mode in args.modes.split(","):
        profile = measure_profile(engine, mode, size, settings.engine.device, repeats=args.repeats)
        path = profile_path(
            Path(args.out_dir or settings.paths.profiles_dir),
            spec.model_id,
            settings.engine.device,
            mode,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(profile.to_json())
        print(
            f"{spec.model_id} {mode}: compute R^2 {profile.compute.r2:.4f} "
            f"({profile.compute.slope * 1e9:.4f} s/GFLOP + {profile.compute.intercept * 1e3:.3f} ms), "
            f"load R^2 {profile.load.r2:.4f} ({profile.load.slope * 1e9:.4f} s/GB) -> {path}"
        )
    return 0


def cmd_up(args, settings: Settings) -> int:
    """Start every role on this machine and wait; Ctrl-C stops them all."""
    from backend.runtime import stop_event_on_signals
    from backend.services.redis_server import free_port
    from backend.services.stack import (
        Stack,
        assign_metrics_ports,
        engine_devices,
        plan_roles,
        stack_api_key,
        stack_login,
    )
    from studio.share import share_url_path, wait_for_share_url

    if args.share and settings.api.auth_disabled:
        raise ValueError(
            "--share publishes the studio on a public link: it needs the login, so unset "
            "MASKSERVE_AUTH_DISABLED (users come from MASKSERVE_USERS or are generated)"
        )
    roles = plan_roles(settings, engine_devices(), cpu_workers=args.cpu_workers)
    metrics_ports = assign_metrics_ports(roles, settings, free_port)
    api_key, (user, password) = stack_api_key(settings), stack_login(settings)
    for role in roles:
        if role.name == "api":
            role.env |= {"MASKSERVE_API_KEYS": api_key} if api_key else {}
            role.env |= {"MASKSERVE_USERS": f"{user}:{password}"} if user else {}
            role.env |= {"MASKSERVE_STUDIO_SHARE": "1"} if args.share else {}
    share_url_path(settings).unlink(missing_ok=True)
    stack = Stack(settings, roles)
    stop = stop_event_on_signals()
    try:
        redis_url = stack.start()
        base = f"http://{settings.api.host}:{settings.api.port}"
        login = f"{user} / {password}" if user else "(from MASKSERVE_USERS)"
        role_metrics = ", ".join(
            f"{name} http://127.0.0.1:{port}/metrics" for name, port in metrics_ports.items()
        )
        print(
            f"Studio     {base}{settings.studio.path}/   (login {login})\n"
            f"REST API   {base}/v1   (docs {base}/docs, metrics {base}/metrics)\n"
            f"API key    {api_key or '(from MASKSERVE_API_KEYS)'}\nRedis      {redis_url}\n"
            f"metrics    {role_metrics}\n"
            f"logs       {stack.log_dir}/<role>.log\n"
            f"roles      {', '.join(r.name for r in roles)}\nCtrl-C stops everything.",
            flush=True,
        )
        if stack.wait_ready(f"{base}/readyz", stop):
            print("ready", flush=True)
            if args.share:
                print(f"share      {wait_for_share_url(settings, stop)}", flush=True)
        while not stop.is_set():
            name = stack.exited()
            if name is not None:
                print(
                    f"error: {name} exited; the last lines of its log:\n{stack.log_tail(name)}",
                    file=sys.stderr,
                )
                return 1
            stop.wait(0.5)
        return 0
    finally:
        stack.stop()


def cmd_submit(args, settings: Settings) -> int:
    from backend.client import submit_cli

    return submit_cli(args, settings)


def cmd_dispatcher(args, settings: Settings) -> int:
    from backend.dispatch.service import run_dispatcher
    from backend.runtime import run_role

    return run_role("dispatcher", run_dispatcher, settings)


def cmd_api(args, settings: Settings) -> int:
    from backend.api.server import run_api
    from backend.runtime import run_role

    return run_role("api", run_api, settings)


def cmd_worker(args, settings: Settings) -> int:
    from backend.runtime import run_role
    from backend.worker.service import run_worker

    return run_role("worker", run_worker, settings)


def cmd_cpu_worker(args, settings: Settings) -> int:
    from backend.runtime import run_role
    from backend.tasks.celery_app import run_cpu_worker

    return run_role("cpu-worker", run_cpu_worker, settings)


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
        # Rows join only once their cache is in RAM (prefetch-gated admission), so every acquire is a
        # RAM hit: what spilling costs shows in the disk reads and RAM evictions.
        reads, evictions = r.cache.get("prefetches", 0), r.cache.get("ram_evictions", 0)
        read_mb = r.cache.get("bytes_loaded", 0) / 2**20
        print(
            f"{r.label:34s} n={r.num_jobs:3d} avg {r.avg_latency_s:6.2f}s p50 {r.p50_latency_s:6.2f}s "
            f"p95 {r.p95_latency_s:6.2f}s{vs}  {r.throughput_rps:5.2f} req/s  queue {r.avg_queue_s:5.2f}s  "
            f"step {r.mean_step_s * 1e3:6.1f} ms  overhead {r.mean_overhead_ms:5.2f} ms (+ job work "
            f"{r.mean_job_work_ms:5.2f} ms)  "
            f"rows {r.mean_batch_rows:4.2f}  disk reads {reads} ({read_mb:.0f} MiB)  RAM evictions {evictions}"
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
    from backend.dispatch.router import POLICIES

    cfg = RouteBenchConfig(
        model_id=args.model,
        device=args.device_kind,
        mode=args.mode,
        profiles_dir=args.profiles_dir or str(settings.paths.profiles_dir),
        policies=tuple(args.policies.split(",")) if args.policies else POLICIES,
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
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    except ValueError:
        raise ValueError(
            f"--seeds takes a comma list of integers, e.g. 0,1,2; got {args.seeds!r}"
        ) from None
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds repeats a seed: {args.seeds!r}")
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
        f"mean over seeds {summary['seeds']}, capacity {summary['capacity_rps']:.2f} req/s; P95 latency (s), "
        f"and the P95 cut of mask_aware:"
    )
    print(summary_table(summary))
    print(
        f"wrote {json_path} and {json_path.with_suffix('.png')}"
        + (" (the mean; one JSON and plot per seed beside it)" if len(seeds) > 1 else "")
    )
    return 0


def _bench_route_real(args, settings: Settings) -> int:
    from backend.bench.route_real import RealRouteConfig, run_real_route_bench, write_real_outputs
    from backend.dispatch.router import POLICIES

    cfg = RealRouteConfig(
        policies=tuple(args.policies.split(",")) if args.policies else POLICIES,
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


def _worker_overrides(args) -> dict:
    engine = {k: v for k, v in (("device", args.device), ("model_id", args.model)) if v}
    worker = {
        k: v
        for k, v in (
            ("worker_id", args.worker_id),
            ("batching", args.batching),
            ("max_batch", args.max_batch),
        )
        if v
    }
    return {"engine": engine, "worker": worker}


def _cpu_worker_overrides(args) -> dict:
    return {"celery": {"concurrency": args.concurrency}} if args.concurrency else {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maskserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="list or build models")
    models.add_argument("action", choices=["list", "build"])
    models.add_argument("model", nargs="?", default="tiny-sd2-inpaint")
    models.set_defaults(func=cmd_models)

    def edit_options(p):
        p.add_argument(
            "--model", default=None, help="model id (default: MASKSERVE_MODEL or tiny-sd2-inpaint)"
        )
        p.add_argument("--size", type=int, default=None, help="square resolution in pixels")
        p.add_argument("--steps", type=int, default=None)
        p.add_argument("--mode", choices=["kv", "hidden"], default=None)
        p.add_argument("--image", required=True)

    prepare = sub.add_parser("prepare", help="record a template's activation cache")
    edit_options(prepare)
    prepare.set_defaults(func=cmd_prepare)
    edit = sub.add_parser("edit", help="edit the masked region of a template")
    edit_options(edit)
    edit.add_argument(
        "--mask", required=True, help="grayscale PNG, 255 = repaint, same size as the image"
    )
    edit.add_argument("--prompt", required=True)
    edit.add_argument("--seed", type=int, default=0)
    edit.add_argument("--out", default="edited.png")
    edit.set_defaults(func=cmd_edit)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    engine = bench_sub.add_parser("engine", help="ordinary pipeline vs mask-aware edit")
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
    engine.set_defaults(func=cmd_bench_engine)

    profile = sub.add_parser(
        "profile", help="measure and fit a model's cost profile on this device"
    )
    profile.add_argument("--model", required=True)
    profile.add_argument(
        "--device", default=None, help="cpu or cuda[:N] (default: MASKSERVE_DEVICE or cpu)"
    )
    profile.add_argument("--modes", default="kv,hidden")
    profile.add_argument("--size", type=int, default=None)
    profile.add_argument("--repeats", type=int, default=2)
    profile.add_argument("--out-dir", default=None, help="default: the settings' profiles_dir")
    profile.set_defaults(func=cmd_profile)

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
        help="comma list: one run per seed, then the mean table over them "
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
        help="what-if: multiply the profile's cache-load slope (e.g. a PCIe-bound GPU); not a measurement",
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

    worker = sub.add_parser("worker", help="run one engine worker (one per GPU) on its Redis inbox")
    worker.add_argument(
        "--device", default=None, help="cpu or cuda[:N] (default: MASKSERVE_DEVICE or cpu)"
    )
    worker.add_argument("--model", default=None, help="model id (default: MASKSERVE_MODEL)")
    worker.add_argument(
        "--worker-id", default=None, help="default: MASKSERVE_WORKER_ID or worker-0"
    )
    worker.add_argument("--batching", choices=["continuous", "static", "inline"], default=None)
    worker.add_argument("--max-batch", type=int, default=None)
    worker.set_defaults(func=cmd_worker, overrides=_worker_overrides)

    cpu_worker = sub.add_parser("cpu-worker", help="run a Celery worker for pre/post-processing")
    cpu_worker.add_argument("--concurrency", type=int, default=None, help="processes (default 1)")
    cpu_worker.set_defaults(func=cmd_cpu_worker, overrides=_cpu_worker_overrides)

    dispatcher = sub.add_parser("dispatcher", help="route pre-processed jobs to engine workers")
    dispatcher.add_argument(
        "--policy",
        default=None,
        choices=["mask_aware", "flashps", "round_robin", "fewest_requests", "fewest_tokens"],
    )
    dispatcher.set_defaults(
        func=cmd_dispatcher,
        overrides=lambda a: {"dispatcher": {"policy": a.policy}} if a.policy else {},
    )
    api = sub.add_parser("api", help="run the REST API server")
    api.set_defaults(func=cmd_api)
    from backend.client import add_submit_arguments

    submit = sub.add_parser(
        "submit", help="submit an edit to a running MaskServe over REST and wait for it"
    )
    add_submit_arguments(submit)
    submit.set_defaults(func=cmd_submit)

    up = sub.add_parser(
        "up",
        help="start every role on this machine (Redis, CPU workers, dispatcher, "
        "engine workers, API); Ctrl-C stops them",
    )
    up.add_argument("--cpu-workers", type=int, default=1, help="Celery CPU worker processes")
    up.add_argument(
        "--share",
        action="store_true",
        help="also publish the studio on a public Gradio share link (behind the same login)",
    )
    up.set_defaults(func=cmd_up)

    from backend import config_reference

    reference = sub.add_parser(
        "config-reference", help="print the configuration reference (docs/configuration.md)"
    )
    config_reference.add_arguments(reference)
    reference.set_defaults(func=lambda args, settings: config_reference.run(args))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "overrides"):
        overrides = args.overrides(args)
    else:
        overrides = {"engine": {"device": args.device}} if getattr(args, "device", None) else {}
    try:
        settings = load_settings(**overrides)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        return args.func(args, settings)
    except ValueError as exc:  # every user-facing error type derives from ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`maskserve` command line: models, templates, adapters, edits, profiles, benchmarks, and `up`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from backend.bench.commands import add_bench_parsers
from backend.config import (
    BATCHING_MODES,
    Settings,
    SettingsError,
    load_settings,
    unknown_variables,
)
from backend.dispatch.router import POLICIES as ROUTING_POLICIES
from backend.models.catalog import DEFAULT_MODEL
from backend.training.commands import add_train_parser

log = logging.getLogger("maskserve")


def _engine(settings: Settings, model_id: str | None = None, in_memory: bool = False):
    from backend.engine.factory import build_engine

    engine = build_engine(settings, model_id, in_memory=in_memory)
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
        raise SystemExit(f"error: no such file: {path}") from None
    except UnidentifiedImageError:
        raise SystemExit(
            f"error: {path} is not an image PIL can read (use PNG, JPEG or WebP)"
        ) from None


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


def cmd_profile(args, settings: Settings) -> int:
    from backend.atomic import write_atomic
    from backend.costmodel.profiles import profile_path
    from backend.engine.profiler import measure_profile

    engine, spec = _engine(settings, args.model, in_memory=args.in_memory)
    size = args.size or spec.default_resolution
    for mode in args.modes.split(","):
        profile = measure_profile(engine, mode, size, settings.engine.device, repeats=args.repeats)
        path = profile_path(
            Path(args.out_dir or settings.paths.profiles_dir),
            spec.model_id,
            settings.engine.device,
            mode,
        )
        write_atomic(path, profile.to_json().encode())
        print(
            f"{spec.model_id} {mode}: compute R^2 {profile.compute.r2:.4f} "
            f"({profile.compute.slope * 1e9:.4f} s/GFLOP + "
            f"{profile.compute.intercept * 1e3:.3f} ms), "
            f"load R^2 {profile.load.r2:.4f} ({profile.load.slope * 1e9:.4f} s/GB) -> {path}"
        )
        if profile.compute_is_flat:
            print(
                f"warning: {spec.model_id} {mode}: unit time does not follow FLOPs at {size} px "
                "on this device (kernel launches or host overhead bound the units), so the "
                "planner will find no time in skipping compute there",
                file=sys.stderr,
            )
    return 0


def cmd_up(args, settings: Settings) -> int:
    """Start every role on this machine and keep them running (a role that exits is restarted
    with backoff); only Ctrl-C or SIGTERM stops them all."""
    from backend.runtime import configure_logging, stop_event_on_signals
    from backend.services.stack import (
        UP_METRICS,
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
    metrics_ports = assign_metrics_ports(roles, settings)  # the same at every start when free
    api_key, (user, password) = stack_api_key(settings), stack_login(settings)
    for role in roles:
        if role.name == "api":
            role.env |= {"MASKSERVE_API_KEYS": api_key} if api_key else {}
            role.env |= {"MASKSERVE_USERS": f"{user}:{password}"} if user else {}
            role.env |= {"MASKSERVE_STUDIO_SHARE": "1"} if args.share else {}
    share_url_path(settings).unlink(missing_ok=True)
    configure_logging(settings, "up")  # restarts are JSON lines on stderr, like every role's log
    stack = Stack(settings, roles)
    stop = stop_event_on_signals()
    try:
        redis_url = stack.start()
        stack.serve_metrics(metrics_ports[UP_METRICS])
        base = f"http://{settings.api.host}:{settings.api.port}"
        login = f"{user} / {password}" if user else "(from MASKSERVE_USERS)"
        metrics_urls = stack.metrics_urls()  # the ports bound (also in the status file)
        role_metrics = ", ".join(
            f"{name} {url}" for name, url in metrics_urls.items() if name != UP_METRICS
        )
        print(
            f"Studio     {base}{settings.studio.path}/   (login {login})\n"
            f"REST API   {base}/v1   (docs {base}/docs, metrics {base}/metrics)\n"
            f"API key    {api_key or '(from MASKSERVE_API_KEYS)'}\nRedis      {redis_url}\n"
            f"metrics    {role_metrics}\n"
            f"restarts   {metrics_urls[UP_METRICS]} (maskserve_role_restarts_total), "
            f"{stack.status_path}\n"
            f"logs       {stack.log_dir}/<role>.log\n"
            f"roles      {', '.join(r.name for r in roles)} (restarted when they exit)\n"
            "Ctrl-C stops everything.",
            flush=True,
        )
        if stack.wait_ready(f"{base}/readyz", stop):
            print("ready", flush=True)
            if args.share:
                print(f"share      {wait_for_share_url(settings, stop)}", flush=True)
        stack.supervise(stop)
        return 0
    finally:
        stack.stop()


def cmd_submit(args, settings: Settings) -> int:
    from backend.client import submit_cli

    return submit_cli(args, settings)


# The long-running roles: CLI name -> (module, entry point taking the settings). A role's module is
# imported only when that role starts, so each process loads only what it runs.
ROLES: dict[str, tuple[str, str]] = {
    "dispatcher": ("backend.dispatch.service", "run_dispatcher"),
    "api": ("backend.api.server", "run_api"),
    "worker": ("backend.worker.service", "run_worker"),
    "cpu-worker": ("backend.tasks.celery_app", "run_cpu_worker"),
}


def cmd_role(args, settings: Settings) -> int:
    """Run the role ``args.role`` under ``runtime.run_role`` (JSON logs, exit with its parent)."""
    import importlib

    from backend.runtime import configure_logging, run_role

    configure_logging(settings, args.role)  # before the imports: their warnings are JSON lines too
    module_name, entry_name = ROLES[args.role]
    entry = getattr(importlib.import_module(module_name), entry_name)
    return run_role(args.role, entry, settings)


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
    models.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    models.set_defaults(func=cmd_models)

    def edit_options(p):
        p.add_argument(
            "--model", default=None, help=f"model id (default: MASKSERVE_MODEL or {DEFAULT_MODEL})"
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
    add_bench_parsers(bench)
    add_train_parser(sub)

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
    profile.add_argument(
        "--in-memory", action="store_true", help="build a built model without saving it"
    )
    profile.set_defaults(func=cmd_profile)

    worker = sub.add_parser("worker", help="run one engine worker (one per GPU) on its Redis inbox")
    worker.add_argument(
        "--device", default=None, help="cpu or cuda[:N] (default: MASKSERVE_DEVICE or cpu)"
    )
    worker.add_argument("--model", default=None, help="model id (default: MASKSERVE_MODEL)")
    worker.add_argument(
        "--worker-id", default=None, help="default: MASKSERVE_WORKER_ID or worker-0"
    )
    worker.add_argument("--batching", choices=BATCHING_MODES, default=None)
    worker.add_argument("--max-batch", type=int, default=None)
    worker.set_defaults(func=cmd_role, role="worker", overrides=_worker_overrides)

    cpu_worker = sub.add_parser("cpu-worker", help="run a Celery worker for pre/post-processing")
    cpu_worker.add_argument("--concurrency", type=int, default=None, help="processes (default 1)")
    cpu_worker.set_defaults(func=cmd_role, role="cpu-worker", overrides=_cpu_worker_overrides)

    dispatcher = sub.add_parser("dispatcher", help="route pre-processed jobs to engine workers")
    dispatcher.add_argument("--policy", default=None, choices=list(ROUTING_POLICIES))
    dispatcher.set_defaults(
        func=cmd_role,
        role="dispatcher",
        overrides=lambda a: {"dispatcher": {"policy": a.policy}} if a.policy else {},
    )
    api = sub.add_parser("api", help="run the REST API server")
    api.set_defaults(func=cmd_role, role="api")
    from backend.client import add_submit_arguments

    submit = sub.add_parser(
        "submit", help="submit an edit to a running MaskServe over REST and wait for it"
    )
    add_submit_arguments(submit)
    submit.set_defaults(func=cmd_submit)
    from backend.adapters.cli import add_adapter_parser

    add_adapter_parser(sub)

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
    # httpx logs every request at INFO: the client commands' own output says what happened
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for line in unknown_variables():
        logging.getLogger("maskserve").warning(line)
    try:
        return args.func(args, settings)
    except ValueError as exc:  # every user-facing error type derives from ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`maskserve bench adapters`' arguments and command (imports the benchmark only when it runs)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from backend.bench.serve_cli import comma_floats
from backend.config import Settings

ARM_NAMES = ("baseline", "one-set", "maskserve", "base-model", "join-if-pays")
DEFAULT_ARM_NAMES = ARM_NAMES[:-1]  # join-if-pays only when asked for


def add_adapters_parser(bench_sub) -> None:
    bench = bench_sub.add_parser(
        "adapters",
        help="LoRA adapters served three ways on the same traces: diffusers load+fuse per "
        "request, one adapter set per batch, MaskServe's tiers and mixed batches "
        "(docs/bench/adapters.md)",
    )
    bench.add_argument("--model", default="small-sd2-inpaint")
    bench.add_argument("--size", type=int, default=128, help="edit resolution (square), px")
    bench.add_argument("--steps", type=int, default=20)
    bench.add_argument("--adapters", type=int, default=200, help="adapters in the catalogue")
    bench.add_argument("--adapter-zipf", type=float, default=1.0, help="popularity exponent")
    bench.add_argument("--templates", type=int, default=8)
    bench.add_argument("--rps", default="0.1,0.2", help="Poisson mean rates, comma-separated")
    bench.add_argument(
        "--loads",
        default="",
        help="Poisson rates as fractions of the baseline's capacity, measured first on requests "
        "arriving at once (replaces --rps; needs the baseline arm)",
    )
    bench.add_argument(
        "--calibration-requests", type=int, default=6, help="requests the capacity is measured on"
    )
    bench.add_argument("--burst-rps", type=float, default=0.1, help="bursty trace's rate (0: none)")
    bench.add_argument("--duration-s", type=float, default=120.0)
    bench.add_argument("--max-requests", type=int, default=60, help="per trace")
    bench.add_argument("--device-mb", type=int, default=128, help="device tier budget, MB")
    bench.add_argument("--host-mb", type=int, default=512, help="host tier budget, MB")
    bench.add_argument("--join-by", type=float, default=0.2, help="join deadline, share of steps")
    bench.add_argument("--max-batch", type=int, default=8)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--arms", default=",".join(DEFAULT_ARM_NAMES), help="any of " + ", ".join(ARM_NAMES)
    )
    bench.add_argument("--work-dir", default="", help="keep the catalogue and caches here")
    bench.add_argument("--json", default="docs/bench/adapters.json")
    bench.set_defaults(func=cmd_bench_adapters)


def _floats(text: str) -> tuple[float, ...] | None:
    """Comma-separated numbers; None when one is not a number."""
    try:
        return comma_floats(text)
    except ValueError:
        return None


def cmd_bench_adapters(args, settings: Settings) -> int:
    from backend.bench.adapter_bench import AdapterBenchConfig, run_adapter_bench
    from backend.bench.adapter_report import summary_text, write_outputs, write_partial

    arms = tuple(a for a in args.arms.split(",") if a)
    unknown = sorted(set(arms) - set(ARM_NAMES))
    rates, loads = _floats(args.rps), _floats(args.loads)
    if unknown or not arms or not rates or args.adapters < 1 or args.max_requests < 1:
        print(
            f"error: arms must be some of {', '.join(ARM_NAMES)} (unknown: {unknown}), --rps "
            "at least one rate, --adapters and --max-requests at least 1",
            file=sys.stderr,
        )
        return 2
    bad_loads = loads is None or any(load <= 0 for load in loads)
    if bad_loads or loads and ("baseline" not in arms or args.calibration_requests < 1):
        print(
            "error: --loads are positive fractions of the baseline's measured capacity: keep "
            "the baseline arm in --arms and --calibration-requests at least 1",
            file=sys.stderr,
        )
        return 2
    cfg = AdapterBenchConfig(
        model_id=args.model,
        size=args.size,
        steps=args.steps,
        num_adapters=args.adapters,
        adapter_zipf=args.adapter_zipf,
        num_templates=args.templates,
        rps=rates,
        burst_rps=args.burst_rps,
        duration_s=args.duration_s,
        max_requests=args.max_requests,
        device_mb=args.device_mb,
        host_mb=args.host_mb,
        join_by=args.join_by,
        max_batch=args.max_batch,
        seed=args.seed,
        arms=arms,
        loads=loads or (),
        calibration_requests=args.calibration_requests,
    )
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="adapters-"))
    try:
        paths = settings.paths.model_copy(
            update={"data_dir": work, "cache_dir": work / "template_cache"}
        )
        partial = Path(args.json).with_suffix(".partial.json")
        run = run_adapter_bench(
            cfg,
            settings.model_copy(update={"paths": paths}),
            work,
            on_result=lambda results: write_partial(asdict(cfg), results, partial),
        )
        partial.unlink(missing_ok=True)
    except ValueError as exc:  # a trace without requests, known only once the rates are set
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    report = write_outputs({**asdict(cfg), "device": settings.engine.device}, run, Path(args.json))
    print(summary_text(report))
    print(f"wrote {args.json} and {Path(args.json).with_suffix('.png')}")
    return 0

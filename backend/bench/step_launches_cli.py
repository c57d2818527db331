"""`maskserve bench step-launches`: arguments and printed lines (``backend.bench.step_launches``
measures; it is imported only when the command runs)."""

from __future__ import annotations

from pathlib import Path

from backend.config import Settings

MODELS = "tiny-sd2-inpaint,tiny-sdxl-inpaint,tiny-flux-fill"


def add_step_launches_parser(bench_sub) -> None:
    cmd = bench_sub.add_parser(
        "step-launches",
        help="operators one step launches: dense, mask-aware exact and bucketed "
        "(docs/bench/step-launches.md)",
    )
    cmd.add_argument("--models", default=MODELS, help="comma list")
    cmd.add_argument("--size", type=int, default=None, help="px (default: each model's own)")
    cmd.add_argument("--requests", default="1,2,4")
    cmd.add_argument("--mode", choices=("kv", "hidden"), default="kv")
    cmd.add_argument("--json", required=True)
    cmd.set_defaults(func=cmd_bench_step_launches)


def cmd_bench_step_launches(args, settings: Settings) -> int:
    from backend.bench.commands import request_counts
    from backend.bench.step_launches import (
        run_step_launches,
        summary_lines,
        write_step_launches,
    )
    from backend.engine.factory import DTYPES

    counts = request_counts(args.requests)
    models = [m for m in args.models.split(",") if m]
    if not models:
        raise ValueError("--models: one or more model ids separated by commas")
    records = []
    for model in models:
        records += run_step_launches(
            model,
            counts,
            settings.paths.resolved_models_dir(),
            settings.paths.resolved_cache_dir(),
            size=args.size,
            mode=args.mode,
            device=settings.engine.device,
            dtype=DTYPES[settings.engine.dtype],
        )
    plot = write_step_launches(records, Path(args.json))
    print("\n".join(summary_lines(records)))
    print(f"wrote {args.json} and {plot}")
    return 0

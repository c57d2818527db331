"""`maskserve bench worker-deadlines`: its arguments and command (``worker_deadlines`` runs it;
imported only when the command runs, so `maskserve --help` stays light)."""

from __future__ import annotations

import argparse
from pathlib import Path

from backend.bench.route_deadlines_cli import add_serve_classes
from backend.config import Settings

DEFAULT_JSON = "docs/bench/worker-deadlines.json"


def config_of(args, settings: Settings):
    """The bench's ``WorkerDeadlineConfig`` from the parsed arguments; rounds and the churn bound
    not given come from ``settings.deadlines``."""
    from backend.bench.worker_deadlines import WorkerDeadlineConfig

    def split(text: str, kind=str) -> tuple:
        return tuple(kind(x) for x in text.split(",") if x)

    d = settings.deadlines
    return WorkerDeadlineConfig(
        model_id=args.model,
        size=args.size,
        steps=args.steps,
        max_batch=args.max_batch,
        num_templates=args.templates,
        ram_templates=args.ram_templates or args.templates,
        mask_mean=args.mask_mean,
        duration_s=args.duration,
        seed=args.seed,
        schedulers=split(args.schedulers),
        traces=split(args.traces),
        loads=split(args.loads, float),
        interactive_share=args.interactive_share,
        serve_classes=split(args.serve_classes),
        interactive_x=args.interactive_x,
        batch_x=args.batch_x,
        max_wait_x=args.max_wait_x,
        interactive_target_s=args.interactive_target,
        batch_target_s=args.batch_target,
        max_wait_s=args.max_wait,
        burst_factor=args.burst_factor,
        burst_share=args.burst_share,
        burst_s=args.burst_s,
        round_steps=args.round_steps or d.round_steps,
        max_parks_per_round=(
            d.max_parks_per_round if args.max_parks_per_round < 0 else args.max_parks_per_round
        ),
        capacity_rps=args.capacity_rps,
        repeats=args.repeats,
        torch_threads=args.threads,
        speed_band=args.speed_band,
        retries=args.retries,
    )


def cmd_bench_worker_deadlines(args, settings: Settings) -> int:
    from backend.bench.worker_deadlines import run_worker_deadline_bench
    from backend.bench.worker_deadlines_report import (
        forecast_table,
        mean_table,
        speed_lines,
        table,
        target_lines,
        write_outputs,
    )

    report = run_worker_deadline_bench(config_of(args, settings), settings)
    plot = write_outputs(report, Path(args.json))
    print(report["device"])
    print(table(report))
    print(mean_table(report))
    print(forecast_table(report))
    for line in [*target_lines(report), *speed_lines(report)]:
        print(line)
    if not report["targets"]:
        print(f"only {args.serve_classes} served: a reference, no target judged")
    print(f"wrote {args.json} and {plot}")
    return 0


def add_worker_deadlines_parser(bench_sub) -> argparse.ArgumentParser:
    """``bench worker-deadlines``: the step scheduler's rounds and churn bound default to
    ``Settings.deadlines``; targets and the starvation bound default to multiples of the measured
    single-job service time."""
    p = bench_sub.add_parser(
        "worker-deadlines",
        help="one real engine worker under deadlines: step schedulers (fifo, edf, slack and "
        "its variants) side by side on the same mixed-class Poisson and bursty traces",
    )
    p.add_argument("--model", default="tiny-sd2-inpaint")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--templates", type=int, default=8, help="templates in the Zipf popularity")
    p.add_argument("--ram-templates", type=int, default=0, help="RAM tier budget (0: all)")
    p.add_argument("--mask-mean", type=float, default=0.11)
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument(
        "--schedulers",
        default="fifo,edf,slack",
        help="fifo, edf, slack, or a slack variant: slack-noshrink, slack-nosize, slack-margin, "
        "slack-everystep, slack-parks2, slack-parks8, slack-nourgent, slack-anypark, slack-nokeep",
    )
    p.add_argument("--traces", default="poisson,bursty")
    p.add_argument("--loads", default="0.8,1.0", help="fractions of the measured capacity")
    p.add_argument("--interactive-share", type=float, default=0.3)
    add_serve_classes(p)
    p.add_argument(
        "--interactive-x", type=float, default=5.0, help="target / single-job service time"
    )
    p.add_argument("--batch-x", type=float, default=100.0, help="target / single-job time")
    p.add_argument(
        "--max-wait-x", type=float, default=50.0, help="starvation bound / single-job time"
    )
    p.add_argument("--interactive-target", type=float, default=0.0, help="seconds (0: -x)")
    p.add_argument("--batch-target", type=float, default=0.0, help="seconds (0: --batch-x)")
    p.add_argument("--max-wait", type=float, default=0.0, help="seconds (0: --max-wait-x)")
    p.add_argument("--burst-factor", type=float, default=10.0, help="burst rate / mean rate")
    p.add_argument("--burst-share", type=float, default=0.05, help="share of time in bursts")
    p.add_argument("--burst-s", type=float, default=1.0, help="mean burst length (s)")
    p.add_argument(
        "--capacity-rps", type=float, default=0.0, help="loads as fractions of this rate"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each (process, load), the arms' order rotated each time; figures against "
        "fifo are paired within a repeat and averaged",
    )
    p.add_argument(
        "--round-steps", type=int, default=0, help="steps per planning round (0: settings)"
    )
    p.add_argument(
        "--max-parks-per-round",
        type=int,
        default=-1,
        help="the churn bound: rows parked per round, for rounds and shrinking (-1: settings)",
    )
    p.add_argument(
        "--speed-band",
        type=float,
        default=1.3,
        help="run again a run whose median step ran more than this many times slower or faster "
        "than at calibration (<= 1: never)",
    )
    p.add_argument("--retries", type=int, default=2, help="most reruns of a run out of the band")
    p.add_argument(
        "--threads", type=int, default=1, help="the worker's torch threads (the stack: every core)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=DEFAULT_JSON)
    p.set_defaults(func=cmd_bench_worker_deadlines)
    return p

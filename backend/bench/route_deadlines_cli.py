"""`maskserve bench route-deadlines`: its arguments and command (``route_deadlines`` runs it;
imported only when the command runs, so `maskserve --help` stays light)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backend.config import Settings

DEFAULT_JSON = "docs/bench/route-deadlines.json"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def cmd_bench_route_deadlines(args, settings: Settings) -> int:
    from dataclasses import replace

    from backend.bench.route_deadlines import (
        DeadlineBenchConfig,
        run_deadline_bench,
        summarize_seeds,
        table,
        write_outputs,
    )
    from backend.bench.seeds import parse_seeds
    from backend.bench.step_shape import load_shape

    d = settings.deadlines
    cfg = DeadlineBenchConfig(
        model_id=args.model,
        device=args.device_kind,
        profiles_dir=args.profiles_dir or str(settings.paths.profiles_dir),
        duration_s=args.duration,
        num_workers=args.workers,
        max_batch=args.max_batch,
        steps=args.steps,
        num_templates=args.templates,
        ram_templates=args.ram_templates,
        mask_mean=args.mask_mean,
        drift_cv=args.drift_cv,
        drift_tau_s=args.drift_tau,
        step_clock=args.step_clock,
        step_shape=load_shape(args.step_shape),
        capacity_rps=args.capacity_rps,
        seed=args.seed,
        schedulers=_names(args.schedulers),
        traces=_names(args.traces),
        loads=_floats(args.loads),
        interactive_share=args.interactive_share,
        serve_classes=_names(args.serve_classes),
        interactive_target_s=args.interactive_target or d.interactive_target_s,
        batch_target_s=args.batch_target or d.batch_target_s,
        burst_factor=args.burst_factor,
        burst_share=args.burst_share,
        burst_s=args.burst_s,
        round_steps=d.round_steps,
        max_wait_s=d.max_wait_s,
        max_parks_per_round=d.max_parks_per_round,
        urgent_parks=d.urgent_parks,
        park_by_deadline=d.park_by_deadline,
        keep_slot_while_reading=d.keep_slot_while_reading,
        shed=not args.no_shed,
        shed_classes=tuple(d.shed_classes),
        late_factor=d.late_factor,
        max_queue=d.max_queue,
    )
    seeds = parse_seeds(args.seeds, args.seed)
    json_path, reports = Path(args.json), []
    for seed in seeds:
        one = replace(cfg, seed=seed)
        reports.append(
            run_deadline_bench(one, progress=lambda line, s=seed: print(f"seed {s}: {line}"))
        )
        if len(seeds) > 1:
            path = json_path.with_name(f"{json_path.stem}-seed{seed}.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(reports[-1], indent=1))
    report = reports[0] if len(seeds) == 1 else summarize_seeds(reports)
    plot = write_outputs(report, json_path)
    print(
        f"capacity {report['capacity_rps']:.2f} req/s ({cfg.num_workers} workers)"
        + (f"; the mean over seeds {seeds}" if len(seeds) > 1 else "")
    )
    print(table(report))
    for kind, t in report["targets"].items():
        print(
            f"{kind}, loads 0.8-1.0, slack vs fifo: interactive attainment "
            f"+{t['interactive_points_min']:.1f} points at least "
            f"({'met' if t['interactive_30_points'] else 'NOT met'}: >= 30); batch throughput "
            f"x{t['batch_throughput_ratio_min']:.3f} at worst "
            f"({'met' if t['batch_throughput_within_5pct'] else 'NOT met'}: >= 0.95); "
            f"longest wait {t['max_wait_s']:.0f} s, {t['starved_jobs']} starved "
            f"({'met' if t['no_job_starved'] else 'NOT met'})"
        )
    if not report["targets"]:
        print(f"only {args.serve_classes} served: a reference, no target judged")
    print(f"wrote {args.json} and {plot}")
    return 0


def add_serve_classes(p: argparse.ArgumentParser) -> None:
    """``--serve-classes``, shared by both deadline benches."""
    p.add_argument(
        "--serve-classes",
        default="interactive,batch",
        help="classes whose jobs arrive (interactive: the same interactive jobs with the "
        "workers to themselves, a reference for how many this device serves on time at all)",
    )


def add_route_deadlines_parser(bench_sub) -> argparse.ArgumentParser:
    """``bench route-deadlines``: arguments default to ``Settings.deadlines`` where it has them
    (targets, rounds, bounds, shedding)."""
    p = bench_sub.add_parser(
        "route-deadlines",
        help="step schedulers (fifo, edf, slack) side by side under deadlines: mixed classes, "
        "Poisson and bursty traces, in the route simulation",
    )
    p.add_argument("--model", default="small-flux-fill")
    p.add_argument("--device-kind", default="cpu", help="the profile's device kind")
    p.add_argument("--profiles-dir", default=None)
    p.add_argument("--schedulers", default="fifo,edf,slack")
    p.add_argument("--traces", default="poisson,bursty")
    p.add_argument("--loads", default="0.5,0.8,0.9,1.0,1.2", help="fractions of the capacity")
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--templates", type=int, default=200)
    p.add_argument("--ram-templates", type=int, default=8, help="per worker")
    p.add_argument("--mask-mean", type=float, default=0.11)
    p.add_argument("--interactive-share", type=float, default=0.3)
    add_serve_classes(p)
    p.add_argument(
        "--interactive-target", type=float, default=0.0, help="seconds (0: deadlines settings)"
    )
    p.add_argument("--batch-target", type=float, default=0.0, help="seconds (0: settings)")
    p.add_argument("--burst-factor", type=float, default=20.0, help="burst rate / mean rate")
    p.add_argument("--burst-share", type=float, default=0.02, help="share of time in bursts")
    p.add_argument("--burst-s", type=float, default=3.0, help="mean burst length (s)")
    p.add_argument(
        "--capacity-rps", type=float, default=0.0, help="loads as fractions of this rate"
    )
    p.add_argument("--no-shed", action="store_true", help="no admission control (no 429s)")
    p.add_argument(
        "--drift-cv",
        type=float,
        default=0.0,
        help="each worker's machine speed drifts: cv of its slowdown (0: no drift)",
    )
    p.add_argument("--drift-tau", type=float, default=5.0, help="the drift's correlation time (s)")
    p.add_argument(
        "--step-clock",
        action="store_true",
        help="workers calibrate their step predictions on their steps, as the engine worker does",
    )
    p.add_argument(
        "--step-shape",
        default="",
        help="price steps with a measured worker's growth with rows: a `bench worker-deadlines` "
        "JSON, or factors per row count (1,1.1,...; the last beyond)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seeds",
        default="",
        help="seeds and ranges (0,1,2 or 3-12): one run per seed (its JSON beside --json), "
        "--json and its plot the mean",
    )
    p.add_argument("--json", default=DEFAULT_JSON)
    p.set_defaults(func=cmd_bench_route_deadlines)
    return p

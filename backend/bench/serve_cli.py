"""`maskserve bench serve`'s arguments and command (imports the benchmark only when it runs)."""

from __future__ import annotations

import sys
from pathlib import Path

from backend.bench.serve_stats import ARMS
from backend.config import Settings


def comma_floats(text: str) -> tuple[float, ...]:
    """``"0.5,1, 2"`` -> (0.5, 1.0, 2.0); empty parts are skipped."""
    return tuple(float(part) for part in text.split(",") if part.strip())


def add_serve_parser(bench_sub) -> None:
    serve = bench_sub.add_parser(
        "serve",
        help="MaskServe against the ordinary pipeline behind the same stack, under load: "
        "latency against rate, sustained throughput, quality (docs/bench/serve.md)",
    )
    serve.add_argument("--model", default="tiny-sd2-inpaint")
    serve.add_argument("--size", type=int, default=128, help="edit resolution (square), px")
    serve.add_argument("--steps", type=int, default=20)
    serve.add_argument("--rps", default="0.5,1,2,4", help="Poisson mean rates, comma-separated")
    serve.add_argument("--burst-rps", default="1", help="mean rates of bursty traces ('' for none)")
    serve.add_argument("--burst-factor", type=float, default=10.0, help="burst rate / mean")
    serve.add_argument("--duration-s", type=float, default=60.0, help="length of each trace")
    serve.add_argument("--max-requests", type=int, default=200, help="per trace (<= 500)")
    serve.add_argument("--templates", type=int, default=8)
    serve.add_argument("--mask-mean", type=float, default=0.11, help="0.11 production, 0.19 public")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--arms", default=",".join(ARMS), help="any of " + ", ".join(ARMS))
    serve.add_argument("--no-cold", action="store_true", help="skip the cold-cache variant")
    serve.add_argument("--slo", type=float, default=0.0, help="P95 bound, s (0: the factor)")
    serve.add_argument(
        "--slo-factor", type=float, default=5.0, help="P95 bound = this x the arm's single latency"
    )
    serve.add_argument("--warmup", type=int, default=2, help="jobs per arm before timing")
    serve.add_argument("--single", type=int, default=3, help="jobs timed one at a time per arm")
    serve.add_argument("--quality", type=int, default=24, help="results compared per arm")
    serve.add_argument("--drain-s", type=float, default=300.0, help="wait after the last arrival")
    serve.add_argument("--max-batch", type=int, default=8)
    serve.add_argument(
        "--all-rates", action="store_true", help="run every rate even past an arm's saturation"
    )
    serve.add_argument("--data-dir", default="", help="parent of each arm's data directory")
    serve.add_argument("--url", default="", help="drive a running stack instead (no restarts)")
    serve.add_argument("--api-key", dest="api_key", default="", help="with --url")
    serve.add_argument("--json", default="docs/bench/serve.json")
    serve.add_argument("--no-progress", action="store_true")
    serve.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args, settings: Settings) -> int:
    from backend.bench.serve import ServeConfig, run_serve
    from backend.bench.serve_report import build_report, summary_text, write_outputs

    try:
        cfg = ServeConfig(
            model_id=args.model,
            size=args.size,
            steps=args.steps,
            rps=comma_floats(args.rps),
            burst_rps=comma_floats(args.burst_rps),
            burst_factor=args.burst_factor,
            duration_s=args.duration_s,
            max_requests=args.max_requests,
            templates=args.templates,
            mask_mean=args.mask_mean,
            seed=args.seed,
            arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
            cold=not args.no_cold,
            slo_s=args.slo,
            slo_factor=args.slo_factor,
            warmup=args.warmup,
            single=args.single,
            quality=args.quality,
            drain_s=args.drain_s,
            max_batch=args.max_batch,
            stop_after_saturation=not args.all_rates,
            data_dir=args.data_dir,
            url=args.url,
            api_key=args.api_key,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        raw = run_serve(cfg, settings, progress=not args.no_progress)
    except RuntimeError as exc:  # a stack never got ready, or a warm-up job failed
        print(f"error: bench serve stopped: {exc}", file=sys.stderr)
        return 1
    report = build_report(raw, cfg)
    print(summary_text(report))
    png = write_outputs(report, Path(args.json))
    print(f"wrote {args.json} and {png}")
    return 0

"""`maskserve bench adapter-quality`: arguments, printed tables, JSON and plot
(``backend.bench.adapter_quality`` measures; it is imported only when the command runs)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from backend.config import Settings

PARTS = ("fidelity", "late", "join")


def add_adapter_quality_parser(bench_sub) -> None:
    cmd = bench_sub.add_parser(
        "adapter-quality",
        help="LoRA adapters on template caches and late joins against the ordinary pipeline with "
        "the same adapters, and each adapter's join step (docs/bench/adapters-quality.md)",
    )
    cmd.add_argument(
        "--models", default="demo-sd2-inpaint,tiny-sdxl-inpaint,tiny-flux-fill", help="comma list"
    )
    cmd.add_argument("--ratios", default="0.05,0.1,0.2,0.3,0.5", help="mask ratios")
    cmd.add_argument("--per-ratio", type=int, default=2, help="cases (templates) per ratio")
    cmd.add_argument("--steps", type=int, default=20)
    cmd.add_argument("--size", type=int, default=128, help="edit resolution (square), px")
    cmd.add_argument("--late-ratio", type=float, default=0.2, help="late-join cases' mask ratio")
    cmd.add_argument("--parts", default=",".join(PARTS), help="any of " + ", ".join(PARTS))
    cmd.add_argument("--json", default="docs/bench/adapter-quality.json")
    cmd.set_defaults(func=cmd_bench_adapter_quality)


def cmd_bench_adapter_quality(args, settings: Settings) -> int:
    from backend.bench.adapter_quality import QualityConfig, run_adapter_quality, summarise

    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"error: unknown parts {', '.join(unknown)}: use {', '.join(PARTS)}")
    ratios = tuple(float(r) for r in args.ratios.split(","))
    if args.late_ratio not in ratios:
        raise SystemExit(f"error: --late-ratio {args.late_ratio} must be one of --ratios")
    cfg = QualityConfig(
        models=tuple(args.models.split(",")),
        ratios=ratios,
        per_ratio=args.per_ratio,
        steps=args.steps,
        size=args.size,
        late_ratio=args.late_ratio,
        parts=parts,
    )
    records = run_adapter_quality(cfg, settings.paths.resolved_models_dir())
    summary = summarise(records)
    print(tables(summary, cfg.steps))
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(
        json.dumps({"config": _config(cfg), "summary": summary, "records": records}, indent=1)
    )
    plot(summary, cfg.steps, json_path.with_suffix(".png"))
    print(f"wrote {json_path} and {json_path.with_suffix('.png')}")
    return 0


def _config(cfg) -> dict:
    from backend.bench.adapter_quality import MEASURED, RANK, STRENGTHS

    return asdict(cfg) | {"strengths": STRENGTHS, "measured": MEASURED, "rank": RANK}


def _cells(row: dict) -> str:
    return (
        f"SSIM {row['ssim']:.3f} (mask {row['ssim_masked']:.3f})  "
        f"PSNR {row['psnr']:5.1f} dB (mask {row['psnr_masked']:5.1f} dB)  n={row['cases']}"
    )


def tables(summary: dict, steps: int) -> str:
    """The three tables as text: fidelity per model/arm/ratio, late join per model/k, join
    steps per model/adapter."""
    lines = ["fidelity (each arm against its own ordinary pipeline result)"]
    for model, arms in summary["fidelity"].items():
        for arm, by_ratio in arms.items():
            for ratio, row in by_ratio.items():
                lines.append(f"  {model:18s} {arm:19s} m={ratio:<5} {_cells(row)}")
    lines.append("late join (adapter from step k on the base cache vs ordinary from step 0)")
    for model, by_cache in summary["late"].items():
        for cache, by_k in by_cache.items():
            for k, row in by_k.items():
                lines.append(f"  {model:18s} cache {cache:4s} k={k:>2}/{steps} {_cells(row)}")
    lines.append("join step: first step with latent cosine < 0.99 (with vs without the adapter)")
    for model, by_adapter in summary["join"].items():
        for adapter, step in by_adapter.items():
            shown = "never" if step is None else f"step {step} of {steps}"
            lines.append(f"  {model:18s} {adapter:7s} {shown}")
    return "\n".join(lines)


def plot(summary: dict, steps: int, path: Path) -> None:
    """Left: SSIM inside the mask against the mask ratio per model and arm; right: SSIM inside
    the mask against the join step k (the dotted line: the default deadline, 20% of steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"base-cache": ":", "adapter-base-cache": "-", "adapter-pinned": "--"}
    for model, arms in summary["fidelity"].items():
        for arm, style in styles.items():
            by_ratio = arms.get(arm, {})
            xs = [float(r) for r in by_ratio]
            left.plot(
                xs,
                [row["ssim_masked"] for row in by_ratio.values()],
                style,
                marker="o",
                label=f"{model} {arm}",
            )
    left.set(xlabel="mask ratio", ylabel="SSIM inside the mask", title="fidelity vs ordinary")
    left.legend(fontsize=6)
    for model, by_cache in summary["late"].items():
        for cache, by_k in by_cache.items():
            right.plot(
                [int(k) for k in by_k],
                [row["ssim_masked"] for row in by_k.values()],
                "-" if cache == "base" else "--",
                marker="o",
                label=f"{model} (cache {cache})",
            )
    right.axvline(0.2 * steps, linestyle=":", color="grey")
    right.set(
        xlabel=f"join step k (of {steps})",
        ylabel="SSIM inside the mask",
        title="late join vs ordinary with the adapter from step 0",
    )
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The report of `maskserve bench serve`: figures, quality against the baseline, JSON and plots.

``build_report`` turns ``run_serve``'s raw results into the JSON written to disk: the run's
settings and machine, every arm's single-request latency and SLO, per (arm, trace) figures
(``serve_stats.summarize``), the headline ratios, quality, and every raw per-request record
(seeds included, so any request can be replayed). ``plot`` draws latency against offered rate
per arm (mean and P95, like FlashPS's Fig. 12) beside the breakdown of a job's time per arm at
the baseline's saturation rate.

Quality pairs the same request (same trace, index, seed) across arms: each MaskServe arm's
result against the baseline's (SSIM and PSNR over the whole image and inside the mask), and
every arm's result against its template outside the mask, which must be identical pixel for
pixel.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from backend.bench.serve import COLD, TEMPLATE_SEED, ServeConfig
from backend.bench.serve_load import request_mask
from backend.bench.serve_stats import (
    ARM_TITLES,
    ARMS,
    headline,
    slo_bound,
    summarize,
    trace_rate,
)
from backend.bench.trace import TraceRequest
from backend.imaging.quality import psnr, ssim
from templates_store.samples import sample_template


def build_report(raw: dict, cfg: ServeConfig) -> dict:
    results = raw["results"]
    records = [record for result in results for record in result.records]
    summary = summarize(record for record in records if record.trace != "single")
    singles = {result.arm: result.single_s for result in results}
    slos = {arm: slo_bound(single, cfg.slo_factor, cfg.slo_s) for arm, single in singles.items()}
    warm = {arm: by_trace for arm, by_trace in summary.items() if arm != COLD}
    return {
        **{k: v for k, v in raw.items() if k != "results"},
        "single_s": singles,
        "slo_s": slos,
        "stack_start_s": {result.arm: result.started_s for result in results},
        "skipped": {result.arm: result.skipped for result in results},
        "summary": summary,
        "headline": headline(warm, slos),
        "quality": quality(results, cfg),
        "records": [asdict(record) for record in records],
    }


def quality(results: list, cfg: ServeConfig) -> dict:
    """Per arm: its results against the baseline's for the same requests, and outside the mask
    against the template."""
    by_arm = {result.arm: result for result in results}
    base = by_arm.get("baseline")
    out = {}
    for arm, result in by_arm.items():
        records = {r.index: r for r in result.records if r.trace == result.quality_trace}
        figures: dict = {"trace": result.quality_trace, "results": len(result.images)}
        pairs = []
        identical = 0
        for index, image in sorted(result.images.items()):
            record = records[index]
            mask = request_mask(
                TraceRequest(index, 0.0, record.template, record.mask_ratio, record.seed), cfg.size
            )
            template = np.asarray(
                sample_template(cfg.size, cfg.size, seed=TEMPLATE_SEED + record.template)
            )
            identical += bool(np.array_equal(image[~mask], template[~mask]))
            if base is not None and arm != "baseline" and index in base.images:
                pairs.append(_compare(image, base.images[index], mask))
        figures["outside_identical"] = identical
        if pairs:
            figures["against_baseline"] = _aggregate(pairs)
        out[arm] = figures
    return out


def _compare(image: np.ndarray, reference: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    return {
        "ssim": ssim(image, reference),
        "ssim_mask": ssim(image, reference, mask),
        "psnr": psnr(image, reference),
        "psnr_mask": psnr(image, reference, mask),
    }


def _aggregate(pairs: list[dict[str, float]]) -> dict:
    """Means and minima; PSNR means over the finite values (identical pairs counted apart)."""
    out: dict = {"pairs": len(pairs)}
    for key in pairs[0]:
        values = [p[key] for p in pairs]
        finite = [v for v in values if math.isfinite(v)]
        out[f"{key}_mean"] = sum(finite) / len(finite) if finite else math.inf
        out[f"{key}_min"] = min(values)
    out["identical"] = sum(p["psnr"] == math.inf for p in pairs)
    return out


# ----- outputs -----------------------------------------------------------------------------------
def write_outputs(report: dict, json_path: Path) -> Path:
    """The JSON at ``json_path`` and the plot beside it (same name, ``.png``)."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    png = json_path.with_suffix(".png")
    plot(report, png)
    return png


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, summary = report["config"], report["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for arm, by_trace in _in_arm_order(summary):
        points = sorted(
            (trace_rate(name), f) for name, f in by_trace.items() if name.startswith("poisson@")
        )
        points = [(rate, f) for rate, f in points if "mean_s" in f]
        if not points:
            continue
        rates = [rate for rate, _ in points]
        line = left.plot(rates, [f["mean_s"] for _, f in points], "o-", label=f"{arm} mean")
        left.plot(
            rates, [f["p95_s"] for _, f in points], "x--", color=line[0].get_color(), label="P95"
        )
    left.set(xlabel="offered load (requests/s, Poisson)", ylabel="latency (s)", yscale="log")
    left.set_title("latency against load")
    left.legend(fontsize=7)
    _plot_breakdown(right, report)
    fig.suptitle(
        f"bench serve: {cfg['model_id']} {cfg['size']} px, {cfg['steps']} steps, "
        f"mask mean {cfg['mask_mean']} - {report['machine']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _in_arm_order(summary: dict[str, dict]) -> list[tuple[str, dict]]:
    """The arms as the run orders them (baseline first), whatever order the JSON kept."""
    order = [*ARMS, COLD]
    return sorted(
        summary.items(), key=lambda item: order.index(item[0]) if item[0] in order else 99
    )


def _plot_breakdown(axis, report: dict) -> None:
    """Stacked mean stage times per arm at the baseline's saturation trace (else the lowest)."""
    summary = report["summary"]
    trace = report["headline"]["saturation_trace"] or min(
        (n for f in summary.values() for n in f if n.startswith("poisson@")),
        key=trace_rate,
        default=None,
    )
    arms = [
        arm for arm, by_trace in _in_arm_order(summary) if "breakdown_s" in by_trace.get(trace, {})
    ]
    bottoms = np.zeros(len(arms))
    stages = ("queue", "pre", "wait", "denoise", "post", "other")
    for stage in stages:
        heights = np.array([summary[arm][trace]["breakdown_s"][stage] for arm in arms])
        axis.bar(arms, heights, bottom=bottoms, label=stage)
        bottoms += heights
    axis.set(ylabel="mean seconds per done job", title=f"where a job's time goes at {trace}")
    axis.legend(fontsize=7)


def summary_text(report: dict) -> str:
    """The printed table: per arm and trace, then the headline and quality."""
    lines = []
    for arm, by_trace in _in_arm_order(report["summary"]):
        single, slo = report["single_s"].get(arm), report["slo_s"].get(arm)
        lines.append(f"{arm}: {ARM_TITLES.get(arm, arm)}; single {_s(single)}, SLO P95 {_s(slo)}")
        for name, f in sorted(by_trace.items(), key=lambda item: (item[0][0], trace_rate(item[0]))):
            if "mean_s" not in f:
                lines.append(f"  {name:14s} {f['done']}/{f['requests']} done: {f['statuses']}")
                continue
            lines.append(
                f"  {name:14s} {f['done']:3d}/{f['requests']:<3d} mean {f['mean_s']:7.2f} s  "
                f"P50 {f['p50_s']:7.2f}  P95 {f['p95_s']:7.2f}  P99 {f['p99_s']:7.2f}  "
                f"throughput {f['throughput_rps']:5.2f}/s"
            )
        if report["skipped"].get(arm):
            lines.append(f"  skipped (saturated below): {', '.join(report['skipped'][arm])}")
    head = report["headline"]
    lines.append(f"sustained rate (P95 within SLO): {_rates(head['sustained_rps'])}")
    lines.append(
        f"baseline saturation: sustains {head['saturation_trace']}, "
        f"breaks its SLO from {head['past_saturation_trace']}"
    )
    for arm in ("nocache", "full"):
        if arm in head:
            gains = head[arm]
            lines.append(
                f"{arm} vs baseline: mean latency {_x(gains['latency_gain'])} lower at the "
                f"baseline's saturation, {_x(gains['latency_gain_past'])} just past it; "
                f"sustained rate {_x(gains['throughput_gain'])}; peak throughput "
                f"{_x(gains['peak_gain'])}"
            )
    for arm, q in report["quality"].items():
        text = f"quality {arm}: outside the mask identical {q['outside_identical']}/{q['results']}"
        if "against_baseline" in q:
            b = q["against_baseline"]
            text += (
                f"; vs baseline SSIM {b['ssim_mean']:.3f} (mask {b['ssim_mask_mean']:.3f}), "
                f"PSNR {b['psnr_mean']:.1f} dB (mask {b['psnr_mask_mean']:.1f}), {b['pairs']} pairs"
            )
        lines.append(text)
    return "\n".join(lines)


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _rates(rates: dict) -> str:
    return ", ".join(f"{arm} {'-' if r is None else f'{r:g}/s'}" for arm, r in rates.items())

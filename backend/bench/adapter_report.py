"""`maskserve bench adapters`' figures: per run tables, the headline ratios against the issue's
targets, JSON and a PNG plot. Pure over the results (numbers in, numbers out), so it is tested on
made-up results.

Definitions: the baseline's capacity is the rate it measured on requests arriving at once before
the runs (``--loads``), else its highest throughput over the Poisson runs; its saturation rate is
the highest Poisson rate not above that capacity (the lowest rate when every rate is above it).
"80% load" is the Poisson rate closest to 0.8 x MaskServe's capacity.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from backend.bench.adapter_bench import ArmResult

TARGETS = {"latency_x": 7.8, "mixed_throughput_share": 0.85, "blocked_share": 0.05}


def _by(results: list[ArmResult], arm: str, trace: str = "poisson") -> dict[float, ArmResult]:
    return {r.rps: r for r in results if r.arm == arm and r.trace == trace}


def headline(results: list[ArmResult], baseline_capacity: float | None = None) -> dict:
    """Ratios at the reference points (module docstring); absent arms give no entry.
    ``baseline_capacity``: the baseline's measured capacity, when it was calibrated."""
    out: dict = {}
    baseline, ours = _by(results, "baseline"), _by(results, "maskserve")
    if baseline and ours:
        capacity = baseline_capacity or max(r.throughput_rps for r in baseline.values())
        below = [rate for rate in baseline if rate <= capacity * 1.0001]
        rate = max(below) if below else min(baseline)
        if rate in ours:
            out["baseline_capacity_rps"] = capacity
            out["saturation_rps"] = rate
            out["latency_x"] = baseline[rate].avg_latency_s / ours[rate].avg_latency_s
            out["p95_x"] = baseline[rate].p95_latency_s / ours[rate].p95_latency_s
            past = sorted(r for r in baseline if r > rate and r in ours)
            if past:  # the next rate: the baseline's queue grows, MaskServe's need not
                out["past_rps"] = past[0]
                out["latency_x_past"] = (
                    baseline[past[0]].avg_latency_s / ours[past[0]].avg_latency_s
                )
    base = _by(results, "base-model")
    if ours and base:
        out["mixed_throughput_share"] = max(r.throughput_rps for r in ours.values()) / max(
            r.throughput_rps for r in base.values()
        )
    if ours:
        capacity = max(r.throughput_rps for r in ours.values())
        rate = min(ours, key=lambda r: abs(r - 0.8 * capacity))
        run = ours[rate]
        out["load80_rps"] = rate
        out["blocked_share"] = (
            run.rows_blocked / run.rows_with_adapters if run.rows_with_adapters else 0.0
        )
    one_set = _by(results, "one-set")
    if one_set and ours:
        common = sorted(set(one_set) & set(ours))
        if common:
            rate = common[-1]
            out["one_set_latency_x"] = one_set[rate].avg_latency_s / ours[rate].avg_latency_s
    pays = _by(results, "join-if-pays")
    if pays and ours and (common := sorted(set(pays) & set(ours))):
        # the join rule's gain: MaskServe's mean over that with rows joining only when it pays,
        # at the highest rate both ran
        rate = common[-1]
        out["join_if_pays_latency_x"] = ours[rate].avg_latency_s / pays[rate].avg_latency_s
    return out


def device_hit_ratio(result: ArmResult) -> float:
    asked = sum(result.hits.values())
    return result.hits.get("device", 0) / asked if asked else 0.0


def _detail_lines(r: dict) -> list[str]:
    """A run's optional lines: its stage split (MaskServe's arms), its adapter phases (baseline)."""
    lines = []
    if split := r.get("split"):
        lines.append(
            f"{r['arm']} {r['trace']} {r['rps']:.4g}: mean per request, pre-processing "
            f"{split['preprocess_s']:.2f} s + queue {split['queue_s']:.2f} s + admission "
            f"{split['admit_s']:.2f} s + denoising {split['denoise_s']:.2f} s + "
            f"post-processing {split['postprocess_s']:.2f} s; steps of "
            f"{r['mean_step_s']:.3f} s, {r['cached_share']:.0%} of rows read a template cache"
        )
    if by_rows := r.get("step_s_by_rows"):
        steps = ", ".join(f"{rows}: {seconds:.3f} s" for rows, seconds in by_rows.items())
        label = f"{r['arm']} {r['trace']} {r['rps']:.4g}"
        lines.append(f"{label}: mean step by batch size (rows: s): {steps}")
    if p := r.get("phases"):
        lines.append(
            f"baseline {r['trace']} {r['rps']}: per request with adapters, load "
            f"{p['adapter_load_s']:.3f} s + fuse {p['adapter_fuse_s']:.3f} s + unfuse "
            f"{p['adapter_unfuse_s']:.3f} s around a {p['pipeline_s']:.3f} s pipeline call"
        )
    return lines


def summary_text(report: dict) -> str:
    lines = [
        f"{'trace':8s} {'rps':>6s} {'arm':11s} {'mean s':>8s} {'P95 s':>8s} {'thru/s':>7s} "
        f"{'rows':>5s} {'dev hit':>7s} {'blocked':>7s}"
    ]
    for r in report["results"]:
        result = ArmResult(**r)
        blocked = (
            f"{result.rows_blocked / result.rows_with_adapters:7.1%}"
            if result.rows_with_adapters
            else f"{'-':>7s}"
        )
        hit = f"{device_hit_ratio(result):7.1%}" if result.hits else f"{'-':>7s}"
        lines.append(
            f"{result.trace:8s} {result.rps:6.3f} {result.arm:11s} {result.avg_latency_s:8.2f} "
            f"{result.p95_latency_s:8.2f} {result.throughput_rps:7.3f} "
            f"{result.mean_batch_rows:5.2f} {hit} {blocked}"
            + (f"  ({result.failed} failed)" if result.failed else "")
        )
    for r in report["results"]:
        lines.extend(_detail_lines(r))
    head = report["headline"]
    for key, target in TARGETS.items():
        if key in head:
            verb = "<=" if key == "blocked_share" else ">="
            met = head[key] <= target if key == "blocked_share" else head[key] >= target
            lines.append(
                f"{key}: {head[key]:.3f} (target {verb} {target}: {'met' if met else 'missed'})"
            )
    for key in (
        "baseline_capacity_rps",
        "saturation_rps",
        "past_rps",
        "latency_x_past",
        "load80_rps",
        "p95_x",
        "one_set_latency_x",
        "join_if_pays_latency_x",
    ):
        if key in head:
            lines.append(f"{key}: {head[key]:.3f}")
    return "\n".join(lines)


def write_partial(config: dict, results: list[ArmResult], path: Path) -> None:
    """The runs finished so far (``<json>.partial.json``, removed when the whole bench ends), and
    the last one's line on the terminal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "results": [asdict(r) for r in results]}))
    last = results[-1]
    tqdm.write(
        f"{last.trace} {last.rps}/s {last.arm}: mean {last.avg_latency_s:.2f} s, P95 "
        f"{last.p95_latency_s:.2f} s, {last.throughput_rps:.3f} edits/s"
    )


def write_outputs(config: dict, run: dict, json_path: Path) -> dict:
    """JSON (config, catalogue, every run, headline) and the PNG beside it; returns the report."""
    results = run["results"]
    report = {
        # the Poisson rates run: --rps, or --loads x the baseline's measured capacity
        "config": {**config, "rps": run.get("rps", config.get("rps"))},
        "catalog": run["catalog"],
        "baseline_capacity_rps": run.get("baseline_capacity_rps"),
        "results": [asdict(r) for r in results],
        "headline": headline(results, run.get("baseline_capacity_rps")),
    }
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    _plot(results, json_path.with_suffix(".png"), config.get("device", "cpu"))
    return report


def _plot(results: list[ArmResult], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in sorted({r.arm for r in results}):
        runs = sorted(_by(results, arm).items())
        if runs:
            left.plot([r for r, _ in runs], [x.avg_latency_s for _, x in runs], "o-", label=arm)
    left.set(xlabel="Poisson rate, requests/s", ylabel="mean latency, s", yscale="log")
    left.set_title(f"Latency against load ({device})")
    left.legend()
    labelled = [r for r in results if r.rows_with_adapters]
    names = [f"{r.arm}\n{r.trace} {r.rps:g}" for r in labelled]
    right.bar(
        range(len(labelled)), [device_hit_ratio(r) for r in labelled], label="device hit ratio"
    )
    right.plot(
        range(len(labelled)),
        [r.rows_blocked / r.rows_with_adapters for r in labelled],
        "rx",
        label="rows blocked",
    )
    right.set_xticks(range(len(labelled)), names, fontsize=6)
    right.set(ylim=(0, 1), title="Adapter tiers")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

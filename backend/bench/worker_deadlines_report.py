"""`maskserve bench worker-deadlines`' report (pure: no torch): the figures averaged over repeats,
a Markdown table of every run, the target lines, and the JSON and plot written beside each other.

With ``repeats`` > 1 every (process, load, scheduler) ran that many times, the arms' order rotated
each repeat (``worker_deadlines.rotated``); each arm is compared with fifo's run of its own repeat
(``route_deadlines.comparison``), and ``mean_comparison`` averages those paired differences: the
machine's speed drifts over minutes, and a pair run back to back shares most of it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from backend.bench.forecast_accuracy import HORIZONS
from backend.bench.route_deadlines import CLASSES, save_beside

# the paired figures of ``route_deadlines.comparison`` that ``mean_comparison`` averages
PAIRED = (
    "interactive_points",
    "batch_points",
    "interactive_p95_ratio",
    "batch_p95_ratio",
    "batch_throughput_ratio",
)


def mean_comparison(comparison: list[dict]) -> list[dict]:
    """Per (process, load, scheduler): each paired figure averaged over the repeats, with the
    repeats' count and the lowest and highest interactive points."""
    groups: dict[tuple, list[dict]] = {}
    for c in comparison:
        groups.setdefault((c["trace"], c["load"], c["scheduler"]), []).append(c)
    out = []
    for (kind, load, arm), rows in groups.items():
        points = [r["interactive_points"] for r in rows]
        out.append(
            {"trace": kind, "load": load, "scheduler": arm, "repeats": len(rows)}
            | {key: statistics.fmean(r[key] for r in rows) for key in PAIRED}
            | {"interactive_points_lowest": min(points), "interactive_points_highest": max(points)}
        )
    return out


def speed_adjusted(report: dict) -> list[dict]:
    """Per scheduler other than fifo, over every (process, load, repeat) pair with fifo's run:
    the least-squares line of the pair's interactive points on log(its slowdown / fifo's)
    (``speed_gauge``): ``intercept`` estimates the points at equal machine speed, with its
    standard error; ``slope`` the points per unit of log speed ratio; ``correlation``. Pooled over
    the cells, so the intercept is a mean over them. Pairs fewer than 3, or all at one speed
    ratio: no line (the scheduler is left out)."""
    runs = {(r["trace"], r["load"], r["repeat"], r["scheduler"]): r for r in report["results"]}
    out = []
    for arm in dict.fromkeys(r["scheduler"] for r in report["results"]):
        if arm == "fifo":
            continue
        xs, ys = [], []
        for (kind, load, repeat, name), run in runs.items():
            fifo = runs.get((kind, load, repeat, "fifo"))
            if name != arm or fifo is None:
                continue
            xs.append(float(np.log(run["slowdown"] / fifo["slowdown"])))
            points = run["classes"]["interactive"]["attainment"]
            ys.append(100.0 * (points - fifo["classes"]["interactive"]["attainment"]))
        x, y = np.array(xs), np.array(ys)
        if len(x) < 3 or np.ptp(x) == 0:
            continue
        design = np.vstack([np.ones_like(x), x]).T
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        resid = y - design @ coef
        cov = (resid @ resid) / (len(y) - 2) * np.linalg.inv(design.T @ design)
        out.append(
            {
                "scheduler": arm,
                "pairs": len(y),
                "intercept": float(coef[0]),
                "intercept_se": float(np.sqrt(cov[0, 0])),
                "slope": float(coef[1]),
                "correlation": float(np.corrcoef(x, y)[0, 1]) if np.ptp(y) > 0 else 0.0,
                "mean_points": float(y.mean()),
            }
        )
    return out


def speed_lines(report: dict) -> list[str]:
    """``speed_adjusted`` as one line per scheduler."""
    return [
        f"{a['scheduler']} vs fifo at equal machine speed: {a['intercept']:+.1f} +- "
        f"{a['intercept_se']:.1f} interactive points (over {a['pairs']} pairs; mean as run "
        f"{a['mean_points']:+.1f}; {a['slope']:+.0f} points per unit log speed ratio, "
        f"correlation {a['correlation']:+.2f})"
        for a in report.get("speed_adjusted", [])
    ]


def table(report: dict) -> str:
    """One Markdown row per run (process, load, repeat, scheduler, in the order run); "pts" =
    attainment minus fifo's in the same repeat, in points."""
    cmp = {(c["trace"], c["load"], c["scheduler"], c["repeat"]): c for c in report["comparison"]}
    head = [
        "trace",
        "load",
        "repeat",
        "scheduler",
        "interactive SLO",
        "vs fifo (pts)",
        "batch SLO",
        "vs fifo (pts)",
        "interactive P95 s",
        "batch P95 s",
        "throughput req/s",
        "batch throughput vs fifo",
        "parks/job",
        "resumes/job",
        "longest batch wait s",
        "starved",
        "machine slowdown (attempts)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in report["results"]:
        c, vs = r["classes"], cmp.get((r["trace"], r["load"], r["scheduler"], r["repeat"]))
        cells = [
            r["trace"],
            f"{r['load']:g}",
            str(r["repeat"]),
            r["scheduler"],
            f"{c['interactive']['attainment']:.1%}",
            f"{vs['interactive_points']:+.1f}" if vs else "",
            f"{c['batch']['attainment']:.1%}",
            f"{vs['batch_points']:+.1f}" if vs else "",
            f"{c['interactive']['p95_latency_s']:.2f}",
            f"{c['batch']['p95_latency_s']:.2f}",
            f"{r['throughput_rps']:.2f}",
            f"x{vs['batch_throughput_ratio']:.3f}" if vs else "",
            f"{r['parks_per_job']:.3f}",
            f"{r['resumes_per_job']:.3f}",
            f"{r['max_batch_wait_s']:.2f}",
            str(r["starved_jobs"]),
            _slowdowns(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _slowdowns(run: dict) -> str:
    """The kept run's slowdown against the calibration, then every attempt's in order; "out"
    when no attempt came into the band."""
    kept = f"x{run['slowdown']:.2f}" + ("" if run["in_band"] else " out")
    attempts = run["attempt_slowdowns"]
    return kept if len(attempts) == 1 else f"{kept} ({', '.join(f'x{a:.2f}' for a in attempts)})"


def mean_table(report: dict) -> str:
    """One Markdown row per (process, load, scheduler other than fifo): the paired figures
    averaged over the repeats (``mean_comparison``)."""
    head = ["trace", "load", "scheduler", "repeats", "interactive pts vs fifo (mean)"]
    head += ["lowest", "highest", "batch pts", "batch throughput vs fifo"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in report["comparison_mean"]:
        cells = [c["trace"], f"{c['load']:g}", c["scheduler"], str(c["repeats"])]
        cells += [f"{c[k]:+.1f}" for k in ("interactive_points", "interactive_points_lowest")]
        cells += [f"{c[k]:+.1f}" for k in ("interactive_points_highest", "batch_points")]
        cells.append(f"x{c['batch_throughput_ratio']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def forecast_table(report: dict) -> str:
    """One Markdown row per (run, class): how far the finish each job was told was from its real
    finish (``forecast_accuracy``), for the first forecast it heard and the one on its first
    step: median absolute error (s and share of the time it had left), bias and share late."""
    head = ["trace", "load", "repeat", "scheduler", "class", "jobs"]
    for horizon in HORIZONS:
        head += [f"{horizon}: median error s (of time left)", "bias s", "late"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in report["results"]:
        for cls, by_horizon in r.get("forecast", {}).items():
            cells = [r["trace"], f"{r['load']:g}", str(r["repeat"]), r["scheduler"], cls]
            cells.append(str(max(f["jobs"] for f in by_horizon.values())))
            for horizon in HORIZONS:
                f = by_horizon.get(horizon)
                cells += (
                    [
                        f"{f['median_abs_s']:.2f} ({f['median_rel']:.0%})",
                        f"{f['bias_s']:+.2f}",
                        f"{f['late_share']:.0%}",
                    ]
                    if f
                    else ["", "", ""]
                )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_lines(report: dict) -> list[str]:
    """The issue's targets (``route_deadlines.targets``: slack vs fifo at loads 0.8-1.0) on the
    figures averaged over the repeats, then on the worst single repeat."""
    out = []
    for which, label in (("targets", "mean of repeats"), ("targets_worst_repeat", "worst repeat")):
        out += [f"{kind} ({label}): {line}" for kind, line in _target_texts(report[which])]
    return out


def _target_texts(targets: dict) -> list[tuple[str, str]]:
    out = []
    for kind, t in targets.items():
        met = {k: "met" if t[k] else "NOT met" for k in t if isinstance(t[k], bool)}
        out.append(
            (
                kind,
                f"interactive attainment {t['interactive_points_min']:+.1f} points at worst "
                f"(>= 30: {met['interactive_30_points']}); batch throughput "
                f"x{t['batch_throughput_ratio_min']:.3f} at worst (>= 0.95: "
                f"{met['batch_throughput_within_5pct']}); longest wait {t['max_wait_s']:.2f} s, "
                f"{t['starved_jobs']} starved ({met['no_job_starved']})",
            )
        )
    return out


def write_outputs(report: dict, json_path: Path) -> Path:
    """The report as JSON and a plot beside it (.png): per process, each class's SLO attainment
    and the interactive P95 against its target, per load and scheduler: the mean over repeats,
    whiskers from the lowest to the highest repeat."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    kinds = list(dict.fromkeys(r["trace"] for r in results))
    arms = list(dict.fromkeys(r["scheduler"] for r in results))
    loads = sorted({r["load"] for r in results})
    panels = [(f"{cls} SLO attainment (%)", cls) for cls in CLASSES]
    panels.append(("interactive P95 latency (s)", "p95"))
    fig, axes = plt.subplots(len(kinds), 3, figsize=(12, 3.4 * len(kinds)), squeeze=False)
    width = 0.8 / len(arms)
    by: dict[tuple, list[dict]] = {}
    for r in results:
        by.setdefault((r["trace"], r["load"], r["scheduler"]), []).append(r)
    for row, kind in enumerate(kinds):
        for col, (label, what) in enumerate(panels):
            ax = axes[row][col]
            for i, arm in enumerate(arms):
                values = [[_figure(r, what) for r in by[(kind, load, arm)]] for load in loads]
                mean = np.array([np.mean(v) for v in values])
                # clipped at 0: a mean of equal values may differ from them in the last bit
                low = np.maximum(0.0, mean - [min(v) for v in values])
                spread = [low, np.maximum(0.0, [max(v) for v in values] - mean)]
                x = np.arange(len(loads)) + (i - (len(arms) - 1) / 2) * width
                ax.bar(x, mean, width, label=arm, yerr=spread, capsize=2)
            if what == "p95":
                ax.axhline(report["targets_s"]["interactive"], color="k", ls="--", label="target")
            else:
                ax.set_ylim(0, 105)
            ax.set_xticks(np.arange(len(loads)), [f"load {x:g}" for x in loads])
            ax.set_title(f"{kind}: {label}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    c, t = report["config"], report["targets_s"]
    fig.suptitle(
        f"{c['model_id']} {c['size']} px, one worker x batch {c['max_batch']}, capacity "
        f"{report['capacity_rps']:.1f} req/s; targets interactive {t['interactive']:.2f} s, "
        f"batch {t['batch']:.0f} s\n{report['device']}",
        fontsize=9,
    )
    return save_beside(fig, json_path)


def _figure(run: dict, what: str) -> float:
    """A run's plotted figure: the interactive P95 (s), or a class's attainment (%)."""
    classes = run["classes"]
    if what == "p95":
        return float(classes["interactive"]["p95_latency_s"])
    return 100.0 * classes[what]["attainment"]

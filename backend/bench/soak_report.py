"""The outputs of `maskserve bench soak`: its JSON report, a PNG with one panel per metric over time
(one line per role or part, the machine named in the title), and the summary it prints."""

from __future__ import annotations

import json
from pathlib import Path

from backend.bench.soak import series_of
from backend.bench.soak_verdict import GROWS, MIB

# panel title, unit divisor, and the metric names' (prefix, suffix) it draws
PANELS = (
    ("resident memory per role (MiB)", MIB, "role/", "/rss_bytes"),
    ("open files per role", 1.0, "role/", "/open_files"),
    ("Redis memory (MiB)", MIB, "redis/", "_memory_bytes"),
    ("Redis keys", 1.0, "redis/", "/redis_keys"),
    ("data directory (MiB)", MIB, "disk/", "/disk_bytes"),
    ("P95 latency of the jobs finished in the period (s)", 1.0, "latency/", "/latency_s"),
)


def write_outputs(report: dict, json_path: Path | None, png_path: Path | None) -> list[Path]:
    """Write what was asked for; returns the paths written."""
    written = []
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1))
        written.append(json_path)
    if png_path is not None:
        plot(report, png_path)
        written.append(png_path)
    return written


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = series_of(report["samples"])
    growing = {v["metric"] for v in report["verdicts"] if v["verdict"] == GROWS}
    fig, axes = plt.subplots(3, 2, figsize=(13, 11))
    for ax, (title, unit, prefix, suffix) in zip(axes.flat, PANELS):
        for name in sorted(n for n in series if n.startswith(prefix) and n.endswith(suffix)):
            points = [(t / 60.0, v / unit) for t, v in series[name] if v is not None]
            label = name.split("/")[1] + (" (GROWS)" if name in growing else "")
            ax.plot([t for t, _ in points], [v for _, v in points], marker=".", label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("minutes into the soak")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    cfg = report["config"]
    fig.suptitle(
        f"maskserve soak on {report['machine']}: {cfg['model_id']}, {cfg['steps']} steps, "
        f"{cfg['size']} px, {report['offered_rps']:.2f} jobs/s ({cfg['load']:g} x capacity "
        f"{report['capacity_rps']:.2f}) for {cfg['minutes']:g} min: "
        + ("PASSED" if report["passed"] else "FAILED"),
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(report: dict) -> str:
    """What the command prints: capacity, jobs, latency, each verdict, and the failures."""
    jobs, soak_jobs = report["jobs"], report["soak_jobs"]
    lines = [
        f"machine   {report['machine']}",
        f"capacity  {report['capacity_rps']:.3f} jobs/s; offered {report['offered_rps']:.3f} "
        f"jobs/s for {report['config']['minutes']:g} min",
        "jobs      " + ", ".join(f"{k} {v}" for k, v in jobs.items()),
        f"soak      {soak_jobs['done']}/{soak_jobs['submitted']} done, latency P50 "
        f"{soak_jobs['p50_latency_s']:.2f} s, P95 {soak_jobs['p95_latency_s']:.2f} s, P99 "
        f"{soak_jobs['p99_latency_s']:.2f} s",
    ]
    for v in report["verdicts"]:
        lines.append(
            f"  {v['verdict']:8s} {v['metric']:45s} first {v['first_value']:.4g} last "
            f"{v['last_value']:.4g} fitted +{v['fitted_increase']:.4g} (tolerance "
            f"{v['tolerance']:.4g})"
        )
    lines += [f"FAIL: {line}" for line in report["failures"]]
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)

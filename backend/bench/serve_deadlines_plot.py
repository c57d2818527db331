"""The plot of ``bench serve-deadlines`` (each interactive job's latency per arm against its
deadline) and how its figures are shown."""

from __future__ import annotations

from pathlib import Path


def shown(value, spec: str = ".2f") -> str:
    """``value`` in ``spec``, or "-" for None."""
    return "-" if value is None else format(value, spec)


def plot(report: dict, path: Path) -> None:
    """Each interactive job's latency per scheduler against its deadline, by arrival."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    fig, axis = plt.subplots(figsize=(9, 5))
    jobs = [r for r in report["schedule"]["requests"] if r["service_class"] == "interactive"]
    x = list(range(len(jobs)))
    width = 0.8 / max(1, len(report["arms"]))
    for k, (name, arm) in enumerate(report["arms"].items()):
        rows = {r["index"]: r for r in arm["jobs"]}
        heights = [rows[j["index"]]["latency_s"] or 0.0 for j in jobs]
        met = shown(arm["summary"].get("interactive", {}).get("attainment"), ".0%")
        offset = (k - (len(report["arms"]) - 1) / 2) * width
        axis.bar([i + offset for i in x], heights, width, label=f"{name}: {met} met")
    axis.hlines([j["deadline_s"] for j in jobs], [i - 0.45 for i in x], [i + 0.45 for i in x],
                colors="black", linestyles="--", label="deadline")  # fmt: skip
    axis.set_xticks(x, [f"#{j['index']}\n{j['arrival_s']:.1f} s" for j in jobs])
    axis.set(xlabel="interactive job (arrival after the burst)", ylabel="latency (s, total_s)")
    axis.legend(fontsize=8)
    title = (
        f"bench serve-deadlines: {cfg['batch_jobs']} batch jobs at once, "
        f"{cfg['interactive_jobs']} interactive inside; {cfg['model_id']} {cfg['size']} px, "
        f"{cfg['steps']} steps - {report['machine']}"
    )
    axis.set_title(title, fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)

"""Figures of `maskserve bench serve` from its per-request records (pure: no I/O, no torch).

A record is one request of one trace replayed to one arm (``ServeRecord``). From them:

* ``summarize``: per (arm, trace) latency (average, P50, P95, P99, of the server's submit-to-done
  time), throughput (jobs done / the span from the first arrival to the last finish), and the
  mean breakdown of a done job's time into its stages (queue, pre, wait, denoise, post, and
  ``other``: what the stages' sum leaves of the total: hand-offs between roles);
* ``sustained``: per arm, the highest Poisson rate whose P95 stays under the arm's SLO with every
  request done;
* ``headline``: the ratios the README quotes, MaskServe's arms against the baseline at the
  baseline's saturation rate (the highest rate it sustains), measured in the same run.

Invariant: figures come only from records; a trace an arm skipped (saturated at a lower rate)
has no summary, and ratios needing it are ``None`` rather than guessed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from backend.worker.stats import percentile

STAGES = ("queue_s", "pre_s", "wait_s", "denoise_s", "post_s")
ARMS = ("baseline", "nocache", "full")
ARM_TITLES = {
    "baseline": "ordinary pipeline (static batches of <= 8)",
    "nocache": "MaskServe, cache off (continuous batching, dense compute)",
    "full": "MaskServe (cache + masked tokens)",
    "full-cold": "MaskServe, caches not prepared",
}


@dataclass
class ServeRecord:
    """One request as one arm served it. ``latency_s``: the server's submit-to-done time (the job's
    ``total_s``), ``None`` unless done; ``client_latency_s``: submit to seen done by the client."""

    arm: str
    trace: str  # e.g. "poisson@2" (kind@mean rate), "bursty@1", "single"
    index: int  # the request's index in its trace (the same request in every arm)
    arrival_s: float  # in the trace
    template: int
    mask_ratio: float
    mask_kind: str
    seed: int
    job_id: str = ""
    status: str = "unsent"  # done / failed / cancelled / refused / unfinished
    message: str = ""
    submitted_s: float = 0.0  # seconds after the trace started, when submitted
    finished_s: float = 0.0  # seconds after the trace started, when seen terminal
    latency_s: float | None = None
    client_latency_s: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    worker_id: str = ""


def trace_name(kind: str, rps: float) -> str:
    return f"{kind}@{rps:g}"


def trace_rate(name: str) -> float:
    return float(name.split("@", 1)[1])


def summarize(records: Iterable[ServeRecord]) -> dict[str, dict[str, dict]]:
    """``{arm: {trace: figures}}`` for every (arm, trace) with records."""
    groups: dict[tuple[str, str], list[ServeRecord]] = {}
    for record in records:
        groups.setdefault((record.arm, record.trace), []).append(record)
    out: dict[str, dict[str, dict]] = {}
    for (arm, trace), group in sorted(groups.items()):
        out.setdefault(arm, {})[trace] = summarize_group(group)
    return out


def summarize_group(group: list[ServeRecord]) -> dict:
    done = [r for r in group if r.status == "done" and r.latency_s is not None]
    latencies = [r.latency_s for r in done]
    counts = {s: sum(r.status == s for r in group) for s in {r.status for r in group}}
    figures: dict = {"requests": len(group), "done": len(done), "statuses": counts}
    if not done:
        return figures
    start = min(r.submitted_s for r in group)
    span = max(r.finished_s for r in done) - start
    figures |= {
        "mean_s": sum(latencies) / len(latencies),
        **{f"p{q}_s": percentile(latencies, q) for q in (50, 95, 99)},
        "max_s": max(latencies),
        "throughput_rps": len(done) / span if span > 0 else 0.0,
        "breakdown_s": breakdown(done),
    }
    return figures


def breakdown(done: list[ServeRecord]) -> dict[str, float]:
    """Mean seconds per stage over done jobs, plus ``other`` (total minus the stages' sum)."""
    means = {
        stage.removesuffix("_s"): sum(r.timings.get(stage, 0.0) for r in done) / len(done)
        for stage in STAGES
    }
    total = sum(r.latency_s or 0.0 for r in done) / len(done)
    means["other"] = max(0.0, total - sum(means.values()))
    return means


def meets_slo(figures: dict, slo_s: float) -> bool:
    """Every request done and P95 within the bound."""
    return (
        figures.get("done", 0) == figures.get("requests", -1)
        and figures.get("p95_s", float("inf")) <= slo_s
    )


def sustained(by_trace: dict[str, dict], slo_s: float, kind: str = "poisson") -> float | None:
    """The highest rate of ``kind`` traces whose figures meet the SLO (None: none does)."""
    rates = [
        trace_rate(name)
        for name, figures in by_trace.items()
        if name.startswith(f"{kind}@") and meets_slo(figures, slo_s)
    ]
    return max(rates) if rates else None


def slo_bound(single_s: float | None, factor: float, absolute_s: float) -> float | None:
    """The arm's P95 bound: ``absolute_s`` when given, else ``factor`` x its single-request
    latency (None when that was not measured)."""
    if absolute_s > 0:
        return absolute_s
    return None if single_s is None else factor * single_s


def headline(summary: dict[str, dict[str, dict]], slos: dict[str, float | None]) -> dict:
    """The ratios of MaskServe's arms to the baseline, side by side from one run.

    ``latency_gain``: the baseline's mean latency over the arm's at the baseline's saturation rate
    (the highest rate it sustains); ``latency_gain_past``: the same at the lowest rate the baseline
    did not sustain (where its queue starts to grow, FlashPS Fig. 12's knee);
    ``throughput_gain``: the arm's sustained rate over the baseline's; ``peak_gain``: the arm's
    highest measured throughput over the baseline's."""
    rates = {
        arm: sustained(by_trace, slos[arm]) if slos.get(arm) else None
        for arm, by_trace in summary.items()
    }
    peaks = {
        arm: max((f.get("throughput_rps", 0.0) for f in by_trace.values()), default=0.0)
        for arm, by_trace in summary.items()
    }
    base_rate, base = rates.get("baseline"), summary.get("baseline", {})
    at = trace_name("poisson", base_rate) if base_rate is not None else None
    past = _first_unsustained(base, slos.get("baseline"))
    out: dict = {
        "sustained_rps": rates,
        "peak_throughput_rps": peaks,
        "saturation_trace": at,
        "past_saturation_trace": past,
    }
    for arm in summary:
        if arm != "baseline":
            out[arm] = {
                "latency_gain": _mean_ratio(base, summary[arm], at),
                "latency_gain_past": _mean_ratio(base, summary[arm], past),
                "throughput_gain": _ratio(rates.get(arm), base_rate),
                "peak_gain": _ratio(peaks.get(arm), peaks.get("baseline")),
            }
    return out


def _first_unsustained(by_trace: dict[str, dict], slo_s: float | None) -> str | None:
    """The lowest Poisson trace whose figures break the SLO (None: none ran, or no SLO)."""
    broken = [
        name
        for name, figures in by_trace.items()
        if name.startswith("poisson@") and slo_s and not meets_slo(figures, slo_s)
    ]
    return min(broken, key=trace_rate, default=None)


def _mean_ratio(base: dict[str, dict], mine: dict[str, dict], trace: str | None) -> float | None:
    """The baseline's mean latency over the arm's on ``trace`` (None: either did not finish it)."""
    if trace is None or "mean_s" not in base.get(trace, {}) or "mean_s" not in mine.get(trace, {}):
        return None
    return base[trace]["mean_s"] / mine[trace]["mean_s"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None

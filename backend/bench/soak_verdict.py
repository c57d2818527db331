"""Does a soak metric grow without bound? A pure verdict over its periodic samples (no I/O).

A series is ``(seconds since start, value)`` pairs; ``None`` values (e.g. no job finished in that
period, so no latency) are dropped. The first ``warmup`` fraction of the run is ignored (caches
fill, the model loads, Python's allocator finds its size). Over the rest, with ``tol =
max(absolute, relative * |mean of the first window|)``, the metric **grows** when all three hold:

1. the least-squares line over the rest rises by more than ``tol`` across it;
2. the line over the *second half* of the rest, at its own slope, would rise by more than ``tol``
   across the whole rest: the growth goes on to the end (a cache that filled, then stayed: a step
   then flat, is bounded);
3. the last window's mean is above the first window's *maximum* by more than ``tol`` (a sawtooth:
   a bounded cache or GC cycle, tilts a fitted line but its late mean stays below its early peaks).

Windows are ``window`` of the kept samples, at least one. Invariant: a constant series, and any
series whose values stay within ``tol`` of each other after the warm-up, is bounded (condition 3
cannot hold). For a straight line rising by ``d`` over many samples, conditions 1 and 2 read ``d >
tol`` and condition 3 about ``(1 - 1.5 * window) * d > tol``, the strictest: with the default 20 %
window a leak is reported once it reaches about 1.4 ``tol``. Fewer than ``MIN_SAMPLES`` kept
samples give the verdict ``short``: too few to tell, which is not a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

MIN_SAMPLES = 4
BOUNDED, GROWS, SHORT = "bounded", "grows", "short"
MIB = float(1 << 20)


@dataclass(frozen=True)
class Tolerance:
    """The growth a metric may show over the run: ``absolute`` in its own unit, ``relative`` as a
    fraction of its early level; growth must exceed both to count."""

    absolute: float
    relative: float


# Per kind of metric; the metric names of a soak map onto these kinds through ``kind_of``.
TOLERANCES: dict[str, Tolerance] = {
    "rss_bytes": Tolerance(64 * MIB, 0.10),
    "open_files": Tolerance(16, 0.20),
    "redis_memory_bytes": Tolerance(16 * MIB, 0.20),
    "redis_keys": Tolerance(200, 0.20),
    "disk_bytes": Tolerance(64 * MIB, 0.20),
    "latency_s": Tolerance(0.5, 0.50),
    "bytes_per_job": Tolerance(4096, 0.25),
    "processes": Tolerance(2, 0.5),
}


def kind_of(metric: str) -> str:
    """The tolerance kind of a metric name of the form ``<group>/<name>/<kind>``."""
    kind = metric.rsplit("/", 1)[-1]
    if kind not in TOLERANCES:
        raise ValueError(f"metric {metric!r} has no known kind (one of {sorted(TOLERANCES)})")
    return kind


@dataclass(frozen=True)
class Verdict:
    metric: str
    verdict: str  # BOUNDED, GROWS or SHORT
    samples: int  # kept after the warm-up
    tolerance: float
    fitted_increase: float  # condition 1
    late_increase: float  # condition 2
    last_over_first_max: float  # condition 3
    first_value: float
    last_value: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def message(self) -> str:
        return (
            f"{self.metric} grows: +{_fmt(self.fitted_increase, self.metric)} over the run "
            f"(line fit), last window {_fmt(self.last_over_first_max, self.metric)} above the "
            f"first window's peak, tolerance {_fmt(self.tolerance, self.metric)}"
        )


def _fmt(value: float, metric: str) -> str:
    if metric.endswith("bytes"):
        return f"{value / MIB:.1f} MiB"
    return f"{value:.3g}{' s' if metric.endswith('_s') else ''}"


def fit_slope(times: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` over ``times``; 0 when the times do not vary."""
    n = len(times)
    if n < 2:
        return 0.0
    mean_t, mean_v = sum(times) / n, sum(values) / n
    spread = sum((t - mean_t) ** 2 for t in times)
    if spread == 0.0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values)) / spread


def judge(
    metric: str,
    series: Sequence[tuple[float, float | None]],
    tolerance: Tolerance | None = None,
    warmup: float = 0.2,
    window: float = 0.2,
) -> Verdict:
    """The verdict on one metric's series (see the module docstring)."""
    if not (0.0 <= warmup < 1.0 and 0.0 < window <= 0.5):
        raise ValueError(f"warmup must be in [0, 1) and window in (0, 0.5], got {warmup}, {window}")
    tolerance = tolerance or TOLERANCES[kind_of(metric)]
    points = sorted((t, float(v)) for t, v in series if v is not None)
    if points:
        start = points[0][0] + warmup * (points[-1][0] - points[0][0])
        points = [p for p in points if p[0] >= start]
    times, values = [t for t, _ in points], [v for _, v in points]
    if len(points) < MIN_SAMPLES:
        return Verdict(metric, SHORT, len(points), 0.0, 0.0, 0.0, 0.0, *_ends(values))
    size = max(1, round(window * len(values)))
    first, last = values[:size], values[-size:]
    tol = max(tolerance.absolute, tolerance.relative * abs(sum(first) / len(first)))
    span = times[-1] - times[0]
    half = len(points) // 2
    fitted = fit_slope(times, values) * span
    late = fit_slope(times[half:], values[half:]) * span
    above = sum(last) / len(last) - max(first)
    grows = fitted > tol and late > tol and above > tol
    return Verdict(
        metric, GROWS if grows else BOUNDED, len(points), tol, fitted, late, above, *_ends(values)
    )


def _ends(values: Sequence[float]) -> tuple[float, float]:
    return (values[0], values[-1]) if values else (0.0, 0.0)


def judge_all(
    series: dict[str, Sequence[tuple[float, float | None]]], warmup: float = 0.2
) -> list[Verdict]:
    """One verdict per metric, in name order."""
    return [judge(name, series[name], warmup=warmup) for name in sorted(series)]


def failures(verdicts: Sequence[Verdict], jobs: dict[str, int]) -> list[str]:
    """What makes the soak fail, one clear line each: every growing metric, and jobs that were
    lost (never reached a terminal state), failed, cancelled or refused at submission."""
    lines = [v.message() for v in verdicts if v.verdict == GROWS]
    for outcome in ("lost", "failed", "cancelled", "refused"):
        if jobs.get(outcome, 0):
            lines.append(f"{jobs[outcome]} of {jobs.get('submitted', 0)} jobs {outcome}")
    return lines

"""A measured machine's step shape: how a real worker's denoising step grows with its rows, relative
to the fitted profile the route simulation prices steps on (pure: no torch, no clock).

The profile is fitted on one machine, with its own thread count; a worker that runs elsewhere (one
torch thread beside other work, say) can pay much more for each row added to a step than the
profile says, and a deadline scheduler's room to meet a tight target depends on exactly that. A
simulation meant to stand for such a worker takes its shape: factor ``shape[n - 1]`` multiplies the
profile's latency of a step of ``n`` rows (the last factor beyond the list).

``measured_shape`` reads the shape off a ``bench worker-deadlines`` report: every run records its
step clock's final state (``clock_scale_end``, ``clock_shape_end``: what the worker learned from
its own steps, ``backend.worker.step_clock``), whose prediction of a step of ``n`` rows is the
profile's latency times the scale times the clock's shape of ``n``. So per run, the growth from one
row to ``n`` rows predicted that way, divided by the profile's own growth, is the clock's shape of
``n`` over its shape of one row: the profile and the scale cancel. The shape is the median over the
runs. One row keeps its time (factor 1): only the growth with rows changes, so targets set as
multiples of the single job mean the same in the simulation.

Invariants: every factor is finite and > 0; the first is 1 for a measured shape; an empty shape is
the profile itself (``shape_factor`` 1 for every row count).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def shape_factor(shape: Sequence[float], rows: int) -> float:
    """The factor of a step of ``rows`` rows: 1 without a shape, the last factor beyond it."""
    if not shape or rows < 1:
        return 1.0
    return float(shape[min(rows, len(shape)) - 1])


def checked(shape: Iterable[float]) -> tuple[float, ...]:
    """``shape`` as a tuple, or ValueError saying which factor is not a positive number."""
    factors = tuple(float(f) for f in shape)
    for i, factor in enumerate(factors, start=1):
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"step shape factor of {i} rows must be positive, not {factor}")
    return factors


def measured_shape(report: dict[str, Any]) -> tuple[float, ...]:
    """The median shape of ``report``'s runs (module docstring), one factor per row count up to the
    largest count any run's clock knows."""
    runs = [r for r in report.get("results", []) if r.get("clock_shape_end")]
    if not runs:
        raise ValueError(
            "the report has no run with a step clock's shape (clock_shape_end): "
            "give a `bench worker-deadlines` JSON"
        )
    most = max(int(n) for run in runs for n in run["clock_shape_end"])
    per_count: dict[int, list[float]] = {}
    for run in runs:
        learned = {int(n): float(f) for n, f in run["clock_shape_end"].items()}
        if 1 not in learned:
            continue  # no one-row reference: its growth cannot be read
        for n, factor in learned.items():
            per_count.setdefault(n, []).append(factor / learned[1])
    if 1 not in per_count:
        raise ValueError("no run's step clock knows a step of one row: the shape has no reference")
    shape = [1.0]
    for n in range(2, most + 1):
        # a count no run learned takes the factor of the count below it
        shape.append(statistics.median(per_count[n]) if n in per_count else shape[-1])
    return checked(shape)


def load_shape(spec: str) -> tuple[float, ...]:
    """``--step-shape``: a `bench worker-deadlines` JSON to read the shape from, or the factors
    themselves as a comma list (``1,1.1,1.2``); "" = none."""
    if not spec:
        return ()
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--step-shape {spec}: cannot read a JSON report: {exc}") from exc
        try:
            return measured_shape(report)
        except (AttributeError, KeyError, TypeError, ZeroDivisionError) as exc:
            raise ValueError(
                f"--step-shape {spec}: not a `bench worker-deadlines` report ({exc!r})"
            ) from exc
    try:
        return checked(float(f) for f in spec.split(","))
    except ValueError as exc:
        raise ValueError(
            f"--step-shape {spec!r}: give a worker-deadlines JSON or factors like 1,1.1,1.2 ({exc})"
        ) from exc

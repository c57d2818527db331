"""How fast the machine ran one bench run, against its calibration (pure: no torch, no clock).

The worker deadline bench compares step schedulers on a real worker whose step times follow the
machine's speed, and a small shared VM's speed moves: a fixed matmul on this project's 2-vCPU
machine took 43 to 116 ms from one second to the next, and the worker's step clock ended runs
at 1.4 to 3 times the step time its calibration had measured minutes before. A run made while
the machine ran much slower than at calibration meets fixed targets by the machine's luck, not
its scheduler's.

The gauge: every step's measured seconds over the cost model's figure for its batch (the step
clock's ``modelled``: row count, mask ratios and cache reads priced, the machine not) is a ratio;
the reference is the median ratio over the calibration's steps (``reference``), which serve
batches of every row count. One reference for every row count, not one per count: the model
already prices how a step grows with its rows (the step clock's per-count shape on this machine
stayed within 1.12-1.19 of its scale over every count), and a per-count median over a few
seconds each takes in the machine's noise of those seconds (medians of 2.1 to 3.9 measured over
neighbouring counts within one minute). A run's slowdown is the median of its steps' ratios over
the reference (``run_slowdown``): 1.0 = as fast as at calibration, 2.0 = half as fast.

A run is in the band when ``1/band <= slowdown <= band`` (``in_band``); ``in_band_run`` runs it
again while it is outside, up to a number of retries, and keeps the attempt ``kept_attempt``
names.
Invariants: the reference and slowdowns are > 0 and finite; no samples, no reference; a run
without steps has slowdown 1.0 (nothing was measured against the calibration).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def _usable(ratios: Mapping[int, Sequence[float]]) -> list[float]:
    return [v for values in ratios.values() for v in values if v > 0 and math.isfinite(v)]


def reference(ratios: Mapping[int, Sequence[float]]) -> float:
    """The median measured/modelled ratio over the calibration's steps (row count -> ratios),
    positive finite samples only."""
    usable = _usable(ratios)
    if not usable:
        raise ValueError("no reference: the calibration measured no step")
    return statistics.median(usable)


def run_slowdown(ref: float, ratios: Mapping[int, Sequence[float]]) -> float:
    """The median of a run's steps' ratios (row count -> ratios) over the reference."""
    usable = _usable(ratios)
    return statistics.median(usable) / ref if usable else 1.0


def in_band(slowdown: float, band: float) -> bool:
    """Whether a run's ``slowdown`` is within ``band`` of the calibration's speed either way
    (``band`` <= 1: no band, every run is in it)."""
    return band <= 1.0 or 1.0 / band <= slowdown <= band


def kept_attempt(slowdowns: Sequence[float], band: float) -> int:
    """Of a run's attempts (their slowdowns, in the order run), the index kept: the first in the
    band, else the one nearest the calibration's speed (smallest |log slowdown|)."""
    if not slowdowns:
        raise ValueError("no attempt to keep")
    for i, slowdown in enumerate(slowdowns):
        if in_band(slowdown, band):
            return i
    return min(range(len(slowdowns)), key=lambda i: abs(math.log(slowdowns[i])))


def in_band_run(
    run: Callable[[], dict[str, Any]], band: float, retries: int, again: Callable[[float], None]
) -> dict[str, Any]:
    """``run()`` (a dict with its ``slowdown``), run again while outside the band, at most
    ``retries`` more times (``again(slowdown)`` is told before each); the attempt
    ``kept_attempt`` names, with every attempt's slowdown in order (``attempt_slowdowns``) and
    whether the kept one is in the band (``in_band``)."""
    attempts = [run()]
    while not in_band(attempts[-1]["slowdown"], band) and len(attempts) <= retries:
        again(attempts[-1]["slowdown"])
        attempts.append(run())
    slowdowns = [a["slowdown"] for a in attempts]
    kept = attempts[kept_attempt(slowdowns, band)]
    return kept | {"attempt_slowdowns": slowdowns, "in_band": in_band(kept["slowdown"], band)}

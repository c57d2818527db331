"""How far the worker's forecast of a job's finish was from its real finish (pure: no torch, no
clock).

A worker tells each job its predicted end of denoising (``JobEvent.predicted_finish``: on a
waiting row's ``waiting`` events and on every step event of a running row). Two of those are
judged against the moment the job's final latents were handed on:

* ``first``: the first forecast the job heard, usually on arrival, the one a user submitting an
  edit sees first;
* ``start``: the first forecast told once the job holds a slot (on its step events; a forecast is
  at most ``forecast_refresh_s`` old, so a job admitted just after one hears it a step or more
  later).

Per class and horizon: ``bias_s``, the mean of real minus predicted finish (> 0: jobs ended later
than told); the median and P90 of the absolute error in seconds; ``median_rel``, the median of the
absolute error over the time the job really had left when it was told (0.1: off by a tenth of the
wait the user was promised); ``late_share``, the share of jobs that ended after their forecast.

Invariants: a job counts only when it heard a forecast (``predicted_finish`` > 0) and finished; a
forecast told at or after the job's finish has no time left to judge and is left out of
``median_rel`` only.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from backend.worker.stats import percentile

HORIZONS = ("first", "start")


@dataclass(frozen=True)
class Told:
    """A forecast a job heard: when, and the finish it predicted (epoch seconds)."""

    at: float
    finish: float


def told_forecasts(events: Iterable) -> dict[str, dict[str, Told]]:
    """Job id -> horizon -> the forecast of that horizon (module docstring), from a worker's
    events in the order they were emitted."""
    out: dict[str, dict[str, Told]] = {}
    for event in events:
        if event.predicted_finish <= 0:
            continue
        heard = out.setdefault(event.job_id, {})
        told = Told(event.at, event.predicted_finish)
        heard.setdefault("first", told)
        if event.status == "running" and event.step >= 1:
            heard.setdefault("start", told)
    return out


def forecast_errors(
    told: Mapping[str, Mapping[str, Told]],
    done_at: Mapping[str, float],
    service_class: Mapping[str, str],
) -> dict[str, dict[str, dict[str, float]]]:
    """Class -> horizon -> the error figures (module docstring) over the jobs that heard a
    forecast of that horizon and finished; a class without such jobs is absent."""
    errors: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for job_id, heard in told.items():
        if job_id not in done_at:
            continue
        cls = errors.setdefault(service_class[job_id], {})
        for horizon, forecast in heard.items():
            left = done_at[job_id] - forecast.at
            cls.setdefault(horizon, []).append((done_at[job_id] - forecast.finish, left))
    return {
        name: {horizon: _figures(pairs) for horizon, pairs in sorted(by_horizon.items())}
        for name, by_horizon in sorted(errors.items())
    }


def _figures(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """``pairs``: (real - predicted finish, time left when told), one per job."""
    signed = [error for error, _ in pairs]
    absolute = [abs(error) for error in signed]
    relative = [abs(error) / left for error, left in pairs if left > 0]
    return {
        "jobs": len(pairs),
        "bias_s": statistics.fmean(signed),
        "median_abs_s": statistics.median(absolute),
        "p90_abs_s": percentile(absolute, 90),
        "median_rel": statistics.median(relative) if relative else 0.0,
        "late_share": sum(error > 0 for error in signed) / len(signed),
    }

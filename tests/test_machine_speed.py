"""The machine-speed probe's analysis (``backend.bench.machine_speed.drift_of``): it reads back the
drift of a simulated machine whose drift is known."""

from __future__ import annotations

import numpy as np
import pytest

from backend.bench.machine_drift import DriftSpec, SpeedDrift
from backend.bench.machine_speed import drift_of


def probe_of(spec: DriftSpec, seconds: float, jitter_cv: float, seed: int = 1):
    """Samples of 20 ms of work on a machine drifting by ``spec``, each with its own jitter."""
    drift, rng = SpeedDrift(spec, seed), np.random.default_rng(seed)
    times, took, now = [], [], 0.0
    while now < seconds:
        sample = 0.02 * drift.factor(now) * rng.lognormal(0.0, jitter_cv)
        now += sample
        times.append(now)
        took.append(sample)
    return times, took


def test_the_probe_reads_back_a_known_drift_through_per_sample_jitter():
    times, took = probe_of(DriftSpec(cv=0.25, tau_s=4.0), seconds=1500.0, jitter_cv=0.3)
    report = drift_of(times, took, window_s=0.5)
    assert report["cv"] == pytest.approx(0.25, rel=0.2)
    assert report["tau_s"] == pytest.approx(4.0, rel=0.35)
    assert report["sample_cv"] > report["cv"]  # the jitter averages out within a window
    assert report["autocorrelation"]["0.5"] > report["autocorrelation"]["10"]


def test_a_steady_machine_has_no_drift_to_speak_of():
    times, took = probe_of(DriftSpec(cv=0.0), seconds=300.0, jitter_cv=0.2)
    report = drift_of(times, took, window_s=0.5)
    assert report["cv"] < 0.05 and report["tau_s"] == 0.5  # uncorrelated from one window on


def test_too_few_samples_are_refused():
    with pytest.raises(ValueError, match="two or more samples"):
        drift_of([1.0], [0.02])
    with pytest.raises(ValueError, match="one time per sample"):
        drift_of([1.0, 2.0], [0.02])

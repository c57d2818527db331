"""A simulated machine whose speed drifts (``backend.bench.machine_drift``): its stationary mean
and spread, its correlation over time, and its bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backend.bench.machine_drift import DriftSpec, SpeedDrift


def readings(spec: DriftSpec, times, seed: int = 3) -> np.ndarray:
    drift = SpeedDrift(spec, seed)
    return np.array([drift.factor(t) for t in times])


def test_the_slowdown_averages_one_with_the_spread_asked_for():
    spec = DriftSpec(cv=0.3, tau_s=2.0)
    factors = readings(spec, np.arange(20000) * 10.0)  # 5 correlation times apart: independent
    assert factors.mean() == pytest.approx(1.0, abs=0.01)
    assert factors.std() / factors.mean() == pytest.approx(0.3, rel=0.05)
    assert factors.min() > 0


def test_readings_a_correlation_time_apart_keep_exp_minus_one_of_their_log_correlation():
    spec = DriftSpec(cv=0.3, tau_s=5.0)
    logs = np.log(readings(spec, np.arange(40000) * 5.0))
    lag_one = np.corrcoef(logs[:-1], logs[1:])[0, 1]
    assert lag_one == pytest.approx(math.exp(-1.0), abs=0.02)
    close = np.log(readings(spec, np.arange(40000) * 0.05))  # a hundredth of it: nearly the same
    assert np.corrcoef(close[:-1], close[1:])[0, 1] > 0.98


def test_the_same_seed_and_times_give_the_same_machine_and_a_reading_holds_its_time():
    spec, times = DriftSpec(cv=0.2, tau_s=1.0), [0.0, 0.5, 0.5, 3.0]
    first, second = readings(spec, times), readings(spec, times)
    assert list(first) == list(second) and first[1] == first[2]
    assert list(readings(spec, times, seed=4)) != list(first)


def test_no_drift_is_one_at_every_time():
    assert set(readings(DriftSpec(cv=0.0), [0.0, 1.0, 100.0])) == {1.0}


def test_bad_specs_and_readings_back_in_time_are_refused():
    with pytest.raises(ValueError, match="cv >= 0 and tau_s > 0"):
        DriftSpec(cv=-0.1)
    with pytest.raises(ValueError, match="cv >= 0 and tau_s > 0"):
        DriftSpec(cv=0.1, tau_s=0.0)
    drift = SpeedDrift(DriftSpec(cv=0.1), 0)
    drift.factor(2.0)
    with pytest.raises(ValueError, match="after a reading at 2.0"):
        drift.factor(1.0)

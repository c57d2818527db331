"""How far a worker's told finish was from the real one (``backend.bench.forecast_accuracy``):
which forecast counts for each horizon, and the error figures per class."""

from __future__ import annotations

import pytest

from backend.bench.forecast_accuracy import Told, forecast_errors, told_forecasts
from backend.protocol import JobEvent


def _event(job_id: str, status: str, at: float, finish: float = 0.0, step: int = 0) -> JobEvent:
    return JobEvent(job_id=job_id, status=status, at=at, step=step, predicted_finish=finish)


def test_the_first_forecast_is_the_first_heard_and_start_the_first_step_s():
    events = [
        _event("a", "waiting", 0.0),  # on arrival: no forecast yet
        _event("a", "waiting", 0.5, finish=4.0),
        _event("a", "waiting", 1.0, finish=5.0),
        _event("a", "running", 2.0, step=0),  # admitted: its step events carry the forecast
        _event("a", "running", 2.2, finish=5.5, step=1),
        _event("a", "running", 2.4, finish=6.0, step=2),
        _event("b", "running", 0.1, finish=0.0, step=1),  # the forecast had not seen it yet
        _event("b", "running", 0.6, finish=1.5, step=2),
    ]
    told = told_forecasts(events)
    assert told["a"] == {"first": Told(0.5, 4.0), "start": Told(2.2, 5.5)}
    # heard its first forecast on a step after its first: both horizons are that one
    assert told["b"] == {"first": Told(0.6, 1.5), "start": Told(0.6, 1.5)}


def test_errors_per_class_and_horizon_count_only_finished_jobs_that_heard_one():
    told = {
        "i1": {"first": Told(0.0, 2.0), "start": Told(1.0, 3.0)},  # ends at 4: 2 s and 1 s late
        "i2": {"first": Told(0.0, 5.0)},  # ends at 4: 1 s early, heard no step's forecast
        "b1": {"first": Told(0.0, 10.0), "start": Told(5.0, 10.0)},  # ends at 10: exact
        "gone": {"first": Told(0.0, 1.0)},  # never finished: not counted
    }
    done = {"i1": 4.0, "i2": 4.0, "b1": 10.0, "never-told": 3.0}
    classes = {"i1": "interactive", "i2": "interactive", "b1": "batch", "never-told": "batch"}
    errors = forecast_errors(told, done, classes)

    first = errors["interactive"]["first"]
    assert first["jobs"] == 2
    assert first["bias_s"] == pytest.approx((2.0 - 1.0) / 2)
    assert first["median_abs_s"] == pytest.approx(1.5)
    assert first["p90_abs_s"] == pytest.approx(2.0)
    assert first["median_rel"] == pytest.approx((2.0 / 4.0 + 1.0 / 4.0) / 2)
    assert first["late_share"] == pytest.approx(0.5)
    start = errors["interactive"]["start"]
    assert (start["jobs"], start["bias_s"], start["median_rel"]) == (1, 1.0, pytest.approx(1 / 3))
    assert errors["batch"]["first"]["jobs"] == 1 and errors["batch"]["first"]["bias_s"] == 0.0
    assert errors["batch"]["start"]["late_share"] == 0.0


def test_a_forecast_told_at_the_finish_has_no_time_left_to_judge():
    told = {"a": {"first": Told(4.0, 3.5)}}
    figures = forecast_errors(told, {"a": 4.0}, {"a": "batch"})["batch"]["first"]
    assert figures["bias_s"] == pytest.approx(0.5) and figures["median_rel"] == 0.0


def test_no_forecast_heard_leaves_the_class_out():
    assert forecast_errors({}, {"a": 1.0}, {"a": "batch"}) == {}

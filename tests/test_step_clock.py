"""The worker's step clock: a cost model's shape, calibrated by measured steps."""

from dataclasses import dataclass

import pytest

from backend.worker.step_clock import StepClock


@dataclass
class R:
    mask_ratio: float
    template: str = ""


def linear_model(rows):
    """0.1 s + 1 s per unit of mask ratio; a cached row costs half."""
    return 0.1 + sum(m * (0.5 if cached else 1.0) for m, _, cached in rows)


def test_without_measurements_the_model_is_used_as_fitted():
    clock = StepClock(linear_model)
    assert clock([R(0.2), R(0.4, "t")]) == pytest.approx(0.1 + 0.2 + 0.2)
    assert clock([]) == 0.0


def test_measured_steps_calibrate_the_scale_but_keep_the_models_shape():
    clock = StepClock(linear_model, alpha=0.5)
    rows = [R(0.5)]  # modelled 0.6 s
    for _ in range(30):
        clock.observe(rows, 1.2)  # this machine is twice as slow as the profile
    assert clock(rows) == pytest.approx(1.2, rel=1e-3)
    # a batch the worker never ran is predicted with the model's shape at the measured scale
    assert clock([R(1.0), R(1.0)]) == pytest.approx(2 * (0.1 + 2.0), rel=1e-3)


def test_one_measurement_moves_the_scale_by_at_most_alpha():
    clock = StepClock(linear_model, alpha=0.2)
    clock.observe([R(0.5)], 60.0)  # a stall (a GC pause, a page fault storm)
    assert clock.scale == pytest.approx(1.0 + 0.2 * (100.0 - 1.0))
    clock.observe([R(0.5)], float("nan"))
    clock.observe([R(0.5)], 0.0)
    clock.observe([], 1.0)
    assert clock.scale == pytest.approx(1.0 + 0.2 * (100.0 - 1.0))


def test_without_a_model_the_clock_learns_seconds_per_row():
    clock = StepClock(None, alpha=1.0, initial_row_s=0.5)
    assert clock([R(0.1)] * 4) == pytest.approx(2.0)
    clock.observe([R(0.1)] * 2, 0.6)
    assert clock([R(0.1)] * 3) == pytest.approx(0.9)


@pytest.mark.parametrize("alpha,initial", [(0.0, 1.0), (1.5, 1.0), (0.5, 0.0)])
def test_bad_parameters_are_refused(alpha, initial):
    with pytest.raises(ValueError, match="alpha"):
        StepClock(None, alpha, initial)

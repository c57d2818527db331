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


def fixed_part_model(rows):
    """A profile fitted where a step has a large fixed part: 20 ms plus 2 ms per row."""
    return 0.020 + 0.002 * len(rows)


def test_the_clock_learns_how_a_step_grows_with_its_rows_here():
    # this machine has no fixed part: 10 ms per row. A scale alone would price one row more or
    # less at 6 ms where it costs 10; the shape per row count learns the difference
    clock = StepClock(fixed_part_model, alpha=0.2)
    for _ in range(200):
        for n in (1, 3, 5, 8):
            clock.observe([R(0.1)] * n, 0.010 * n)
    for n in (1, 3, 5, 8):
        assert clock([R(0.1)] * n) == pytest.approx(0.010 * n, rel=0.05)
    # counts never measured lie between their neighbours' (linear), the nearest's beyond them
    assert clock([R(0.1)] * 4) == pytest.approx(0.040, rel=0.1)
    assert clock.shape_of(12) == clock.shape_of(8)


def test_a_machine_that_slows_down_moves_every_row_count():
    clock = StepClock(fixed_part_model, alpha=0.2)
    for _ in range(200):
        for n in (1, 8):
            clock.observe([R(0.1)] * n, 0.010 * n)
    for _ in range(30):  # twice as slow now, measured on batches of 8 rows only
        clock.observe([R(0.1)] * 8, 0.160)
    assert clock([R(0.1)] * 8) == pytest.approx(0.160, rel=0.05)
    assert clock([R(0.1)]) > 1.7 * 0.010  # the scale carries most of the slowdown to one row


def test_shapes_of_unmeasured_counts_start_at_one():
    clock = StepClock(fixed_part_model)
    assert clock.shape_of(1) == clock.shape_of(7) == 1.0
    clock.shape = {2: 1.0, 6: 2.0}
    assert [clock.shape_of(n) for n in (1, 2, 4, 6, 9)] == [1.0, 1.0, 1.5, 2.0, 2.0]


@pytest.mark.parametrize("alpha,initial", [(0.0, 1.0), (1.5, 1.0), (0.5, 0.0)])
def test_bad_parameters_are_refused(alpha, initial):
    with pytest.raises(ValueError, match="alpha"):
        StepClock(None, alpha, initial)

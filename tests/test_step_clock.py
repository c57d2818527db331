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


def _noisy_steps(clock, rows, slow_share, slow_factor, count, base_s):
    """``count`` steps of ``rows``: every step whose index falls in the slow share of a cycle of
    ten runs ``slow_factor`` times longer (a machine whose speed moves between seconds)."""
    for i in range(count):
        clock.observe(rows, base_s * (slow_factor if i % 10 < slow_share * 10 else 1.0))


def test_on_steady_steps_the_plan_takes_the_prediction_itself():
    clock = StepClock(linear_model, plan_quantile=0.9)
    rows = [R(0.5)]
    for _ in range(400):  # the scale's first steps (1 -> 1.5) leave the 256-step window
        clock.observe(rows, 0.9)
    assert clock.margin == pytest.approx(1.0, abs=1e-6)
    assert clock.planned(rows) == pytest.approx(clock(rows))


def test_on_noisy_steps_the_plan_takes_the_quantile_the_noise_gives():
    noisy = StepClock(linear_model, plan_quantile=0.9)
    plain = StepClock(linear_model)  # plan_quantile 0: plan on the prediction
    rows = [R(0.5)]
    for clock in (noisy, plain):
        _noisy_steps(clock, rows, slow_share=0.3, slow_factor=1.5, count=200, base_s=0.6)
    # three steps in ten ran 1.5 x slower: the plan covers a slow step, the prediction does not
    slow_step_s = 0.6 * 1.5
    assert noisy.planned(rows) == pytest.approx(slow_step_s, rel=0.05)
    assert plain.planned(rows) < 0.8 * slow_step_s
    assert noisy.planned(rows) == pytest.approx(noisy(rows) * noisy.margin)
    # forecasts keep the prediction: the two clocks predict alike, only the plan differs
    assert noisy(rows) == pytest.approx(plain(rows))
    assert plain.margin == 1.0 and plain.planned(rows) == plain(rows)


def test_the_margin_waits_for_enough_steps_and_follows_only_the_recent_window():
    clock = StepClock(linear_model, plan_quantile=0.9, window=40)
    rows = [R(0.5)]
    _noisy_steps(clock, rows, slow_share=0.5, slow_factor=2.0, count=19, base_s=0.6)
    assert clock.margin == 1.0  # 19 steps: too few for a quantile
    _noisy_steps(clock, rows, slow_share=0.5, slow_factor=2.0, count=21, base_s=0.6)
    assert clock.margin > 1.2
    for _ in range(40):  # the machine settles: the window forgets the noisy seconds
        clock.observe(rows, 0.6)
    assert clock.margin < 1.05


def test_a_machine_faster_than_predicted_never_plans_on_less_than_the_prediction():
    clock = StepClock(linear_model, plan_quantile=0.5)
    rows = [R(0.5)]
    for i in range(60):
        clock.observe(rows, 0.6 * (0.5 if i % 2 else 1.0))
    assert clock.margin >= 1.0


@pytest.mark.parametrize("quantile, window", [(-0.1, 256), (1.0, 256), (0.9, 5)])
def test_a_quantile_out_of_range_or_a_tiny_window_is_refused(quantile, window):
    with pytest.raises(ValueError, match="plan_quantile"):
        StepClock(linear_model, plan_quantile=quantile, window=window)

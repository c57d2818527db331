"""The worker deadline bench's speed gauge (pure): the calibration's median measured/modelled
step time over every row count, a run's median against it, the band and the rerun of a run made
out of it."""

from __future__ import annotations

import math

import pytest

from backend.bench.speed_gauge import (
    in_band,
    in_band_run,
    kept_attempt,
    reference,
    run_slowdown,
)


def test_the_reference_is_the_median_ratio_over_every_row_count_skipping_unusable_samples():
    assert reference({1: [2.0, 3.0, 10.0], 4: [0.0, math.nan, 5.0], 8: [-1.0]}) == 4.0
    with pytest.raises(ValueError, match="no reference"):
        reference({1: [0.0], 2: []})


def test_a_runs_slowdown_is_the_median_of_its_steps_ratios_over_the_reference():
    # steps at ratios 4, 6 (1 row) and 15, 10, 40 (8 rows): median 10, over a reference of 5
    assert run_slowdown(5.0, {1: [4.0, 6.0], 8: [15.0, 10.0, 40.0]}) == pytest.approx(2.0)
    assert run_slowdown(5.0, {3: [5.0, 5.0, 2.5]}) == pytest.approx(1.0)  # as calibrated
    assert run_slowdown(5.0, {}) == 1.0  # nothing measured


@pytest.mark.parametrize(
    "slowdown, band, inside",
    [
        (1.0, 1.3, True),
        (1.29, 1.3, True),
        (1.31, 1.3, False),
        (0.78, 1.3, True),
        (0.76, 1.3, False),
        (5.0, 1.0, True),
        (0.1, 0.0, True),
    ],
)
def test_the_band_holds_either_way_and_a_band_of_one_or_less_holds_everything(
    slowdown, band, inside
):
    assert in_band(slowdown, band) is inside


def test_the_kept_attempt_is_the_first_in_the_band_else_the_nearest_to_the_calibration():
    assert kept_attempt([1.1, 1.0], 1.3) == 0
    assert kept_attempt([2.0, 1.2, 1.0], 1.3) == 1
    assert kept_attempt([2.0, 0.6, 1.6], 1.3) == 2  # |log 1.6| < |log 0.6| < |log 2|
    with pytest.raises(ValueError, match="no attempt"):
        kept_attempt([], 1.3)


def _scripted(slowdowns):
    runs = iter(slowdowns)
    made = []

    def run():
        made.append({"slowdown": next(runs), "attempt": len(made)})
        return made[-1]

    return run, made


def test_a_run_out_of_the_band_is_run_again_until_one_is_in_it():
    run, made = _scripted([2.0, 1.5, 1.1, 1.0])
    told = []
    out = in_band_run(run, 1.3, retries=5, again=told.append)
    assert len(made) == 3 and told == [2.0, 1.5]  # stops at the first in the band
    assert out["attempt"] == 2 and out["in_band"] is True
    assert out["attempt_slowdowns"] == [2.0, 1.5, 1.1]


def test_the_retries_bound_the_reruns_and_the_nearest_attempt_is_kept_marked_out():
    run, made = _scripted([2.0, 1.6, 3.0, 1.0])
    out = in_band_run(run, 1.3, retries=2, again=lambda s: None)
    assert len(made) == 3  # one run and two retries, never the fourth
    assert out["attempt"] == 1 and out["in_band"] is False
    assert out["attempt_slowdowns"] == [2.0, 1.6, 3.0]


def test_without_a_band_a_run_is_never_repeated():
    run, made = _scripted([9.0, 1.0])
    out = in_band_run(run, 0.0, retries=3, again=lambda s: None)
    assert len(made) == 1 and out["in_band"] is True and out["attempt_slowdowns"] == [9.0]

"""The studio's predicted denoising time of one edit, from the shipped cost profiles."""

from __future__ import annotations

import dataclasses

import pytest

from backend.config import Settings
from backend.costmodel.costs import STEP_REST_UNKNOWN, LinearModel
from backend.costmodel.predict import estimate_edit
from backend.costmodel.profiles import load_profile

PROFILES = Settings().paths.profiles_dir


@pytest.fixture(params=["tiny-sd2-inpaint", "small-flux-fill", "demo-sd2-inpaint"])
def profile(request):
    return load_profile(PROFILES, request.param, "cpu", "kv")


def test_a_smaller_mask_is_predicted_faster_and_never_slower_than_the_ordinary_pipeline(profile):
    ratios = (0.02, 0.1, 0.3, 0.6, 1.0)
    estimates = [estimate_edit(profile, ratio, 20, 7.5) for ratio in ratios]
    cached = [estimate.cached_s for estimate in estimates]
    assert cached == sorted(cached) and cached[0] < cached[-1]
    assert all(0 < e.cached_s <= e.ordinary_s for e in estimates)
    assert len({e.ordinary_s for e in estimates}) == 1  # the ordinary pipeline ignores the mask
    assert estimates[-1].cached_s == pytest.approx(estimates[-1].ordinary_s)
    assert estimates[0].speedup > 1.0


def test_time_grows_with_steps_and_guidance_runs_two_rows(profile):
    one = estimate_edit(profile, 0.1, 10, 7.5)
    assert estimate_edit(profile, 0.1, 20, 7.5).ordinary_s == pytest.approx(2 * one.ordinary_s)
    unguided = estimate_edit(profile, 0.1, 10, 1.0)
    assert unguided.ordinary_s < one.ordinary_s <= 2 * unguided.ordinary_s + 1e-9


def test_bad_steps_and_ratios_are_refused(profile):
    with pytest.raises(ValueError, match="steps"):
        estimate_edit(profile, 0.1, 0, 7.5)
    with pytest.raises(ValueError, match="masked ratio"):
        estimate_edit(profile, 1.5, 10, 7.5)


def test_a_steps_time_outside_the_units_is_added_to_both_estimates(profile):
    without = dataclasses.replace(profile, step_rest=STEP_REST_UNKNOWN)
    measured = dataclasses.replace(profile, step_rest=LinearModel(0.01, 0.005, 1.0))
    bare, full = estimate_edit(without, 0.1, 10, 7.5), estimate_edit(measured, 0.1, 10, 7.5)
    added = 10 * (0.01 * 2 + 0.005)  # two rows with guidance, ten steps
    assert full.cached_s == pytest.approx(bare.cached_s + added)
    assert full.ordinary_s == pytest.approx(bare.ordinary_s + added)


def test_the_shipped_profiles_know_the_rest_of_a_step(profile):
    assert profile.rest_seconds(2) > 0

"""The studio's predicted denoising time of one edit, from the shipped cost profiles."""

from __future__ import annotations

import pytest

from backend.config import Settings
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
    assert estimates[0].speedup > 1.2


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

"""``maskserve bench demo``'s cases and summary (no model: records made by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from backend.bench.demo_quality import ARMS, COMPARED, painted_cases, summarise, sweep_cases


def _verdict(agrees: bool, share: float, ssim: float = 0.9) -> dict:
    return {
        "agrees": agrees,
        "prompt_share": share,
        "outside_identical": True,
        "ssim": ssim,
        "ssim_masked": ssim - 0.1,
        "psnr": 30.0,
        "psnr_masked": 20.0,
    }


def _record(source: str, ratio: float, agrees: bool, share: float) -> dict:
    return {
        "source": source,
        "mask_ratio": ratio,
        "template_prompt_share": 0.1,
        **{arm: _verdict(agrees, share) for arm in ARMS},
    }


def test_the_summary_counts_each_arm_and_bins_painted_masks_by_the_nearest_ratio():
    records = [
        _record("painted", 0.06, True, 0.5),
        _record("painted", 0.12, False, 0.05),
        _record("sweep", 0.3, True, 0.4),
    ]
    summary = summarise(records)
    assert summary["painted"]["kv"] == {
        "cases": 2,
        "colour_agreement": 0.5,
        "closer_than_template": 0.5,
        "outside_identical": 1.0,
    }
    assert summary["sweep"]["reseeded"]["colour_agreement"] == 1.0
    assert set(summary["fidelity"]) == set(COMPARED)
    by_ratio = summary["fidelity"]["kv"]
    assert sorted(by_ratio) == ["0.05", "0.1", "0.3"]
    assert by_ratio["0.3"]["cases"] == 1
    assert by_ratio["0.3"]["ssim_masked_min"] == pytest.approx(0.8)


def test_cases_are_held_out_with_new_colours_and_sweep_masks_of_their_ratio():
    painted = painted_cases(5, 64)
    assert [case.seed for case in painted] == list(range(5))
    for case in painted:
        assert case.colour not in case.surroundings and case.colour in case.prompt
    sweep = sweep_cases(2, 64, ratios=(0.1, 0.3))
    assert len(sweep) == 4
    for case, ratio in zip(sweep, (0.1, 0.1, 0.3, 0.3)):
        assert abs(case.mask_ratio - ratio) < 0.01 and case.mask.dtype == np.bool_

"""Inpainting examples: masks of the kinds users paint, over the object the caption names."""

from __future__ import annotations

import numpy as np
import pytest

from backend.training.examples import MASK_KINDS, make_example
from backend.training.scenes import dominant_colour


def test_an_example_is_the_same_for_the_same_seed_and_split():
    first, again = make_example(11, "heldout"), make_example(11, "heldout")
    assert np.array_equal(first.mask, again.mask) and first.caption == again.caption
    assert not np.array_equal(first.mask, make_example(11, "train").mask)


@pytest.mark.parametrize("size", [64, 128])
def test_the_mask_covers_the_object_the_caption_names_and_never_everything(size):
    kinds = set()
    for seed in range(150):
        example = make_example(seed, "train", size)
        kinds.add(example.mask_kind)
        assert example.mask.shape == (size, size) and example.mask.dtype == bool
        assert (example.mask | ~example.target.mask).all(), (seed, example.mask_kind)
        assert not example.mask.all() and example.caption == example.target.caption
        assert dominant_colour(example.image, example.target.mask) == example.target.colour
    assert kinds == set(MASK_KINDS)


def test_masks_are_of_sizes_users_paint():
    ratios = [make_example(seed).mask.mean() for seed in range(200)]
    assert 0.01 < np.percentile(ratios, 10) and np.percentile(ratios, 90) < 0.7
    assert 0.05 < float(np.median(ratios)) < 0.4

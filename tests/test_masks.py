"""Pixel/token masks: the IOPaint mask contract, morphology, paste-back exactness, synthetic
masks."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from backend.imaging.masks import (
    MaskError,
    crop_to_mask,
    feather,
    grow,
    invert,
    load_mask,
    mask_ratio,
    paste_back,
    require_nonempty,
    shrink,
    synthetic_mask,
    token_mask,
)


def square(h=32, w=32, box=(8, 8, 16, 16)) -> np.ndarray:
    """Bool mask with the half-open box (y0, x0, y1, x1) set."""
    m = np.zeros((h, w), dtype=bool)
    y0, x0, y1, x1 = box
    m[y0:y1, x0:x1] = True
    return m


def test_load_mask_reads_grayscale_with_threshold():
    values = np.array([[0, 127, 128, 255]], dtype=np.uint8)
    mask = load_mask(Image.fromarray(values, mode="L"), expected_size=(4, 1))
    assert mask.dtype == bool and mask.tolist() == [[False, False, True, True]]
    assert load_mask(Image.fromarray(values), None, threshold=0).tolist() == [
        [False, True, True, True]
    ]


def test_load_mask_accepts_rgba_alpha_rgb_and_bilevel():
    painted = square(8, 8, (2, 2, 5, 5))
    rgba = np.zeros((8, 8, 4), dtype=np.uint8)
    rgba[..., 3] = painted * 255  # colour is black everywhere: only alpha carries the mask
    assert np.array_equal(load_mask(Image.fromarray(rgba, mode="RGBA"), (8, 8)), painted)
    opaque = np.dstack([painted * 255] * 3 + [np.full((8, 8), 255)]).astype(np.uint8)
    assert np.array_equal(load_mask(Image.fromarray(opaque, mode="RGBA"), (8, 8)), painted)
    rgb = Image.fromarray(np.dstack([painted * 255] * 3).astype(np.uint8), mode="RGB")
    assert np.array_equal(load_mask(rgb, (8, 8)), painted)
    bilevel = Image.fromarray(painted.astype(np.uint8) * 255).convert("1")
    assert np.array_equal(load_mask(bilevel, (8, 8)), painted)


@pytest.mark.parametrize("paint", [(255, 0, 0), (0, 0, 255), (0, 200, 0), (255, 255, 0)])
def test_any_bright_colour_paints_a_colour_mask_dark_paint_does_not(paint):
    """Pure red's luminance (76) is under the threshold; its brightest channel is not."""
    painted = square(8, 8, box=(2, 2, 6, 6))
    pixels = np.zeros((8, 8, 3), np.uint8)
    pixels[painted] = paint
    rgb = Image.fromarray(pixels, mode="RGB")
    assert np.array_equal(load_mask(rgb, (8, 8)), painted)
    assert np.array_equal(load_mask(rgb.convert("RGBA"), (8, 8)), painted)  # opaque: colours
    assert np.array_equal(load_mask(rgb.quantize(4), (8, 8)), painted)  # a palette PNG
    pixels[painted] = (90, 20, 20)  # dark red: below the threshold, so not painted
    assert not load_mask(Image.fromarray(pixels, mode="RGB"), (8, 8)).any()


def test_wrong_size_and_empty_masks_have_user_facing_messages():
    mask = Image.new("L", (300, 200), 255)
    with pytest.raises(MaskError, match="mask size 300x200 does not match image size 256x256"):
        load_mask(mask, expected_size=(256, 256))
    empty = load_mask(Image.new("L", (4, 4), 0), (4, 4))  # loading accepts an empty mask
    with pytest.raises(MaskError, match="mask is empty: paint the area to repaint") as refused:
        require_nonempty(empty)
    assert "brightest colour channel" in str(refused.value) and "127" in str(refused.value)
    require_nonempty(square())
    assert issubclass(MaskError, ValueError)


def test_grow_and_shrink_are_square_and_inverse_on_a_box():
    box = square()
    grown = grow(box, 2)
    assert np.array_equal(grown, square(box=(6, 6, 18, 18)))
    assert np.array_equal(shrink(grown, 2), box)
    assert np.array_equal(shrink(box, 1), square(box=(9, 9, 15, 15)))
    assert not shrink(box, 4).any()
    assert np.array_equal(grow(box, 0), box) and np.array_equal(invert(invert(box)), box)


def test_grow_clips_at_the_border_and_shrink_keeps_border_masks():
    corner = square(box=(0, 0, 4, 4))
    assert np.array_equal(grow(corner, 3), square(box=(0, 0, 7, 7)))
    assert np.array_equal(shrink(corner, 1), square(box=(0, 0, 3, 3)))
    assert shrink(np.ones((5, 5), bool), 10).all()


def test_feather_has_exact_plateaus_and_a_smooth_ramp():
    box = square(64, 64, (20, 20, 44, 44))
    alpha = feather(box, 4.0)
    assert alpha.dtype == np.float32 and alpha.min() == 0.0 and alpha.max() == 1.0
    assert np.all(alpha[shrink(box, 4)] == 1.0) and np.all(alpha[~grow(box, 4)] == 0.0)
    ramp = alpha[32, 14:27]
    assert np.all(np.diff(ramp) >= 0) and 0.0 < ramp[6] < 1.0
    assert np.array_equal(feather(box, 0), box.astype(np.float32))


def test_token_mask_max_pools_then_grows_by_margin():
    pixels = np.zeros((64, 64), dtype=bool)
    pixels[17, 40] = True  # one pixel lights its whole 8x8 token
    tokens = token_mask(pixels, (8, 8))
    assert tokens.shape == (8, 8) and tokens.sum() == 1 and tokens[2, 5]
    grown = token_mask(pixels, (8, 8), margin=1)
    assert grown.sum() == 9 and grown[1:4, 4:7].all()
    assert mask_ratio(grown) == pytest.approx(9 / 64)
    with pytest.raises(MaskError, match="token grid"):
        token_mask(pixels, (7, 8))


def test_paste_back_is_exact_outside_and_inside_the_mask():
    rng = np.random.default_rng(0)
    original = Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    generated = Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    alpha = feather(square(16, 16, (4, 4, 12, 12)), 2.0)
    out = np.asarray(paste_back(generated, original, alpha))
    assert np.array_equal(out[alpha == 0], np.asarray(original)[alpha == 0])
    assert np.array_equal(out[alpha == 1], np.asarray(generated)[alpha == 1])
    soft = (alpha > 0) & (alpha < 1)
    expected = np.rint(
        alpha[..., None] * np.asarray(generated, float)
        + (1 - alpha[..., None]) * np.asarray(original, float)
    )
    assert np.array_equal(out[soft], expected[soft].astype(np.uint8))
    with pytest.raises(ValueError, match="alpha"):
        paste_back(generated, original, np.full((16, 16), 1.5))


def test_crop_to_mask_pads_clips_and_rounds_to_a_multiple():
    mask = square(100, 120, (40, 50, 50, 61))  # rows 40-49, cols 50-60
    x0, y0, x1, y1 = crop_to_mask(mask, padding=5, multiple=8)
    assert (x1 - x0) % 8 == 0 and (y1 - y0) % 8 == 0
    assert x0 <= 45 and x1 >= 66 and y0 <= 35 and y1 >= 55
    assert crop_to_mask(mask, padding=0, multiple=1) == (50, 40, 61, 50)
    corner = square(100, 120, (0, 0, 3, 3))
    assert crop_to_mask(corner, padding=4, multiple=16) == (0, 0, 16, 16)
    odd = np.ones((10, 10), dtype=bool)
    # no multiple of 8 fits 10 > 8
    assert crop_to_mask(odd, padding=0, multiple=8) == (0, 0, 10, 10)
    with pytest.raises(MaskError, match="empty"):
        crop_to_mask(np.zeros((4, 4), bool), 0, 1)


@pytest.mark.parametrize("kind", ["blob", "rect"])
@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.5, 0.8])
def test_synthetic_masks_hit_the_ratio_and_are_not_prefixes(kind, ratio):
    mask = synthetic_mask(64, 96, ratio, seed=3, kind=kind)
    assert mask.shape == (64, 96) and mask.dtype == bool
    assert abs(mask_ratio(mask) - ratio) <= 0.02
    flat = mask.reshape(-1)
    assert not np.array_equal(flat, np.arange(flat.size) < flat.sum())  # not the raster prefix
    assert np.array_equal(mask, synthetic_mask(64, 96, ratio, seed=3, kind=kind))


def test_synthetic_mask_extremes_and_seeds():
    assert (
        synthetic_mask(16, 16, 1.0, seed=0).all() and not synthetic_mask(16, 16, 0.0, seed=0).any()
    )
    assert not np.array_equal(
        synthetic_mask(64, 64, 0.3, seed=1), synthetic_mask(64, 64, 0.3, seed=2)
    )
    with pytest.raises(ValueError, match="kind"):
        synthetic_mask(8, 8, 0.5, seed=0, kind="star")

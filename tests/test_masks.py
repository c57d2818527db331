"""Pixel/token masks: the IOPaint mask contract, morphology (OpenCV: round grow/shrink, a Gaussian
feather, holes and specks), paste-back exactness, synthetic masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from backend.imaging import masks
from backend.imaging.masks import (
    MASK_KINDS,
    MaskError,
    apply_ops,
    crop_to_mask,
    disc,
    effective_alpha,
    feather,
    feather_support,
    fill_holes,
    grow,
    invert,
    load_mask,
    mask_ratio,
    paste_back,
    remove_specks,
    require_nonempty,
    shrink,
    synthetic_mask,
    token_mask,
)
from backend.protocol import MaskOps


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


def distances_to(mask: np.ndarray) -> np.ndarray:
    """Euclidean distance of every pixel to the nearest True pixel of ``mask`` (brute force)."""
    yy, xx = np.mgrid[0 : mask.shape[0], 0 : mask.shape[1]]
    best = np.full(mask.shape, np.inf)
    for y, x in np.argwhere(mask):
        best = np.minimum(best, np.hypot(yy - y, xx - x))
    return best


@pytest.mark.parametrize("radius", [1, 2, 3, 5, 8, 13])
def test_a_pixel_grown_by_r_is_a_disc_of_radius_r(radius):
    """Round, not boxy: a corner pixel of the (2r + 1) square, farther than r, stays unset."""
    dot = np.zeros((41, 41), dtype=bool)
    dot[20, 20] = True
    grown = grow(dot, radius)
    assert np.array_equal(grown, distances_to(dot) <= radius)
    assert grown[20 - radius, 20] and grown[20, 20 + radius]  # the disc's rim is in
    assert not grown[20 - radius, 20 - radius] and not grown[20 + radius, 20 + radius]
    assert grown.sum() == disc(radius).sum() < (2 * radius + 1) ** 2
    assert np.array_equal(shrink(grown, radius), dot)  # closing a disc gives the pixel back


def test_grow_and_shrink_are_round_and_inverse_on_a_box():
    box = square()
    grown = grow(box, 2)
    assert np.array_equal(grown, distances_to(box) <= 2)
    assert grown[6, 10] and grown[10, 6] and not grown[6, 6] and not grown[17, 17]  # round corners
    assert np.array_equal(shrink(grown, 2), box)
    assert np.array_equal(shrink(box, 1), square(box=(9, 9, 15, 15)))
    assert not shrink(box, 4).any()
    assert np.array_equal(grow(box, 0), box) and np.array_equal(invert(invert(box)), box)


def test_grow_clips_at_the_border_and_shrink_keeps_border_masks():
    corner = square(box=(0, 0, 4, 4))
    assert np.array_equal(grow(corner, 3), distances_to(corner) <= 3)
    assert grow(corner, 3)[0:7, 0].all() and not grow(corner, 3)[6, 6]
    assert np.array_equal(shrink(corner, 1), square(box=(0, 0, 3, 3)))
    assert shrink(np.ones((5, 5), bool), 10).all()


@pytest.mark.parametrize("radius", [2, 9, 30, 57])
def test_kernel_and_distance_transform_give_the_same_disc(monkeypatch, radius):
    """Small radii dilate with the disc kernel, large ones use the distance transform: both are
    the exact Euclidean disc, for grow and for shrink (outside counts as masked)."""
    rng = np.random.default_rng(radius)
    sparse = rng.random((90, 110)) < 0.002
    dense = ~(rng.random((90, 110)) < 0.002)
    expected_grow = distances_to(sparse) <= radius
    expected_shrink = dense & ~(distances_to(~dense) <= radius)
    for kernel_max in (0, 10_000):  # every radius by distance, then every radius by kernel
        monkeypatch.setattr(masks, "KERNEL_MAX_RADIUS", kernel_max)
        assert np.array_equal(grow(sparse, radius), expected_grow)
        assert np.array_equal(shrink(dense, radius), expected_shrink)


def gaussian_blur_reference(mask: np.ndarray, px: float) -> np.ndarray:
    """The separable Gaussian of sigma px / 3 truncated at ceil(px), edges repeated, in float64."""
    radius = math.ceil(px)
    x = np.arange(-radius, radius + 1)
    kernel = np.exp(-0.5 * (x / (px / 3.0)) ** 2)
    kernel /= kernel.sum()
    padded = np.pad(mask.astype(np.float64), radius, mode="edge")
    rows = sum(w * padded[i : i + mask.shape[0], :] for i, w in enumerate(kernel))
    return sum(w * rows[:, i : i + mask.shape[1]] for i, w in enumerate(kernel))


def test_feather_is_a_gaussian_with_exact_plateaus_and_a_smooth_ramp():
    box = square(64, 64, (20, 20, 44, 44))
    alpha = feather(box, 4.0)
    assert alpha.dtype == np.float32 and alpha.min() == 0.0 and alpha.max() == 1.0
    np.testing.assert_allclose(alpha, gaussian_blur_reference(box, 4.0), atol=1e-5)
    assert np.all(alpha[shrink(box, 4)] == 1.0) and np.all(alpha[~feather_support(box, 4)] == 0.0)
    assert np.array_equal(feather_support(box, 4.0), square(64, 64, (16, 16, 48, 48)))
    ramp = alpha[32, 14:27]
    assert np.all(np.diff(ramp) >= 0) and 0.0 < ramp[6] < 1.0
    # the Gaussian's profile across the edge: 0.5 on it, symmetric about it
    assert alpha[32, 20] + alpha[32, 19] == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(feather(box, 0), box.astype(np.float32))
    dot = square(31, 31, (15, 15, 16, 16))
    blurred = feather(dot, 6.0)  # a Gaussian bump: round level sets, peak in the centre
    assert blurred[15, 15] == blurred.max() and blurred[15, 19] == pytest.approx(blurred[19, 15])
    assert blurred[15, 19] > blurred[18, 18]  # same Chebyshev distance, farther: lower


def test_fill_holes_turns_a_closed_outline_into_its_area():
    """The lasso: a closed stroke, even one drawn with diagonal steps, becomes the area inside
    it; an open stroke stays a stroke."""
    outline = np.zeros((40, 40), dtype=bool)
    outline[5:30, 5] = outline[5:30, 30] = outline[5, 5:31] = outline[29, 5:31] = True
    assert np.array_equal(fill_holes(outline), square(40, 40, (5, 5, 30, 31)))
    diamond = np.zeros((21, 21), dtype=bool)
    for i in range(10):  # a diamond of 8-connected diagonal steps
        for y, x in ((i, 10 + i), (10 + i, 20 - i), (20 - i, 10 - i), (10 - i, i)):
            diamond[y, x] = True
    filled = fill_holes(diamond)
    assert filled[10, 10] and filled.sum() == sum(2 * min(r, 20 - r) + 1 for r in range(21))
    open_stroke = outline.copy()
    open_stroke[29, 10:20] = False  # a gap in the bottom edge: nothing is enclosed
    assert np.array_equal(fill_holes(open_stroke), open_stroke)
    assert not fill_holes(np.zeros((4, 4), bool)).any() and fill_holes(np.ones((3, 3), bool)).all()


def test_remove_specks_drops_areas_below_the_size_only():
    mask = square(40, 40, (5, 5, 15, 15))  # 100 px
    mask[30, 30] = mask[30, 31] = True  # a 2-px speck
    mask[35:38, 2:5] = True  # 9 px
    mask[20, 20] = mask[21, 21] = True  # diagonal neighbours: one 2-px area (8-connected)
    assert np.array_equal(remove_specks(mask, 0), mask) and np.array_equal(
        remove_specks(mask, 1), mask
    )
    assert np.array_equal(remove_specks(mask, 3), mask & ~square(40, 40, (20, 20, 32, 32)))
    assert np.array_equal(remove_specks(mask, 10), square(40, 40, (5, 5, 15, 15)))
    assert np.array_equal(remove_specks(mask, 100), square(40, 40, (5, 5, 15, 15)))
    assert not remove_specks(mask, 101).any()
    with pytest.raises(ValueError, match="min_area_px"):
        remove_specks(mask, -1)


def test_apply_ops_runs_the_steps_in_the_documented_order():
    outline = np.zeros((40, 40), dtype=bool)
    outline[5:30, 5] = outline[5:30, 30] = outline[5, 5:31] = outline[29, 5:31] = True
    outline[36, 36] = True  # a speck
    area = square(40, 40, (5, 5, 30, 31))
    # fill holes before speck removal: the filled lasso (650 px) survives a 300-px speck size
    assert np.array_equal(apply_ops(outline, MaskOps(fill_holes=True, min_area_px=300)), area)
    # specks before invert: the inverted mask keeps the speck's pixel
    inverted = apply_ops(outline, MaskOps(fill_holes=True, min_area_px=2, invert=True))
    assert np.array_equal(inverted, ~area)
    # invert before grow: growing the inverted mask eats into the lasso's area
    grown = apply_ops(outline, MaskOps(fill_holes=True, min_area_px=2, invert=True, grow_px=2))
    assert np.array_equal(grown, grow(~area, 2))
    assert np.array_equal(apply_ops(area, MaskOps(grow_px=-3)), shrink(area, 3))
    assert np.array_equal(apply_ops(outline, MaskOps()), outline)  # the defaults change nothing
    alpha = effective_alpha(outline, MaskOps(fill_holes=True, min_area_px=2, feather_px=3))
    assert np.array_equal(alpha, feather(area, 3))
    with pytest.raises(MaskError, match="smaller than the speck size .min_area_px 1000"):
        apply_ops(outline, MaskOps(fill_holes=True, min_area_px=1000), strict=True)
    with pytest.raises(MaskError, match="reduce the shrink"):
        apply_ops(outline, MaskOps(grow_px=-3), strict=True)
    assert not apply_ops(outline, MaskOps(grow_px=-3)).any()  # not strict: returned as is


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


@pytest.mark.parametrize("kind", MASK_KINDS)
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


def test_stroke_masks_are_thin_paths_not_blobs():
    """A stroke of a tenth of the image spans much of it (a path), where a disc of that area would
    span a third of the side."""
    mask = synthetic_mask(128, 128, 0.1, seed=5, kind="stroke")
    rows, cols = np.nonzero(mask)
    span = max(rows.max() - rows.min(), cols.max() - cols.min()) + 1
    assert span > 64


@pytest.mark.parametrize("source_hw, box, size_hw", [
    ((25, 25), (0, 3, 25, 22), (12, 16)),  # downscale 19 -> 12 rows, 25 -> 16 columns
    ((30, 20), (2, 0, 18, 30), (45, 24)),  # upscale
    ((17, 17), (0, 0, 17, 17), (17, 17)),  # same size: unchanged
])  # fmt: skip
def test_resize_any_marks_every_cell_a_painted_pixel_overlaps(source_hw, box, size_hw):
    left, top, right, bottom = box
    th, tw = size_hw
    for y in range(top, bottom):
        for x in (left, (left + right) // 2, right - 1):
            dot = np.zeros(source_hw, dtype=bool)
            dot[y, x] = True
            resized = masks.resize_any(dot, box, size_hw)
            # the cells whose extent [j * len / size, (j + 1) * len / size) meets [p, p + 1)
            rows = [j for j in range(th) if j * (bottom - top) < (y - top + 1) * th
                    and (y - top) * th < (j + 1) * (bottom - top)]  # fmt: skip
            cols = [j for j in range(tw) if j * (right - left) < (x - left + 1) * tw
                    and (x - left) * tw < (j + 1) * (right - left)]  # fmt: skip
            expected = np.zeros(size_hw, dtype=bool)
            expected[np.ix_(rows, cols)] = True
            assert np.array_equal(resized, expected), (y, x)
    if top > 0 or left > 0:  # a pixel in the cropped-off margin marks nothing
        margin = np.zeros(source_hw, dtype=bool)
        margin[0, 0] = True
        assert not masks.resize_any(margin, box, size_hw).any()


def test_a_row_on_a_cell_border_survives_where_pils_box_filter_drops_it():
    row = np.zeros((25, 25), dtype=bool)
    row[12, :] = True  # crop row 9 of 19: its centre lies exactly on a border of 12 cells
    as_image = Image.fromarray(row.astype(np.uint8) * 255)
    pil = np.asarray(as_image.resize((16, 12), Image.Resampling.BOX, box=(0, 3, 25, 22)))
    assert not pil.any()  # PIL loses the stroke
    resized = masks.resize_any(row, (0, 3, 25, 22), (12, 16))
    assert resized[5].all() and resized[6].all() and resized.sum() == 2 * 16

"""The studio's mask extraction from ``gr.ImageEditor`` values: the alpha of the layers, never a
diff of the composite; canvases of another size scaled back or refused."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from backend.imaging.masks import MaskError
from backend.protocol import MaskOps
from studio import masks

W, H = 96, 64


def template() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8), mode="RGB")


def layer(size=(W, H), box=(20, 10, 40, 30), rgb=(255, 48, 48), alpha=255) -> Image.Image:
    image = Image.new("RGBA", size, (0, 0, 0, 0))
    x0, y0, x1, y1 = box
    image.paste(Image.new("RGBA", (x1 - x0, y1 - y0), (*rgb, alpha)), (x0, y0))
    return image


def editor_value(*layers, background=None) -> dict:
    background = background or template().convert("RGBA")
    return {"background": background, "layers": list(layers), "composite": background}


def test_the_mask_is_the_alpha_of_the_layers():
    mask = masks.painted_mask(editor_value(layer(box=(20, 10, 40, 30))), (W, H))
    expected = np.zeros((H, W), dtype=bool)
    expected[10:30, 20:40] = True
    assert np.array_equal(mask, expected)


def test_a_brush_colour_equal_to_the_image_pixels_still_counts():
    image = template()
    x0, y0, x1, y1 = 30, 20, 50, 40
    stroke = Image.new("RGBA", (W, H), (0, 0, 0, 0))
    # paints the very pixels underneath
    stroke.paste(image.crop((x0, y0, x1, y1)).convert("RGBA"), (x0, y0))
    value = {
        "background": image.convert("RGBA"),
        "layers": [stroke],
        "composite": image.convert("RGBA"),
    }
    mask = masks.painted_mask(value, (W, H))
    assert mask[y0:y1, x0:x1].all() and mask.sum() == (x1 - x0) * (y1 - y0)


def test_several_layers_are_united_and_erased_pixels_drop_out():
    first, second = layer(box=(0, 0, 10, 10)), layer(box=(50, 40, 60, 50))
    erased = np.asarray(second).copy()
    erased[40:45, 50:60, 3] = 0  # the eraser sets alpha to 0
    mask = masks.painted_mask(editor_value(first, Image.fromarray(erased, "RGBA")), (W, H))
    assert mask[0:10, 0:10].all() and mask[45:50, 50:60].all()
    assert not mask[40:45, 50:60].any() and mask.sum() == 100 + 50


def test_a_resized_canvas_is_scaled_back_to_the_template_and_thin_strokes_survive():
    small = Image.new("RGBA", (W // 2, H // 2), (0, 0, 0, 0))
    small.putpixel((10, 5), (255, 0, 0, 255))  # one canvas pixel = a 2x2 block of the template
    mask = masks.painted_mask(editor_value(small), (W, H))
    assert mask.shape == (H, W) and mask[10:12, 20:22].all() and mask.sum() == 4
    large = Image.new("RGBA", (W * 2, H * 2), (0, 0, 0, 0))
    # a single pixel of a 2x canvas still marks its template pixel
    large.putpixel((41, 21), (255, 0, 0, 255))
    assert masks.painted_mask(editor_value(large), (W, H))[10, 20]


def test_a_canvas_of_another_shape_is_refused_with_a_message():
    with pytest.raises(MaskError, match="another shape"):
        masks.painted_mask(editor_value(layer(size=(W, W))), (W, H))


def test_no_canvas_and_nothing_painted_are_clear_errors():
    with pytest.raises(MaskError, match="pick a template"):
        masks.painted_mask(None, (W, H))
    empty = masks.painted_mask(editor_value(Image.new("RGBA", (W, H))), (W, H))
    with pytest.raises(MaskError, match="nothing is painted"):
        masks.require_painted(empty)


def test_layers_arrive_as_arrays_or_files_too(tmp_path):
    painted = layer()
    path = tmp_path / "layer.png"
    painted.save(path)
    from_array = masks.painted_mask(editor_value(np.asarray(painted)), (W, H))
    from_file = masks.painted_mask(editor_value(str(path)), (W, H))
    assert np.array_equal(from_array, from_file) and from_array.sum() == 400


def test_the_mask_png_follows_the_contract():
    mask = np.zeros((H, W), dtype=bool)
    mask[5:9, 7:11] = True
    image = Image.open(io.BytesIO(masks.mask_png(mask)))
    assert image.mode == "L" and image.size == (W, H)
    assert set(np.unique(np.asarray(image))) == {0, 255} and np.array_equal(
        np.asarray(image) == 255, mask
    )


def test_the_preview_applies_the_mask_ops_like_pre_processing():
    mask = np.zeros((H, W), dtype=bool)
    mask[20:30, 20:30] = True
    grown = masks.effective_mask(mask, MaskOps(grow_px=2))
    # grown by a disc: round corners, each missing the 3 pixels farther than 2 px from the square
    assert grown.sum() == 14 * 14 - 4 * 3 and grown[19, 19] and not grown[18, 18]
    inverted = masks.effective_mask(mask, MaskOps(invert=True))
    assert masks.mask_ratio(inverted) == pytest.approx(1 - 100 / (W * H))
    feathered = masks.effective_mask(mask, MaskOps(feather_px=3))
    assert feathered[25, 25] == 1.0 and 0 < feathered[20, 19] < 1 and feathered[0, 0] == 0


def test_the_overlay_dims_the_kept_area_and_tints_and_outlines_the_repainted_one():
    image, mask = template(), np.zeros((H, W), dtype=np.float32)
    mask[0:8, 0:8] = 1.0
    shown = np.asarray(masks.overlay(image, mask)).astype(int)
    original = np.asarray(image).astype(int)
    kept = shown[8:, 8:]
    # the kept area: grey (no colour to compete with the tint) and darker than the original
    assert (kept.max(axis=2) - kept.min(axis=2) <= 1).all()
    assert (kept[..., 0] <= original[8:, 8:].mean(axis=2) * masks.OUTSIDE_BRIGHTNESS + 1).all()
    # the repainted area: the original's colours under a tint, a white outline at its edge
    inside = shown[1:7, 1:7]
    tinted = (
        original[1:7, 1:7] * (1 - masks.OVERLAY_OPACITY)
        + np.asarray(masks.OVERLAY_RGB) * masks.OVERLAY_OPACITY
    )
    assert np.abs(inside - tinted).max() <= 1
    assert (shown[7, 0:8] == masks.OUTLINE_RGB).all() and (shown[0:8, 7] == masks.OUTLINE_RGB).all()

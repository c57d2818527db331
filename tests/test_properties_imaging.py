"""Properties of upload decoding and mask parsing: any bytes and any image either decode to what the
contract says or raise the project's own error (UploadError, MaskError) saying what to fix; never
another exception.

Generated inputs: arbitrary bytes; real PNG/JPEG/WebP/BMP/GIF/TIFF files of every mode PIL can
save them in, whole, truncated or with a byte flipped; images of every PIL mode built from random
bytes (NaNs included for float modes); mask operations over their whole type range.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from PIL import Image

from backend.imaging import masks, uploads
from backend.imaging.masks import MaskError
from backend.imaging.uploads import UploadError
from backend.protocol import MaskOps
from templates_store.store import upload_error_code
from tests.property_settings import examples

# every mode Image.frombytes builds; load_mask must read each or refuse it with MaskError
ALL_MODES = (
    "1", "L", "P", "RGB", "RGBA", "LA", "PA", "La", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB",
    "HSV", "I", "I;16", "I;16B", "I;16L", "F",
)  # fmt: skip
# (format, modes it can save): the allowed formats and two refused ones
SAVABLE = (
    ("PNG", ("1", "L", "LA", "P", "RGB", "RGBA", "I;16")),
    ("JPEG", ("L", "RGB", "CMYK")),
    ("WEBP", ("RGB", "RGBA")),
    ("BMP", ("1", "L", "P", "RGB")),
    ("GIF", ("L", "P")),
    ("TIFF", ("L", "RGB")),
)
sides = st.integers(1, 24)


@st.composite
def any_image(draw, modes=ALL_MODES) -> Image.Image:
    """An image of any mode and small size whose raw pixel bytes are random."""
    mode = draw(st.sampled_from(modes))
    size = (draw(sides), draw(sides))
    length = len(Image.new(mode, size).tobytes())
    image = Image.frombytes(mode, size, draw(st.binary(min_size=length, max_size=length)))
    if mode in ("P", "PA"):  # without a palette PIL itself writes a corrupt BMP
        image.putpalette(draw(st.binary(min_size=768, max_size=768)))
    return image


@st.composite
def encoded_image(draw) -> tuple[str, Image.Image, bytes]:
    """(format, the image, its file bytes) for a random allowed-or-refused format and mode."""
    fmt, modes = draw(st.sampled_from(SAVABLE))
    image = draw(any_image(modes))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return fmt, image, buffer.getvalue()


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """``data`` cut short at a random byte, or with one random byte replaced."""
    position = draw(st.integers(0, len(data) - 1))
    if draw(st.booleans()):
        return data[:position]
    return data[:position] + bytes([draw(st.integers(0, 255))]) + data[position + 1 :]


mask_ops = st.builds(
    MaskOps,
    threshold=st.integers(-300, 300),
    invert=st.booleans(),
    grow_px=st.integers(-2000, 2000),
    feather_px=st.floats(allow_nan=True, allow_infinity=True),
    fill_holes=st.booleans(),
    min_area_px=st.one_of(st.integers(-5, 40), st.integers(-(2**40), 2**40)),
)


def assert_decoded(image: Image.Image, what: str) -> None:
    assert image.width >= 1 and image.height >= 1
    if what != "mask":
        assert image.mode == "RGB"
    np.asarray(image)  # fully loaded: reading the pixels touches no file


# ----- upload decoding ---------------------------------------------------------------------------
@examples(300)
@given(data=st.binary(max_size=512), what=st.sampled_from(["image", "mask", "template"]))
def test_any_bytes_decode_or_raise_upload_error(data, what):
    try:
        image = uploads.decode_image(data, max_pixels=10_000, what=what)
    except UploadError as exc:
        assert what in str(exc)
        assert upload_error_code(exc) in ("invalid", "unsupported_format", "too_large")
    else:
        assert_decoded(image, what)


@examples(150)
@given(case=encoded_image(), what=st.sampled_from(["image", "mask"]))
def test_whole_files_decode_to_their_size_or_are_refused_by_format(case, what):
    fmt, original, data = case
    if fmt not in uploads.ALLOWED_FORMATS:
        with pytest.raises(UploadError, match=f"{fmt} file, which is not supported") as refused:
            uploads.decode_image(data, max_pixels=10_000, what=what)
        assert upload_error_code(refused.value) == "unsupported_format"
        return
    image = uploads.decode_image(data, max_pixels=10_000, what=what)
    assert image.size == original.size
    assert_decoded(image, what)


@examples(200)
@given(case=encoded_image(), data=st.data(), what=st.sampled_from(["image", "mask"]))
def test_damaged_files_decode_or_raise_upload_error(case, data, what):
    _fmt, _original, whole = case
    broken = data.draw(damaged(whole))
    try:
        image = uploads.decode_image(broken, max_pixels=10_000, what=what)
    except UploadError:
        return
    assert_decoded(image, what)


@examples(100)
@given(case=encoded_image(), max_pixels=st.integers(1, 600))
def test_the_pixel_limit_refuses_exactly_the_larger_uploads(case, max_pixels):
    fmt, original, data = case
    assume(fmt in uploads.ALLOWED_FORMATS)
    width, height = original.size
    if width * height <= max_pixels:
        assert uploads.decode_image(data, max_pixels=max_pixels).size == original.size
        return
    with pytest.raises(UploadError, match="the limit is") as refused:
        uploads.decode_image(data, max_pixels=max_pixels)
    assert upload_error_code(refused.value) == "too_large"


# ----- masks -------------------------------------------------------------------------------------
@examples(300)
@given(image=any_image(), threshold=st.integers(0, 254))
def test_any_mask_image_parses_to_a_bool_mask_of_its_size_or_raises_mask_error(image, threshold):
    try:
        mask = masks.load_mask(image, expected_size=image.size, threshold=threshold)
    except MaskError as exc:
        assert "mode" in str(exc)
        return
    assert mask.dtype == bool and mask.shape == (image.height, image.width)


@examples(100)
@given(image=any_image(), other=st.tuples(sides, sides))
def test_a_mask_of_another_size_is_refused(image, other):
    assume(other != image.size)
    with pytest.raises(MaskError, match="does not match image size"):
        masks.load_mask(image, expected_size=other)


@examples(300)
@given(image=any_image(), ops=mask_ops)
def test_any_mask_and_any_ops_give_a_painted_mask_or_mask_error(image, ops):
    try:
        painted = uploads.process_mask(image, image.size, ops)
    except MaskError:
        return
    assert 0 <= ops.threshold <= 254 and abs(ops.grow_px) <= 512
    assert math.isfinite(ops.feather_px) and 0 <= ops.feather_px <= 256
    assert 0 <= ops.min_area_px <= uploads.MAX_MIN_AREA_PX
    assert painted.dtype == bool and painted.shape == (image.height, image.width)
    assert painted.any()


@examples(150)
@given(
    painted=st.tuples(sides, sides).flatmap(
        lambda hw: st.lists(st.booleans(), min_size=hw[0] * hw[1], max_size=hw[0] * hw[1]).map(
            lambda bits: np.array(bits, dtype=bool).reshape(hw)
        )
    ),
    bucket=st.tuples(st.integers(1, 40), st.integers(1, 40)),
)
def test_mask_to_bucket_keeps_strokes_or_says_they_were_cropped_off(painted, bucket):
    try:
        resized = uploads.mask_to_bucket(painted, bucket)
    except MaskError as exc:
        assert "outside the part of the image" in str(exc)
        return
    assert resized.shape == bucket and resized.dtype == bool and resized.any()


@examples(150)
@given(image=any_image(), px=st.integers(0, 6))
def test_grow_contains_and_shrink_is_contained_in_the_mask(image, px):
    try:
        mask = masks.load_mask(image)
    except MaskError:
        return
    assert np.all(masks.grow(mask, px) >= mask) and np.all(masks.shrink(mask, px) <= mask)


def bool_grid(height: int, width: int):
    return st.lists(st.booleans(), min_size=height * width, max_size=height * width).map(
        lambda bits: np.array(bits, dtype=bool).reshape(height, width)
    )


small_ops = st.builds(
    MaskOps,
    invert=st.booleans(),
    grow_px=st.integers(-3, 6),
    feather_px=st.one_of(st.floats(0.01, 12.0), st.just(0.0)),
    fill_holes=st.booleans(),
    min_area_px=st.integers(0, 6),
)


@st.composite
def strokes(draw, height: int, width: int, longest: int) -> np.ndarray:
    """A painting of a few strokes: boxes and box outlines (which fill_holes fills), each side at
    most ``longest`` pixels."""
    painted = np.zeros((height, width), dtype=bool)
    for _ in range(draw(st.integers(1, 4))):
        y0, x0 = draw(st.integers(0, height - 1)), draw(st.integers(0, width - 1))
        y1 = draw(st.integers(y0 + 1, min(height, y0 + longest)))
        x1 = draw(st.integers(x0 + 1, min(width, x0 + longest)))
        painted[y0:y1, x0:x1] = True
        if draw(st.booleans()):  # an outline only
            painted[y0 + 1 : y1 - 1, x0 + 1 : x1 - 1] = False
    return painted


@st.composite
def painting(draw) -> tuple[int, np.ndarray]:
    """(token side in pixels, strokes on a grid of 1..5 x 1..5 tokens of 1..8 pixels)."""
    token_px = draw(st.sampled_from([1, 2, 4, 8]))
    height, width = draw(st.integers(1, 5)) * token_px, draw(st.integers(1, 5)) * token_px
    return token_px, draw(strokes(height, width, longest=12))


def token_area(tokens: np.ndarray, token_px: int) -> np.ndarray:
    """The pixels under the True tokens."""
    return np.kron(tokens, np.ones((token_px, token_px), dtype=bool)).astype(bool)


@examples(300)
@given(shape=painting(), ops=small_ops, margin=st.integers(0, 2))
def test_the_token_mask_covers_every_pixel_paste_back_can_change(shape, ops, margin):
    """Outside the token mask pixels come from the template's cache: the effective (grown,
    feathered) mask must be 0 there, for any painting, ops, token size and margin (0 included)."""
    token_px, painted = shape
    processed = masks.apply_ops(painted, ops)
    alpha = masks.feather(processed, ops.feather_px)
    assert np.array_equal(alpha, masks.effective_alpha(painted, ops))
    assert np.array_equal(alpha > 0, (alpha > 0) & masks.feather_support(processed, ops.feather_px))
    grid = (painted.shape[0] // token_px, painted.shape[1] // token_px)
    # what pre-processing hands the engine: the feather's support, not the bare mask
    tokens = masks.token_mask(masks.feather_support(processed, ops.feather_px), grid, margin)
    assert not np.any(alpha[~token_area(tokens, token_px)] > 0)


@examples(120)
@given(
    upload=st.tuples(st.integers(4, 48), st.integers(4, 48)).flatmap(
        lambda hw: strokes(*hw, longest=8)
    ),
    grid=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    token_px=st.sampled_from([2, 4, 8]),
    feather_px=st.one_of(st.floats(0.01, 8.0), st.just(0.0)),
)
def test_through_the_bucket_the_token_mask_covers_the_feathered_paste(
    upload, grid, token_px, feather_px
):
    """Pre-processing's chain: the upload's mask, its feather support brought to the bucket
    (``mask_to_bucket``), the token mask of that. Every upload pixel inside the crop whose alpha
    is above 0 has its centre on a model pixel of a masked token (through the ``crop_box_for``
    box, down- or upscaled)."""
    size_hw = (grid[0] * token_px, grid[1] * token_px)
    support = masks.feather_support(upload, feather_px)
    try:
        pixels = uploads.mask_to_bucket(support, size_hw)
    except MaskError:
        return  # the painting lies in the cropped-off margins: refused, nothing is pasted
    area = token_area(masks.token_mask(pixels, grid), token_px)
    left, top, right, bottom = uploads.crop_box_for((upload.shape[1], upload.shape[0]), size_hw)
    alpha = masks.feather(upload, feather_px)

    def under(centre: float, side: int, crop: int) -> set[int]:
        """The model pixels whose box holds this centre (two when it lies on their border)."""
        at = centre * side / crop
        return {min(side - 1, math.floor(at + d)) for d in (-1e-9, 1e-9)}

    for y, x in np.argwhere(alpha > 0):
        if top <= y < bottom and left <= x < right:
            rows = under(y - top + 0.5, size_hw[0], bottom - top)
            cols = under(x - left + 0.5, size_hw[1], right - left)
            assert any(area[r, c] for r in rows for c in cols), (y, x)


# ----- resolution buckets ------------------------------------------------------------------------
@examples(300)
@given(
    width=st.integers(1, 20_000),
    height=st.integers(1, 20_000),
    base=st.integers(8, 2048),
    multiple=st.sampled_from([8, 16, 32, 64]),
)
def test_buckets_are_multiples_within_the_aspect_limit(width, height, base, multiple):
    h, w = uploads.resolution_bucket(width, height, base, multiple)
    assert h % multiple == 0 and w % multiple == 0 and h >= multiple and w >= multiple
    assert max(h / w, w / h) <= 2.0
    left, top, right, bottom = uploads.crop_box_for((width, height), (h, w))
    assert 0 <= left < right <= width and 0 <= top < bottom <= height

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

"""Upload decoding, resolution buckets, image/mask alignment and encoding (PIL + numpy only)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from backend.imaging.masks import MaskError
from backend.imaging.uploads import (
    ALLOWED_FORMATS,
    UploadError,
    crop_box_for,
    decode_image,
    encode_image,
    fit_to_bucket,
    prepare_mask,
    resolution_bucket,
    thumbnail,
)
from backend.protocol import MaskOps

LIMIT = 16_777_216  # 16.8 MP


def _save(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _noise(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), mode="RGB")


def _png_header_only(w: int, h: int) -> bytes:
    """A valid PNG signature + IHDR claiming w x h, with almost no pixel data behind it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def _mask_image(h: int, w: int, box: tuple[int, int, int, int], value: int = 255) -> Image.Image:
    x0, y0, x1, y1 = box
    arr = np.zeros((h, w), dtype=np.uint8)
    arr[y0:y1, x0:x1] = value
    return Image.fromarray(arr, mode="L")


def _bbox(mask: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


# --- decode_image -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ALLOWED_FORMATS)
def test_round_trip_every_allowed_format(fmt):
    src = _noise(37, 23)
    out = decode_image(_save(src, fmt), LIMIT)
    assert out.mode == "RGB" and out.size == (37, 23)
    if fmt in ("PNG", "BMP"):  # lossless
        assert np.array_equal(np.asarray(out), np.asarray(src))


def test_exif_orientation_applied():
    arr = np.full((20, 40, 3), 255, dtype=np.uint8)  # stored 40 wide, 20 high, white
    arr[:8, :8] = (255, 0, 0)  # red marker in the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = _save(Image.fromarray(arr), "JPEG", quality=95, exif=exif.tobytes())
    out = np.asarray(decode_image(data, LIMIT))
    assert out.shape == (40, 20, 3)  # displayed 20 wide, 40 high
    r, g, b = (int(v) for v in out[3, 16])  # the top-left corner went to the top-right
    assert r > 200 and g < 60 and b < 60
    assert tuple(out[3, 3]) == pytest.approx((255, 255, 255), abs=40)


def test_mask_keeps_mode_and_is_exif_transposed():
    exif = Image.Exif()
    exif[0x0112] = 6
    rgba = Image.new("RGBA", (30, 10), (0, 0, 0, 0))
    assert decode_image(_save(rgba, "PNG"), LIMIT, what="mask").mode == "RGBA"
    gray = Image.new("L", (30, 10), 0)
    out = decode_image(_save(gray, "JPEG", exif=exif.tobytes()), LIMIT, what="mask")
    assert out.mode == "L" and out.size == (10, 30)


def test_palette_mask_with_transparency_becomes_rgba():
    pal = Image.new("P", (8, 8), 0)
    pal.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    pal.info["transparency"] = 0
    out = decode_image(_save(pal, "PNG", transparency=0), LIMIT, what="mask")
    assert out.mode == "RGBA"


def test_rgba_flattened_on_white():
    arr = np.zeros((2, 3, 4), dtype=np.uint8)
    arr[0, 0] = (0, 0, 0, 0)  # fully transparent black -> white
    arr[0, 1] = (255, 0, 0, 255)  # opaque red stays red
    arr[0, 2] = (0, 0, 0, 128)  # half-transparent black -> mid grey
    out = np.asarray(decode_image(_save(Image.fromarray(arr, mode="RGBA"), "PNG"), LIMIT))
    assert tuple(out[0, 0]) == (255, 255, 255)
    assert tuple(out[0, 1]) == (255, 0, 0)
    assert all(120 <= v <= 135 for v in out[0, 2])


def test_16_bit_grayscale_scaled_not_clipped():
    arr = np.array([[0, 32768, 65535]], dtype=np.uint16)
    data = _save(Image.fromarray(arr), "PNG")
    assert np.asarray(decode_image(data, LIMIT, what="mask")).tolist() == [[0, 128, 255]]
    assert np.asarray(decode_image(data, LIMIT))[0, :, 0].tolist() == [0, 128, 255]


def test_pixel_limit_message():
    with pytest.raises(UploadError, match=r"image is 100x100 = 0\.0 MP, the limit is 0\.0 MP"):
        decode_image(_save(_noise(100, 100), "PNG"), max_pixels=9999)
    assert decode_image(_save(_noise(100, 100), "PNG"), max_pixels=10_000).size == (100, 100)


def test_pixel_limit_checked_on_the_header_before_decoding():
    # 25 MP claimed, a few bytes of pixels: decoding would fail as truncated, not as too large
    with pytest.raises(UploadError, match=r"mask is 5000x5000 = 25\.0 MP, the limit is 16\.8 MP"):
        decode_image(_png_header_only(5000, 5000), LIMIT, what="mask")


@pytest.mark.parametrize("side", [10_000, 20_000])  # PIL's bomb warning, then its bomb error
def test_decompression_bomb_is_an_upload_error(side):
    with pytest.raises(UploadError, match="too large"):
        decode_image(_png_header_only(side, side), max_pixels=10**9)


@pytest.mark.parametrize("fmt", ["GIF", "TIFF"])
def test_other_formats_rejected_with_allowed_list(fmt):
    with pytest.raises(UploadError) as info:
        decode_image(_save(_noise(8, 8), fmt), LIMIT)
    message = str(info.value)
    assert fmt in message and all(name in message for name in ALLOWED_FORMATS)


@pytest.mark.parametrize(
    "data",
    [b"", b"definitely not an image", b"\x89PNG\r\n\x1a\n"],
    ids=["empty", "garbage", "signature-only"],
)
def test_bad_bytes_are_upload_errors(data):
    with pytest.raises(UploadError, match="^mask "):
        decode_image(data, LIMIT, what="mask")


def test_truncated_png_is_an_upload_error():
    data = _save(_noise(64, 64), "PNG")
    with pytest.raises(UploadError, match="truncated"):
        decode_image(data[: len(data) // 2], LIMIT)


# --- buckets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("multiple", [8, 16, 64])
@pytest.mark.parametrize(
    "size",
    [
        (512, 512),
        (1920, 1080),
        (1080, 1920),
        (4000, 3000),
        (3000, 100),
        (100, 3000),
        (1, 1),
        (777, 333),
    ],
)
@pytest.mark.parametrize("base", [512, 1024])
def test_bucket_properties(size, multiple, base):
    w, h = size
    bh, bw = resolution_bucket(w, h, base, multiple)
    assert bh % multiple == 0 and bw % multiple == 0 and bh >= multiple and bw >= multiple
    assert 0.5 <= bw / bh <= 2.0  # clamped, rounding included
    assert abs(bw * bh / base**2 - 1) < 0.2  # about base * base pixels
    if w != h and 0.5 < w / h < 2:  # orientation follows the upload
        assert (bw > bh) == (w > h)


def test_bucket_examples():
    assert resolution_bucket(800, 800, 1024, 64) == (1024, 1024)
    assert resolution_bucket(4000, 1000, 1024, 64) == (704, 1408)  # 2:1, rounded back into range
    assert resolution_bucket(1000, 4000, 1024, 64) == (1408, 704)
    assert resolution_bucket(1920, 1080, 1024, 16) == (768, 1360)


@pytest.mark.parametrize(
    "args", [(0, 10, 512, 8), (10, -1, 512, 8), (10, 10, 0, 8), (10, 10, 512, 0)]
)
def test_bucket_rejects_non_positive(args):
    with pytest.raises(ValueError):
        resolution_bucket(*args)


def test_crop_box():
    assert crop_box_for((300, 200), (200, 300)) == (0, 0, 300, 200)  # same aspect: no crop
    assert crop_box_for((400, 100), (100, 200)) == (100, 0, 300, 100)  # wider: crop columns
    assert crop_box_for((100, 400), (200, 100)) == (0, 100, 100, 300)  # taller: crop rows


def test_fit_to_bucket_same_size_is_a_copy():
    img = _noise(64, 32)
    out = fit_to_bucket(img, (32, 64))
    assert out is not img and np.array_equal(np.asarray(out), np.asarray(img))


@pytest.mark.parametrize(
    "size, rect",
    [
        ((300, 200), (120, 50, 180, 110)),
        ((600, 100), (250, 20, 330, 70)),
        ((90, 250), (10, 100, 70, 160)),
    ],
)
def test_fit_to_bucket_and_prepare_mask_stay_aligned(size, rect):
    w, h = size
    x0, y0, x1, y1 = rect
    arr = np.full((h, w, 3), 128, dtype=np.uint8)
    arr[y0:y1, x0:x1] = (255, 0, 0)
    bucket = resolution_bucket(w, h, 128, 16)
    image = np.asarray(fit_to_bucket(Image.fromarray(arr), bucket)).astype(int)
    assert image.shape[:2] == bucket
    red = (image[..., 0] > 190) & (image[..., 1] < 64)
    mask = prepare_mask(_mask_image(h, w, rect), (w, h), bucket, MaskOps())
    assert mask.shape == bucket and mask.dtype == bool
    assert np.allclose(_bbox(mask), _bbox(red), atol=1)


# --- prepare_mask -------------------------------------------------------------------------------

RECT = (20, 20, 40, 40)


def _prepared(ops: MaskOps, image=None, size_hw=(64, 64)) -> np.ndarray:
    return prepare_mask(image or _mask_image(64, 64, RECT), (64, 64), size_hw, ops)


def test_prepare_mask_plain_and_invert():
    plain = _prepared(MaskOps())
    assert plain.sum() == 400 and _bbox(plain) == RECT
    assert np.array_equal(_prepared(MaskOps(invert=True)), ~plain)


def test_prepare_mask_grow_and_shrink():
    assert _bbox(_prepared(MaskOps(grow_px=3))) == (17, 17, 43, 43)
    assert _bbox(_prepared(MaskOps(grow_px=-3))) == (23, 23, 37, 37)


def test_grow_is_in_upload_pixels_and_the_downscale_keeps_any_masked_pixel():
    # 64 px upload -> 32 px model: 6 upload px are 3 model px; -> 16 px model: a model pixel covers
    # 4x4 upload pixels and is masked when any of them is
    assert _bbox(_prepared(MaskOps(grow_px=6), size_hw=(32, 32))) == (7, 7, 23, 23)
    assert _bbox(_prepared(MaskOps(), size_hw=(16, 16))) == (5, 5, 10, 10)
    assert _bbox(_prepared(MaskOps(grow_px=1), size_hw=(16, 16))) == (4, 4, 11, 11)
    assert _bbox(_prepared(MaskOps(grow_px=-1), size_hw=(16, 16))) == (5, 5, 10, 10)


def test_a_thin_stroke_survives_a_large_downscale():
    stroke = np.zeros((256, 256), dtype=np.uint8)
    stroke[:, 101] = 255  # one pixel wide
    mask = prepare_mask(Image.fromarray(stroke), (256, 256), (32, 32), MaskOps())
    assert mask[:, 12].all() and mask.sum() == 32


def test_a_painting_only_in_the_cropped_margin_is_refused():
    wide = np.zeros((100, 300), dtype=np.uint8)
    wide[40:60, 0:20] = 255  # left edge: cropped off when the bucket is square
    with pytest.raises(MaskError, match="outside the part of the image"):
        prepare_mask(Image.fromarray(wide), (300, 100), (64, 64), MaskOps())


def test_prepare_mask_threshold():
    faint = _mask_image(64, 64, RECT, value=100)
    assert _prepared(MaskOps(threshold=99), faint).sum() == 400
    with pytest.raises(MaskError, match="mask is empty: paint"):
        _prepared(MaskOps(threshold=100), faint)


def test_prepare_mask_reads_rgba_alpha():
    arr = np.zeros((64, 64, 4), dtype=np.uint8)
    arr[20:40, 20:40, 3] = 255
    assert _prepared(MaskOps(), Image.fromarray(arr, mode="RGBA")).sum() == 400


def test_prepare_mask_empty_before_and_after_ops():
    with pytest.raises(MaskError, match="mask is empty: paint the area to repaint"):
        _prepared(MaskOps(), _mask_image(64, 64, (0, 0, 0, 0)))
    with pytest.raises(MaskError, match="empty after the mask operations"):
        _prepared(MaskOps(grow_px=-10))
    with pytest.raises(MaskError, match="empty after the mask operations"):
        _prepared(MaskOps(invert=True), _mask_image(64, 64, (0, 0, 64, 64)))


def test_prepare_mask_size_mismatch():
    with pytest.raises(MaskError, match="does not match image size"):
        prepare_mask(_mask_image(32, 64, RECT), (64, 64), (64, 64), MaskOps())


@pytest.mark.parametrize(
    "ops, text",
    [
        (MaskOps(threshold=255), "0..254"),
        (MaskOps(threshold=-1), "0..254"),
        (MaskOps(grow_px=513), "-512..512"),
        (MaskOps(grow_px=-513), "-512..512"),
        (MaskOps(feather_px=-0.5), "0..256"),
        (MaskOps(feather_px=257), "0..256"),
        (MaskOps(feather_px=float("nan")), "0..256"),
    ],
)
def test_prepare_mask_rejects_bad_ops(ops, text):
    with pytest.raises(MaskError, match=text.replace(".", r"\.")):
        _prepared(ops)


# --- encoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["png", "webp", "PNG"])
def test_encode_round_trip_and_deterministic(fmt):
    img = _noise(33, 17)
    data = encode_image(img, fmt)
    assert data == encode_image(img, fmt)
    out = decode_image(data, LIMIT)
    assert out.size == (33, 17)
    if fmt.lower() == "png":
        assert np.array_equal(np.asarray(out), np.asarray(img))


def test_encode_rejects_other_formats():
    with pytest.raises(ValueError, match="png"):
        encode_image(_noise(4, 4), "jpeg")


@pytest.mark.parametrize(
    "size, expected_long", [((1000, 500), 256), ((300, 900), 256), ((100, 40), 100)]
)
def test_thumbnail_bounds_and_no_upscale(size, expected_long):
    thumb = Image.open(io.BytesIO(thumbnail(_noise(*size))))
    assert thumb.format == "WEBP" and max(thumb.size) == expected_long
    assert thumb.size[0] / thumb.size[1] == pytest.approx(size[0] / size[1], rel=0.02)

"""User uploads: decoding untrusted image bytes, model resolution buckets, mask preparation.

Invariants:
* ``decode_image`` never lets a PIL exception out: a bad upload is an ``UploadError`` saying what
  to fix, and the pixel limit is checked on the header size before any pixel is decoded;
* an image and its mask go through the same ``crop_box_for`` box and the same PIL resize mapping,
  so a masked pixel lands where the image pixel under it lands (to one pixel);
* buckets are multiples of the model's ``multiple`` and never distort: ``fit_to_bucket``
  centre-crops to the bucket's aspect before it resizes;
* "inpaint only the masked area" (``inpaint_area="masked"``) is the same crop with another box:
  ``masked_crop_box`` gives a box of the bucket's aspect (to the nearest pixel) that contains the
  mask's feather support plus the padding (clamped to the image), its edges snapped outward to a
  grid of 1/``CROP_GRID_DIVISIONS`` of each image side; ``fit_to_bucket`` and ``mask_to_bucket``
  take that box, and post-processing pastes back into it (``PastePlan.crop_box``) as it does into
  the bucket's centre crop (docs/design/crop.md).
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
from PIL import Image, ImageOps

from backend.imaging import masks
from backend.imaging.masks import MaskError
from backend.protocol import MaskOps


class UploadError(ValueError):
    """A bad upload the user must fix; the message says what is wrong and how to fix it."""


ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP")
_ALLOWED_TEXT = ", ".join(ALLOWED_FORMATS)
# Formats that PIL is not allowed to parse here, named only so the error message can say what the
# file is. Image.open is restricted to ALLOWED_FORMATS: no other parser ever sees untrusted bytes.
_OTHER_MAGIC = {b"GIF8": "GIF", b"II*\x00": "TIFF", b"MM\x00*": "TIFF", b"%PDF": "PDF"}
_HEIF_BRANDS = (b"heic", b"heix", b"mif1", b"msf1", b"avif")


def _sniff_other(head: bytes) -> str | None:
    if head[4:8] == b"ftyp" and head[8:12] in _HEIF_BRANDS:
        return "HEIC/AVIF"
    return _OTHER_MAGIC.get(head[:4])


def _open(data: bytes, max_pixels: int, what: str) -> Image.Image:
    """Parse the header only (PIL opens lazily); the bomb warning is an error here, because a
    decoded image of that size is what the pixel limit exists to refuse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise UploadError(
            f"{what} is too large to decode safely, the limit is "
            f"{max_pixels / 1e6:.1f} MP: upload a smaller {what}"
        ) from exc
    except Exception as exc:  # any parser failure on untrusted bytes is the file's fault
        other = _sniff_other(bytes(data[:16]))
        if other is not None:
            raise UploadError(
                f"{what} is a {other} file, which is not supported: upload one of {_ALLOWED_TEXT}"
            ) from exc
        raise UploadError(
            f"{what} is not an image file (or is corrupt): upload one of {_ALLOWED_TEXT}"
        ) from exc


def _to_8bit(img: Image.Image) -> Image.Image:
    """16-bit grayscale PNGs open as I;16/I; PIL's convert would clip them to 0..255 (an almost
    white image), so scale them to 8 bits instead."""
    if img.mode not in ("I", "I;16", "I;16B", "I;16L"):
        return img
    values = np.clip(np.asarray(img).astype(np.int64) >> 8, 0, 255).astype(np.uint8)
    return Image.fromarray(values, mode="L")


def _flatten_rgb(img: Image.Image) -> Image.Image:
    """RGB, with any transparency (alpha channel or palette/tRNS) composited over white."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def decode_image(
    data: bytes, max_pixels: int, what: str = "image", keep_mode: bool | None = None
) -> Image.Image:
    """Decode an upload into a fully loaded, EXIF-oriented image.

    ``keep_mode`` (default: ``what == "mask"``): the file's own mode is kept (``load_mask`` reads
    alpha), except that a palette image with transparency becomes RGBA and 16-bit grayscale
    becomes L. Otherwise: RGB, alpha composited over white. ``what`` names the file in errors.
    Raises UploadError for empty, corrupt, truncated, oversized (``width * height >
    max_pixels``, checked before decoding) or non-allowed-format uploads.
    """
    if not data:
        raise UploadError(f"{what} is empty (0 bytes): upload the {what} file again")
    img = _open(data, max_pixels, what)
    w, h = img.size  # from the header: no pixel is decoded before this check
    if w * h > max_pixels:
        raise UploadError(
            f"{what} is {w}x{h} = {w * h / 1e6:.1f} MP, the limit is "
            f"{max_pixels / 1e6:.1f} MP: upload a smaller {what}"
        )
    try:
        img.load()
        ImageOps.exif_transpose(img, in_place=True)
    except Exception as exc:  # truncated data, bad EXIF, decoder errors: all the file's fault
        raise UploadError(
            f"{what} could not be decoded, the file is truncated or corrupt "
            f"({exc}): export it again as one of {_ALLOWED_TEXT}"
        ) from exc
    img = _to_8bit(img)
    if keep_mode or (keep_mode is None and what == "mask"):
        if img.mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")
        return img
    return _flatten_rgb(img)


MIN_EDIT_SIDE_PX = 16


def require_edit_size(size_wh: tuple[int, int], what: str) -> None:
    """An image to edit (a template, an edit's image, its mask) has each side at least
    ``MIN_EDIT_SIDE_PX``; ``UploadError`` saying the minimum otherwise.

    Why 16: the VAE downsamples by 8 and Flux packs 2x2 latents into one token, so 16 px is one
    token of every family's denoiser; a smaller picture holds less than one token of content and,
    resized to the model's resolution bucket, would be all interpolation with nothing to edit.
    The bucket itself (the demo model's 128 px) is no minimum: every upload is resized to it, and
    small pictures (thumbnails, icons, the test suite's 32 px templates) edit fine."""
    width, height = size_wh
    if min(width, height) < MIN_EDIT_SIDE_PX:
        raise UploadError(
            f"{what} is {width}x{height} px, too small to edit: each side must be at least "
            f"{MIN_EDIT_SIDE_PX} px; upload a larger {what}"
        )


def _round_to(value: float, multiple: int) -> int:
    return max(multiple, int(value / multiple + 0.5) * multiple)


def resolution_bucket(
    width: int, height: int, base: int, multiple: int, max_aspect: float = 2.0
) -> tuple[int, int]:
    """(height, width) for the model: about ``base * base`` pixels, each side a positive multiple
    of ``multiple``, the upload's aspect clamped to [1 / max_aspect, max_aspect].

    Invariant: the returned aspect lies within that range (rounding a side the wrong way is
    corrected by one step of ``multiple``). A square upload gives (base, base) when
    ``base % multiple == 0``.
    """
    if min(width, height, base, multiple) <= 0:
        raise ValueError(
            f"bucket needs positive sizes, got {width}x{height}, base {base}, multiple {multiple}"
        )
    if not max_aspect >= 1.0:
        raise ValueError(f"max_aspect must be >= 1, got {max_aspect}")
    aspect = min(max(width / height, 1.0 / max_aspect), max_aspect)
    w = _round_to(base * math.sqrt(aspect), multiple)
    h = _round_to(base / math.sqrt(aspect), multiple)
    if w > max_aspect * h:
        w, h = _fix_aspect(w, h, multiple, max_aspect, base * base)
    elif h > max_aspect * w:
        h, w = _fix_aspect(h, w, multiple, max_aspect, base * base)
    return h, w


def _fix_aspect(
    long: int, short: int, multiple: int, max_aspect: float, area: int
) -> tuple[int, int]:
    """Bring long/short back within max_aspect by one step: grow the short side (always enough,
    as (a + m) / (b + m) <= a / b for a >= b) or shrink the long side, whichever stays in range
    closer to the target area."""
    options = [(long, short + multiple)]
    if long - multiple >= multiple and long - multiple <= max_aspect * short:
        options.append((long - multiple, short))
    return min(options, key=lambda o: abs(o[0] * o[1] - area))


def crop_box_for(size_wh: tuple[int, int], size_hw: tuple[int, int]) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the centred crop of a ``size_wh`` image that has the aspect of
    the ``size_hw`` target, to the nearest source pixel; the whole image when it already has it.
    ``fit_to_bucket`` and ``prepare_mask`` both use it, which keeps image and mask aligned."""
    (sw, sh), (th, tw) = size_wh, size_hw
    if min(sw, sh, th, tw) <= 0:
        raise ValueError(f"sizes must be positive, got {sw}x{sh} and {tw}x{th}")
    if sw * th > tw * sh:  # source is wider than the target: crop columns
        cw = max(1, (2 * sh * tw + th) // (2 * th))
        left = (sw - cw) // 2
        return left, 0, left + cw, sh
    if sw * th < tw * sh:  # source is taller: crop rows
        ch = max(1, (2 * sw * th + tw) // (2 * tw))
        top = (sh - ch) // 2
        return 0, top, sw, top + ch
    return 0, 0, sw, sh


def fit_to_bucket(
    image: Image.Image, size_hw: tuple[int, int], box: tuple[int, int, int, int] | None = None
) -> Image.Image:
    """Resize to (height, width) = ``size_hw`` with LANCZOS after a centre crop to the target
    aspect (``crop_box_for``), so nothing is stretched; ``box``: crop this (left, top, right,
    bottom) box instead (``masked_crop_box``, of the target's aspect). The mask must go through
    the same box: use ``prepare_mask`` / ``mask_to_bucket``. An image already of that size comes
    back as a copy (without ``box``)."""
    th, tw = size_hw
    if box is None:
        if image.size == (tw, th):
            return image.copy()
        box = crop_box_for(image.size, size_hw)
    return image.resize((tw, th), Image.Resampling.LANCZOS, box=box)


INPAINT_AREAS = ("whole", "masked")
DEFAULT_CROP_PADDING_PX = 32  # A1111's "only masked padding, pixels"
MAX_CROP_PADDING_PX = 1024
# crop box edges snap outward to multiples of 1/8 of each image side, so nearby masks share one
# crop and so one template cache (docs/design/crop.md: the trade-off, measured)
CROP_GRID_DIVISIONS = 8


def validate_inpaint_area(area: str, padding_px: int) -> None:
    """UploadError saying what to fix when ``area`` is not one of ``INPAINT_AREAS`` or the
    padding is not a whole number of pixels in 0..``MAX_CROP_PADDING_PX``."""
    if area not in INPAINT_AREAS:
        raise UploadError(
            f"inpaint_area {area!r} is not known: use whole (the model edits the whole image, "
            "the default) or masked (it edits a padded crop around the mask at its full "
            "resolution: more detail for a small mask on a large image)"
        )
    integral = isinstance(padding_px, int) and not isinstance(padding_px, bool)
    if not integral or not 0 <= padding_px <= MAX_CROP_PADDING_PX:
        raise UploadError(
            f"crop_padding_px {padding_px!r} is out of range: use a whole number of pixels in "
            f"0..{MAX_CROP_PADDING_PX} (the context kept around the mask when inpaint_area is "
            "masked)"
        )


def _grid_line(index: int, size: int, divisions: int) -> int:
    """The ``index``-th of ``divisions + 1`` grid lines across ``size`` pixels (0 and ``size``
    included), to the nearest pixel."""
    return (2 * index * size + divisions) // (2 * divisions)


def _snap(lo: int, hi: int, size: int, divisions: int) -> tuple[int, int]:
    """[lo, hi) grown outward to the nearest grid lines (``_grid_line``)."""
    lines = [_grid_line(i, size, divisions) for i in range(divisions + 1)]
    return max(x for x in lines if x <= lo), min(x for x in lines if x >= hi)


def _place(lo: int, hi: int, length: int, size: int, keep: tuple[int, int]) -> int:
    """The start of a window of ``length`` centred on [lo, hi), shifted to contain ``keep`` (or,
    when ``keep`` is longer, centred on it: cut evenly on both sides, as ``crop_box_for`` cuts),
    then inside [0, size)."""
    if keep[1] - keep[0] > length:
        start = keep[0] + (keep[1] - keep[0] - length) // 2
    else:
        start = lo - (length - (hi - lo)) // 2
        start = min(max(start, keep[1] - length), keep[0])
    return min(max(0, start), size - length)


def masked_crop_box(
    support: np.ndarray,
    size_hw: tuple[int, int],
    padding_px: int = DEFAULT_CROP_PADDING_PX,
    divisions: int = CROP_GRID_DIVISIONS,
) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the crop an ``inpaint_area="masked"`` edit runs on, in upload
    pixels: the bounding box of ``support`` (the processed mask's feather support, at the upload's
    resolution: every pixel paste-back can change) padded by ``padding_px`` on every side and
    clamped to the image (``masks.crop_to_mask``), its edges snapped outward to the grid lines at
    multiples of 1/``divisions`` of each side (0: no snapping), then its shorter side grown around
    its centre to the aspect of ``size_hw`` (the bucket, to the nearest pixel) and the box
    shifted inside the image.

    Invariants: the box lies inside the image and has the bucket's aspect; it contains the padded
    support whenever some box of that aspect inside the image does (else it is the largest one,
    cutting the padded support evenly, as ``crop_box_for`` cuts a whole-image edit's margins: a
    padded support covering the image gives ``crop_box_for``'s box); its size never
    shrinks as ``padding_px`` grows. A box reaching the largest of that aspect is
    ``crop_box_for``'s when that one contains the padded support: the whole-image edit's crop,
    which shares its cache. Raises MaskError when ``support`` is empty."""
    height, width = support.shape
    padded = left, top, right, bottom = masks.crop_to_mask(support, padding_px)
    if divisions:
        left, right = _snap(left, right, width, divisions)
        top, bottom = _snap(top, bottom, height, divisions)
    (th, tw), (w, h) = size_hw, (right - left, bottom - top)
    if w * th < tw * h:  # narrower than the bucket: widen, to the nearest pixel
        w = max(1, (2 * h * tw + th) // (2 * th))
    else:
        h = max(1, (2 * w * th + tw) // (2 * tw))
    full = crop_box_for((width, height), size_hw)
    if w >= full[2] - full[0] or h >= full[3] - full[1]:
        pl, pt, pr, pb = padded
        if full[0] <= pl and full[1] <= pt and pr <= full[2] and pb <= full[3]:
            return full  # the whole-image edit's crop: it shares that cache
        w, h = full[2] - full[0], full[3] - full[1]
    x = _place(left, right, w, width, (padded[0], padded[2]))
    y = _place(top, bottom, h, height, (padded[1], padded[3]))
    return x, y, x + w, y + h


MAX_MIN_AREA_PX = 4096 * 4096


def _validate_ops(ops: MaskOps) -> None:
    if not 0 <= ops.threshold <= 254:
        raise MaskError(f"mask threshold {ops.threshold} is out of range: use 0..254")
    if not abs(ops.grow_px) <= 512:
        raise MaskError(
            f"mask grow {ops.grow_px} px is out of range: use -512..512 (negative shrinks)"
        )
    if not 0 <= ops.feather_px <= 256:  # also rejects NaN
        raise MaskError(f"mask feather {ops.feather_px} px is out of range: use 0..256")
    if isinstance(ops.min_area_px, bool) or not 0 <= ops.min_area_px <= MAX_MIN_AREA_PX:
        raise MaskError(
            f"mask min_area_px {ops.min_area_px} is out of range: use 0..{MAX_MIN_AREA_PX} "
            "(painted areas smaller than this many pixels are dropped; 0 keeps all)"
        )


def process_mask(mask: Image.Image, image_size_wh: tuple[int, int], ops: MaskOps) -> np.ndarray:
    """Bool mask at the upload's own resolution, True = repaint: what paste-back uses.

    Order: validate ops, threshold (``load_mask``, which also checks the mask is the size of the
    image as uploaded), reject an empty painting, then ``masks.apply_ops`` (fill holes, remove
    specks, invert, grow/shrink by ``grow_px`` upload pixels: the pixels the user painted on).
    Feather is not applied here (paste-back applies ``ops.feather_px``). Raises MaskError, naming
    the step, when nothing is left to repaint.
    """
    _validate_ops(ops)
    painted = masks.load_mask(mask, expected_size=image_size_wh, threshold=ops.threshold)
    masks.require_nonempty(painted)
    return masks.apply_ops(painted, ops, strict=True)


def mask_to_bucket(
    full_mask: np.ndarray,
    size_hw: tuple[int, int],
    box: tuple[int, int, int, int] | None = None,
) -> np.ndarray:
    """The upload-resolution mask at the model resolution, through the same crop as
    ``fit_to_bucket`` (``box``: the one given to it, e.g. ``masked_crop_box``'s).

    A model pixel is masked when ANY upload pixel under it is (``masks.resize_any``: any overlap,
    in exact integer arithmetic), so thin strokes survive a downscale and every pixel paste-back
    will take from the generated image was generated inside the mask. Raises MaskError when the
    painting lies wholly in the cropped-off margins.
    """
    height, width = full_mask.shape
    if box is None:
        box = crop_box_for((width, height), size_hw)
    resized = masks.resize_any(full_mask, box, size_hw)
    if not resized.any():
        left, top, right, bottom = box
        raise MaskError(
            f"the painted area lies outside the part of the image the model edits "
            f"(x {left}-{right}, y {top}-{bottom} for this aspect ratio): paint inside it"
        )
    return resized


def prepare_mask(
    mask: Image.Image, image_size_wh: tuple[int, int], size_hw: tuple[int, int], ops: MaskOps
) -> np.ndarray:
    """Bool (H, W) = ``size_hw`` mask at the model resolution: ``process_mask`` then
    ``mask_to_bucket``."""
    return mask_to_bucket(process_mask(mask, image_size_wh, ops), size_hw)


def encode_image(image: Image.Image, fmt: str = "png", quality: int = 95) -> bytes:
    """PNG (lossless; ``quality`` ignored) or lossy WebP bytes. The same image always gives the
    same bytes: no timestamp or other metadata is written."""
    fmt = fmt.lower()
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt == "webp":
        if not 0 <= quality <= 100:
            raise ValueError(f"webp quality must be in 0..100, got {quality}")
        if image.mode not in ("RGB", "RGBA"):
            image = image.convert("RGBA" if "A" in image.getbands() else "RGB")
        image.save(buf, format="WEBP", lossless=False, quality=quality)
    else:
        raise ValueError(f"unsupported output format {fmt!r}: use 'png' or 'webp'")
    return buf.getvalue()


def thumbnail(image: Image.Image, max_side: int = 256) -> bytes:
    """WebP bytes of the image shrunk to fit ``max_side`` x ``max_side``, aspect preserved
    (PIL's rounding), never upscaled."""
    if max_side < 1:
        raise ValueError(f"thumbnail max_side must be >= 1, got {max_side}")
    small = image.copy()
    small.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    return encode_image(small, "webp", quality=80)

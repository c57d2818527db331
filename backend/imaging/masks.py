"""Pixel masks and token masks.

Mask contract (IOPaint / A1111): a grayscale image the size of the picture, 255 = repaint,
0 = keep. RGBA masks carry the painted area in their alpha channel; "1", "L", "RGB" and other
modes are read as luminance. Internally a pixel mask is a bool (H, W) array, True = repaint, and
a token mask is a bool (gh, gw) array over a model's token grid, True = computed fresh.

Morphology is OpenCV's (``cv2``). Neighbourhoods, and why they nest:

* ``grow``/``shrink`` by ``px`` use a disc (Euclidean distance <= px, ``disc``), so a grown mask
  has round corners instead of square ones;
* ``feather``'s Gaussian is truncated at radius ``r = feather_radius(px) = ceil(px)``: its kernel
  is the (2r + 1) square, so the feathered alpha is 0 wherever the whole square (Chebyshev
  distance <= r) is unmasked. ``feather_support`` is that square neighbourhood: the pixels
  paste-back can change;
* ``token_mask`` marks a token when any pixel under it is masked (then grows by a margin of
  tokens, a square again).

A disc of radius r lies inside the square of radius r, so every bound stated with squares also
holds for the round masks. Pre-processing gives the engine ``feather_support`` of the processed
mask (not the bare mask), so the token mask covers every pixel whose alpha is above 0 whatever
the feather and the token margin (0 included): pixels outside it come from the template's cache
and are pasted with alpha 0, i.e. never.

``apply_ops`` is the one implementation of a ``MaskOps`` (pre-processing and the studio's preview
both call it), in this order: threshold (when the mask image is read, ``load_mask``), fill holes
(the lasso), remove specks, invert, grow/shrink; feather last, at paste-back.
"""

from __future__ import annotations

import math

import cv2
import numpy as np
from PIL import Image

from backend.protocol.messages import MaskOps

DEFAULT_THRESHOLD: int = MaskOps.threshold  # the one default, shared with the job messages


class MaskError(ValueError):
    """A mask the user must fix; the message says what is wrong and how to fix it."""


def load_mask(
    img: Image.Image,
    expected_size: tuple[int, int] | None = None,
    threshold: int = DEFAULT_THRESHOLD,
) -> np.ndarray:
    """Bool (H, W) mask, True where the value is > ``threshold``.

    ``expected_size`` is PIL's (width, height) of the image the mask belongs to. Raises MaskError
    on a size mismatch; an empty mask is returned as is (``require_nonempty`` rejects it where the
    caller needs a painted area).
    """
    if expected_size is not None and tuple(img.size) != tuple(expected_size):
        (mw, mh), (iw, ih) = img.size, expected_size
        raise MaskError(
            f"mask size {mw}x{mh} does not match image size {iw}x{ih}: "
            "draw the mask on the image being edited"
        )
    if img.width < 1 or img.height < 1:
        raise MaskError(f"mask is {img.width}x{img.height} pixels: draw a mask with pixels in it")
    if img.mode in _ALPHA_MODES:
        alpha = np.asarray(img.getchannel(img.getbands()[-1]))  # "A", or "a" when premultiplied
        # a uniform alpha carries no painting (an opaque black/white mask saved as RGBA):
        # fall back to the colour channels rather than read "everything" or "nothing"
        values = alpha if alpha.min() != alpha.max() else _brightness(img)
    else:
        values = _brightness(img)
    return values > threshold


# modes whose alpha channel carries the painting (La/RGBa: premultiplied, alpha as is)
_ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")
# PIL converts some modes to L only through another mode (La via LA, LAB via RGB)
_TO_LUMINANCE = (("L",), ("RGB", "L"), ("LA", "L"))


def _brightness(img: Image.Image) -> np.ndarray:
    """8-bit value of each pixel: a grayscale mask's level; a colour mask's brightest channel, so
    that any bright paint counts (pure red's luminance is 76, under the default threshold)."""
    if img.mode == "P" or len(img.getbands()) >= 3:
        try:
            return np.asarray(img.convert("RGB")).max(axis=2)
        except ValueError:
            pass  # a mode PIL cannot bring to RGB: its luminance, or a clear refusal
    return _luminance(img)


def _luminance(img: Image.Image) -> np.ndarray:
    """The mask's 8-bit luminance; MaskError for a mode PIL cannot bring to grayscale."""
    for path in _TO_LUMINANCE:
        try:
            converted = img
            for mode in path:
                converted = converted.convert(mode)
        except ValueError:
            continue
        return np.asarray(converted)
    raise MaskError(
        f"a mask in image mode {img.mode} cannot be read: save it as a grayscale or RGBA PNG"
    )


def require_nonempty(mask: np.ndarray) -> None:
    if not np.any(mask):
        raise MaskError(
            "mask is empty: paint the area to repaint (a pixel counts when its brightest colour "
            "channel, or its alpha in a mask with transparency, is above the threshold, "
            f"{DEFAULT_THRESHOLD} of 255 by default)"
        )


def _as_bool_2d(mask: np.ndarray) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"a mask must be 2-D (H, W), got shape {mask.shape}")
    return mask.astype(bool, copy=False)


def invert(mask: np.ndarray) -> np.ndarray:
    return ~_as_bool_2d(mask)


# up to this radius ``cv2.dilate``/``cv2.erode`` with the disc kernel (cost grows with the disc's
# area); above it a distance transform gives the same disc in time linear in the pixels
KERNEL_MAX_RADIUS = 24
# float32 distances tell r^2 from r^2 + 1 apart safely up to here (see _within_disc)
DISTANCE_MAX_RADIUS = 1024
MASK_KINDS = ("blob", "stroke", "rect")  # synthetic_mask: shapes painted masks take in benchmarks


def disc(radius: int) -> np.ndarray:
    """uint8 (2r + 1, 2r + 1) structuring element: 1 where x^2 + y^2 <= r^2 (a pixel at Euclidean
    distance > r is 0; OpenCV's own MORPH_ELLIPSE also takes some of those)."""
    if radius < 0:
        raise ValueError(f"a disc needs radius >= 0, got {radius}")
    y, x = np.ogrid[-radius : radius + 1, -radius : radius + 1]
    return (x * x + y * y <= radius * radius).astype(np.uint8)


def _u8(mask: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(mask, dtype=np.uint8)


def _within_disc(mask: np.ndarray, px: int) -> np.ndarray:
    """True where a True pixel of ``mask`` is at Euclidean distance <= px: OpenCV's exact
    Euclidean distance transform (DIST_MASK_PRECISE). Squared distances are integers, so the
    cut lies between px^2 and px^2 + 1, where float32 distances cannot be mistaken below
    ``DISTANCE_MAX_RADIUS``."""
    distance = cv2.distanceTransform(_u8(~mask), cv2.DIST_L2, cv2.DIST_MASK_PRECISE)
    return distance <= math.sqrt(px * px + 0.5)


def _by_kernel(px: int) -> bool:
    return px <= KERNEL_MAX_RADIUS or px > DISTANCE_MAX_RADIUS


def grow(mask: np.ndarray, px: int) -> np.ndarray:
    """Dilate by a disc (``disc(px)``): True wherever a True pixel is within Euclidean distance
    px. Outside the image counts as unmasked."""
    mask = _as_bool_2d(mask)
    if px < 0:
        raise ValueError(f"grow needs px >= 0, got {px}")
    if px == 0 or not mask.any():
        return mask.copy()
    if _by_kernel(px):
        # dilate's default border is -inf: outside the image counts as unmasked
        return cv2.dilate(_u8(mask), disc(px)) > 0
    return _within_disc(mask, px)


def shrink(mask: np.ndarray, px: int) -> np.ndarray:
    """Erode by a disc (``disc(px)``): True where every pixel within Euclidean distance px is.
    Outside the image counts as masked, so a mask touching the border is not eaten from the
    border (a full mask stays full)."""
    mask = _as_bool_2d(mask)
    if px < 0:
        raise ValueError(f"shrink needs px >= 0, got {px}")
    if px == 0 or mask.all():
        return mask.copy()
    if _by_kernel(px):
        # erode's default border is +inf: outside the image counts as masked
        return cv2.erode(_u8(mask), disc(px)) > 0
    return ~_within_disc(~mask, px)


def _square(radius: int) -> np.ndarray:
    return np.ones((2 * radius + 1, 2 * radius + 1), dtype=np.uint8)


def feather_radius(px: float) -> int:
    """Where ``feather``'s Gaussian is truncated: ceil(px) pixels (3 sigma)."""
    return math.ceil(px)


def feather_support(mask: np.ndarray, px: float) -> np.ndarray:
    """Bool: where ``feather(mask, px)`` can be above 0 (the pixels paste-back can change), the
    mask grown by the (2r + 1) square, r = ``feather_radius(px)``; the mask itself for px = 0."""
    mask = _as_bool_2d(mask)
    radius = feather_radius(px)
    if radius == 0 or not mask.any():
        return mask.copy()
    return cv2.dilate(_u8(mask), _square(radius)) > 0


def feather(mask: np.ndarray, px: float) -> np.ndarray:
    """Soft float32 alpha in [0, 1]: ``cv2.GaussianBlur`` with sigma = px / 3, truncated at radius
    r = ceil(px) (a (2r + 1) square kernel), the image's edge pixels repeated beyond it.

    Invariants: alpha == 1 wherever the whole (2r + 1) square around a pixel is masked, == 0
    wherever none of it is (outside ``feather_support``), so pixels farther than r from the mask
    edge paste back bit-exactly.
    """
    mask = _as_bool_2d(mask)
    if px < 0 or not math.isfinite(px):
        raise ValueError(f"feather needs a finite px >= 0, got {px}")
    radius = feather_radius(px)
    if radius == 0:
        return mask.astype(np.float32)
    side, sigma = 2 * radius + 1, max(px / 3.0, 1e-3)
    alpha = cv2.GaussianBlur(
        mask.astype(np.float32),
        (side, side),
        sigmaX=sigma,
        sigmaY=sigma,
        borderType=cv2.BORDER_REPLICATE,
    )
    alpha = np.clip(alpha, 0.0, 1.0)
    # the blur's sum of weights is 1 only up to rounding; pin the plateaus exactly
    alpha[cv2.erode(_u8(mask), _square(radius)) > 0] = 1.0
    alpha[~feather_support(mask, px)] = 0.0
    return alpha


def fill_holes(mask: np.ndarray) -> np.ndarray:
    """The mask with every enclosed unmasked area filled: a closed painted outline becomes the
    area it encloses (a lasso). An unmasked area is enclosed when it does not reach the image
    border through 4-connected unmasked pixels, so an outline drawn with diagonal steps
    (8-connected) still closes."""
    mask = _as_bool_2d(mask)
    if not mask.any():
        return mask.copy()
    count, labels = cv2.connectedComponents(_u8(~mask), connectivity=4)
    if count <= 1:
        return mask.copy()
    border = np.unique(
        np.concatenate((labels[0], labels[-1], labels[:, 0], labels[:, -1]))
    )  # the unmasked areas that reach the border (label 0 is the mask itself)
    outside = np.isin(labels, border[border > 0])
    return ~outside


def remove_specks(mask: np.ndarray, min_area_px: int) -> np.ndarray:
    """The mask without its painted areas (8-connected components) smaller than ``min_area_px``
    pixels; 0 or 1 keeps everything."""
    mask = _as_bool_2d(mask)
    if min_area_px < 0:
        raise ValueError(f"min_area_px must be >= 0, got {min_area_px}")
    if min_area_px <= 1 or not mask.any():
        return mask.copy()
    count, labels, stats, _ = cv2.connectedComponentsWithStats(_u8(mask), connectivity=8)
    keep = stats[:, cv2.CC_STAT_AREA] >= min_area_px
    keep[0] = False  # label 0 is the unmasked background
    return keep[labels]


# each step of ``apply_ops`` that can leave nothing to repaint, and what the user should do then
_EMPTIED = {
    "specks": "every painted area is smaller than the speck size (min_area_px {min_area_px}): "
    "paint a larger area or lower min_area_px",
    "invert": "after inverting it nothing is left (everything was painted): paint less or turn "
    "invert off",
    "shrink": "paint a larger area or reduce the shrink",
}


def apply_ops(painted: np.ndarray, ops: MaskOps, strict: bool = False) -> np.ndarray:
    """Bool (H, W): ``ops`` applied to a painting already read with ``ops.threshold``
    (``load_mask``), in the canonical order: fill holes (``ops.fill_holes``: the lasso), remove
    specks (``ops.min_area_px``), invert, grow (``ops.grow_px`` > 0) or shrink (< 0). Feather
    is not applied here (``effective_alpha`` and paste-back apply ``ops.feather_px``).

    ``strict``: raise MaskError, naming the step, when a step leaves nothing to repaint."""
    mask = _as_bool_2d(painted)
    steps = (
        ("fill", lambda m: fill_holes(m) if ops.fill_holes else m),
        ("specks", lambda m: remove_specks(m, int(ops.min_area_px))),
        ("invert", lambda m: invert(m) if ops.invert else m),
        (
            "shrink",
            lambda m: grow(m, int(ops.grow_px)) if ops.grow_px >= 0 else shrink(m, -ops.grow_px),
        ),
    )
    for name, step in steps:
        mask = step(mask)
        if strict and name in _EMPTIED and not mask.any():
            raise MaskError(
                "mask is empty after the mask operations: "
                + _EMPTIED[name].format(min_area_px=ops.min_area_px)
            )
    return mask


def effective_alpha(painted: np.ndarray, ops: MaskOps) -> np.ndarray:
    """Float32 (H, W) in [0, 1]: what paste-back takes from the generated image for this painting
    and these ops (``apply_ops``, then ``feather`` by ``ops.feather_px``)."""
    return feather(apply_ops(painted, ops), ops.feather_px)


def token_mask(mask: np.ndarray, grid_hw: tuple[int, int], margin: int = 0) -> np.ndarray:
    """Bool (gh, gw): a token is masked if ANY pixel under it is, then grown by ``margin`` tokens
    (the (2 margin + 1) square of tokens). Needs H % gh == 0 and W % gw == 0 (each token covers
    a whole pixel block)."""
    mask = _as_bool_2d(mask)
    (h, w), (gh, gw) = mask.shape, grid_hw
    if gh < 1 or gw < 1 or h % gh or w % gw:
        raise MaskError(
            f"mask of {h}x{w} pixels does not divide into a {gh}x{gw} token grid: "
            "use an image size that is a multiple of the model's token size"
        )
    if margin < 0:
        raise ValueError(f"token margin must be >= 0, got {margin}")
    tokens = mask.reshape(gh, h // gh, gw, w // gw).any(axis=(1, 3))
    if margin == 0 or not tokens.any():
        return tokens
    return cv2.dilate(_u8(tokens), _square(margin)) > 0


def _overlapping(start: int, length: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``size`` cells splitting [start, start + length) evenly: the first and one
    past the last source index it overlaps (floor and ceil of its ends, in integers)."""
    cells = np.arange(size, dtype=np.int64)
    return start + cells * length // size, start - (-(cells + 1) * length // size)


def resize_any(
    mask: np.ndarray, box: tuple[int, int, int, int], size_hw: tuple[int, int]
) -> np.ndarray:
    """Bool ``size_hw``: the (left, top, right, bottom) ``box`` of ``mask`` resized, a cell True
    when ANY source pixel it overlaps (even partly) is, down- or upscaling. A resampling filter
    can lose a stroke lying on a cell border (PIL's BOX drops a row whose centre falls exactly
    there); counts over exact integer bounds cannot."""
    mask = _as_bool_2d(mask)
    left, top, right, bottom = box
    th, tw = size_hw
    rows_lo, rows_hi = _overlapping(top, bottom - top, th)
    cols_lo, cols_hi = _overlapping(left, right - left, tw)
    counts = np.zeros((mask.shape[0] + 1, right - left), dtype=np.int32)
    np.cumsum(mask[:, left:right], axis=0, out=counts[1:])
    rows = (counts[rows_hi] - counts[rows_lo]) > 0  # (th, crop width)
    counts = np.zeros((th, rows.shape[1] + 1), dtype=np.int32)
    np.cumsum(rows, axis=1, out=counts[:, 1:])
    return (counts[:, cols_hi - left] - counts[:, cols_lo - left]) > 0


def mask_ratio(token_mask: np.ndarray) -> float:
    """Fraction of masked entries (tokens or pixels)."""
    mask = np.asarray(token_mask)
    if mask.size == 0:
        raise ValueError("mask_ratio of an empty array")
    return float(np.count_nonzero(mask)) / mask.size


def paste_back(generated: Image.Image, original: Image.Image, alpha: np.ndarray) -> Image.Image:
    """``alpha * generated + (1 - alpha) * original`` per pixel, rounded to uint8, in the mode of
    ``original`` (L, RGB or RGBA; other modes work in RGB).

    Invariant: where alpha == 0 the output equals the original exactly, where alpha == 1 it equals
    the generated image exactly (both are selected, not recomputed).
    """
    if generated.size != original.size:
        raise MaskError(
            f"generated size {generated.size[0]}x{generated.size[1]} does not match "
            f"original size {original.size[0]}x{original.size[1]}"
        )
    mode = original.mode if original.mode in ("L", "RGB", "RGBA") else "RGB"
    gen = np.asarray(generated.convert(mode), dtype=np.float64)
    orig_u8 = np.asarray(original.convert(mode))
    a = np.asarray(alpha, dtype=np.float64)
    if a.shape != orig_u8.shape[:2]:
        raise ValueError(f"alpha shape {a.shape} does not match image shape {orig_u8.shape[:2]}")
    if not (np.all(a >= 0.0) and np.all(a <= 1.0)):
        raise ValueError("alpha must lie in [0, 1]")
    if orig_u8.ndim == 3:
        a = a[..., None]
    blended = np.clip(np.rint(a * gen + (1.0 - a) * orig_u8), 0, 255).astype(np.uint8)
    out = np.where(a == 0.0, orig_u8, np.where(a == 1.0, gen.astype(np.uint8), blended))
    return Image.fromarray(out.astype(np.uint8), mode=mode)


def _fit_axis(lo: int, hi: int, size: int, multiple: int) -> tuple[int, int]:
    """Grow [lo, hi) around its centre to a multiple of ``multiple`` inside [0, size), shifting
    it off the borders; left unchanged when no such multiple fits."""
    target = -(-(hi - lo) // multiple) * multiple
    if target > size:
        return lo, hi
    extra = target - (hi - lo)
    lo, hi = lo - extra // 2, hi + extra - extra // 2
    if lo < 0:
        lo, hi = 0, hi - lo
    if hi > size:
        lo, hi = lo - (hi - size), size
    return lo, hi


def crop_to_mask(mask: np.ndarray, padding: int, multiple: int = 1) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1), exclusive ends: the mask's bounding box plus ``padding`` on every side,
    clipped to the image, each side length rounded up to ``multiple`` where that fits.
    Invariant: the box contains every masked pixel and lies inside the image."""
    mask = _as_bool_2d(mask)
    require_nonempty(mask)
    if padding < 0 or multiple < 1:
        raise ValueError(f"crop needs padding >= 0 and multiple >= 1, got {padding} and {multiple}")
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    h, w = mask.shape
    y0, y1 = max(0, int(rows[0]) - padding), min(h, int(rows[-1]) + 1 + padding)
    x0, x1 = max(0, int(cols[0]) - padding), min(w, int(cols[-1]) + 1 + padding)
    y0, y1 = _fit_axis(y0, y1, h, multiple)
    x0, x1 = _fit_axis(x0, x1, w, multiple)
    return x0, y0, x1, y1


def _rect_mask(height: int, width: int, area: float, rng: np.random.Generator) -> np.ndarray:
    """An axis-aligned rectangle of about ``area`` pixels, aspect drawn from [1/2, 2], placed at
    random. Among the heights whose rounded area is within 0.5 % of the target, the one closest
    to the drawn aspect wins (pure area matching would favour slivers)."""
    aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
    best = None
    for h in range(1, height + 1):
        w = int(min(width, max(1, round(area / h))))
        error = abs(h * w - area) / (height * width)
        key = (error > 0.005, abs(math.log(w / h / aspect)) if error <= 0.005 else error)
        if best is None or key < best[0]:
            best = (key, h, w)
    assert best is not None
    _, h, w = best
    y = int(rng.integers(0, height - h + 1))
    x = int(rng.integers(0, width - w + 1))
    out = np.zeros((height, width), dtype=bool)
    out[y : y + h, x : x + w] = True
    return out


def nearest_pixels(distance: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` pixels of least ``distance`` (ties in raster order): a level set of it, so a
    mask of exactly that area whose shape follows the distance's."""
    order = np.argsort(distance, axis=None, kind="stable")
    out = np.zeros(distance.size, dtype=bool)
    out[order[:count]] = True
    return out.reshape(distance.shape)


def ellipse_union_mask(
    height: int, width: int, count: int, ellipses: list[tuple[float, float, float, float, float]]
) -> np.ndarray:
    """The ``count`` pixels nearest a union of rotated ellipses ``(cy, cx, ry, rx, angle)``, each
    in its own normalised distance."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    distance = np.full((height, width), np.inf)
    for cy, cx, ry, rx, theta in ellipses:
        dy, dx = yy - cy, xx - cx
        u = (dx * np.cos(theta) + dy * np.sin(theta)) / rx
        v = (-dx * np.sin(theta) + dy * np.cos(theta)) / ry
        distance = np.minimum(distance, np.hypot(u, v))
    return nearest_pixels(distance, count)


def _stroke_mask(height: int, width: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """The ``count`` pixels nearest a random polyline of 2-4 segments (a brush's path): a stroke
    of even width and exact area."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    points = rng.uniform(0.1, 0.9, size=(int(rng.integers(3, 6)), 2)) * (height, width)
    distance = np.full((height, width), np.inf)
    for (y0, x0), (y1, x1) in zip(points[:-1], points[1:]):
        dy, dx = y1 - y0, x1 - x0
        along = np.clip(((yy - y0) * dy + (xx - x0) * dx) / max(dy * dy + dx * dx, 1e-9), 0, 1)
        distance = np.minimum(distance, np.hypot(yy - y0 - along * dy, xx - x0 - along * dx))
    return nearest_pixels(distance, count)


def _blob_mask(height: int, width: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """The ``count`` pixels closest to a union of 1-4 random rotated ellipses: blob-like rather
    than a prefix of the raster order."""
    side = min(height, width)
    ellipses = []
    for _ in range(int(rng.integers(1, 5))):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(0.1, 0.35, size=2) * side
        ellipses.append((cy, cx, ry, rx, rng.uniform(0, np.pi)))
    return ellipse_union_mask(height, width, count, ellipses)


def synthetic_mask(
    height: int, width: int, ratio: float, seed: int, kind: str = "blob"
) -> np.ndarray:
    """Realistic bool (H, W) mask covering about ``ratio`` of the image, for benchmarks.

    ``blob``: union of random ellipses, area exact to one pixel; ``stroke``: a brush stroke (a thick
    random polyline), area exact to one pixel; ``rect``: a rectangle, area within ~0.5 % for images
    of a few dozen pixels a side. Deterministic in ``seed``; ratio 0 gives no pixel, ratio 1 every
    pixel.
    """
    if height < 1 or width < 1:
        raise ValueError(f"mask size must be positive, got {height}x{width}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    if kind not in MASK_KINDS:
        raise ValueError(f"kind must be one of {', '.join(MASK_KINDS)}, got {kind!r}")
    count = round(ratio * height * width)
    if count == 0:
        return np.zeros((height, width), dtype=bool)
    if count == height * width:
        return np.ones((height, width), dtype=bool)
    rng = np.random.default_rng(seed)
    if kind == "rect":
        return _rect_mask(height, width, ratio * height * width, rng)
    if kind == "stroke":
        return _stroke_mask(height, width, count, rng)
    return _blob_mask(height, width, count, rng)

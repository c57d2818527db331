"""Pixel masks and token masks.

Mask contract (IOPaint / A1111): a grayscale image the size of the picture, 255 = repaint,
0 = keep. RGBA masks carry the painted area in their alpha channel; "1", "L", "RGB" and other
modes are read as luminance. Internally a pixel mask is a bool (H, W) array, True = repaint, and
a token mask is a bool (gh, gw) array over a model's token grid, True = computed fresh.

Neighbourhoods are squares (Chebyshev distance) everywhere: ``grow``/``shrink`` by ``px`` pixels,
``token_mask`` margins by tokens, and ``feather``'s blur support, so the three agree exactly.
"""

from __future__ import annotations

import math

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


def _max_filter_1d(mask: np.ndarray, radius: int, axis: int) -> np.ndarray:
    """OR over a window of 2 * radius + 1 along ``axis``, outside the array counting as False.
    Prefix sums make it O(H * W) for any radius."""
    pad = [(0, 0), (0, 0)]
    pad[axis] = (radius + 1, radius)
    counts = np.cumsum(np.pad(mask, pad).astype(np.int32), axis=axis)
    size = mask.shape[axis]
    hi = np.take(counts, np.arange(2 * radius + 1, 2 * radius + 1 + size), axis=axis)
    lo = np.take(counts, np.arange(size), axis=axis)
    return (hi - lo) > 0


def grow(mask: np.ndarray, px: int) -> np.ndarray:
    """Dilate by a (2 px + 1) square: True wherever a True pixel is within Chebyshev distance px."""
    mask = _as_bool_2d(mask)
    if px < 0:
        raise ValueError(f"grow needs px >= 0, got {px}")
    if px == 0 or not mask.any():
        return mask.copy()
    return _max_filter_1d(_max_filter_1d(mask, px, 0), px, 1)


def shrink(mask: np.ndarray, px: int) -> np.ndarray:
    """Erode by a (2 px + 1) square. Outside the image counts as masked, so a mask touching the
    border is not eaten from the border (a full mask stays full)."""
    return ~grow(~_as_bool_2d(mask), px)


def _gaussian_kernel(radius: int, sigma: float) -> np.ndarray:
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    kernel = np.exp(-0.5 * (x / sigma) ** 2)
    return kernel / kernel.sum()


def _blur_1d(values: np.ndarray, kernel: np.ndarray, axis: int) -> np.ndarray:
    radius = len(kernel) // 2
    pad = [(0, 0)] * values.ndim
    pad[axis] = (radius, radius)
    padded = np.pad(values, pad, mode="edge")
    out = np.zeros_like(values, dtype=np.float64)
    size = values.shape[axis]
    for offset, weight in enumerate(kernel):
        out += weight * np.take(padded, np.arange(offset, offset + size), axis=axis)
    return out


def feather(mask: np.ndarray, px: float) -> np.ndarray:
    """Soft float32 alpha in [0, 1]: a Gaussian blur (sigma = px / 3, support radius ceil(px)).

    Invariants: alpha == 1 exactly where the whole (2r + 1) square is masked, == 0 exactly where
    none of it is, so pixels farther than r from the mask edge paste back bit-exactly.
    """
    mask = _as_bool_2d(mask)
    if px < 0 or not math.isfinite(px):
        raise ValueError(f"feather needs a finite px >= 0, got {px}")
    radius = math.ceil(px)
    if radius == 0:
        return mask.astype(np.float32)
    kernel = _gaussian_kernel(radius, max(px / 3.0, 1e-3))
    alpha = _blur_1d(_blur_1d(mask.astype(np.float64), kernel, 0), kernel, 1)
    alpha = np.clip(alpha, 0.0, 1.0).astype(np.float32)
    # the blur's sum of weights is 1 only up to rounding; pin the plateaus exactly
    alpha[shrink(mask, radius)] = 1.0
    alpha[~grow(mask, radius)] = 0.0
    return alpha


def token_mask(mask: np.ndarray, grid_hw: tuple[int, int], margin: int = 0) -> np.ndarray:
    """Bool (gh, gw): a token is masked if ANY pixel under it is, then grown by ``margin`` tokens
    (Chebyshev). Needs H % gh == 0 and W % gw == 0 (each token covers a whole pixel block)."""
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
    return grow(tokens, margin)


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


def _blob_mask(height: int, width: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """The ``count`` pixels closest to a union of 1-4 random rotated ellipses (in each ellipse's
    own normalised distance): a level set of that union, so the area is exact and the shape is
    blob-like rather than a prefix of the raster order."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    score = np.full((height, width), -np.inf)
    side = min(height, width)
    for _ in range(int(rng.integers(1, 5))):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(0.1, 0.35, size=2) * side
        theta = rng.uniform(0, np.pi)
        dy, dx = yy - cy, xx - cx
        u = (dx * np.cos(theta) + dy * np.sin(theta)) / rx
        v = (-dx * np.sin(theta) + dy * np.cos(theta)) / ry
        score = np.maximum(score, -np.hypot(u, v))
    order = np.argsort(-score, axis=None, kind="stable")
    out = np.zeros(height * width, dtype=bool)
    out[order[:count]] = True
    return out.reshape(height, width)


def synthetic_mask(
    height: int, width: int, ratio: float, seed: int, kind: str = "blob"
) -> np.ndarray:
    """Realistic bool (H, W) mask covering about ``ratio`` of the image, for benchmarks.

    ``blob``: union of random ellipses, area exact to one pixel; ``rect``: a rectangle, area within
    ~0.5 % for images of a few dozen pixels a side. Deterministic in ``seed``; ratio 0 gives no
    pixel, ratio 1 every pixel.
    """
    if height < 1 or width < 1:
        raise ValueError(f"mask size must be positive, got {height}x{width}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    if kind not in ("blob", "rect"):
        raise ValueError(f"kind must be 'blob' or 'rect', got {kind!r}")
    count = round(ratio * height * width)
    if count == 0:
        return np.zeros((height, width), dtype=bool)
    if count == height * width:
        return np.ones((height, width), dtype=bool)
    rng = np.random.default_rng(seed)
    if kind == "rect":
        return _rect_mask(height, width, ratio * height * width, rng)
    return _blob_mask(height, width, count, rng)

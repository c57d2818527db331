"""Image quality metrics: SSIM and PSNR, optionally restricted to a mask.

Inputs are uint8 arrays/images (scaled by 1/255) or floats already in [0, 1]; both arguments
must have the same shape, (H, W) or (H, W, C). Data range is 1.

Masked metrics look only inside the mask: PSNR averages the squared error over masked pixels;
SSIM's local statistics use Gaussian weights restricted to masked pixels and renormalised
(normalised convolution), so pixels outside the mask cannot change the result at all. Without a
mask the same definition runs with an all-true mask: windows are truncated and renormalised at
the image border instead of padding with invented pixels.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

WINDOW = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03  # Wang et al. 2004 constants (data range 1)


def _as_float(img: np.ndarray | Image.Image, name: str) -> np.ndarray:
    arr = np.asarray(img)
    if arr.dtype == np.uint8:
        return arr.astype(np.float64) / 255.0
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name} must be uint8 or float in [0, 1], got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if arr.size and not (np.all(np.isfinite(arr)) and arr.min() >= 0.0 and arr.max() <= 1.0):
        raise ValueError(
            f"{name} is float but not in [0, 1]: scale 0-255 images to [0, 1] or pass uint8"
        )
    return arr


def _prepare(a, b, mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float (H, W, C) images and a bool (H, W) mask, validated."""
    x, y = _as_float(a, "a"), _as_float(b, "b")
    if x.shape != y.shape:
        raise ValueError(f"images differ in shape: {x.shape} vs {y.shape}")
    if x.ndim == 2:
        x, y = x[..., None], y[..., None]
    if x.ndim != 3 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"images must be (H, W) or (H, W, C), got {x.shape}")
    m = np.ones(x.shape[:2], dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    if m.shape != x.shape[:2]:
        raise ValueError(f"mask shape {m.shape} does not match image shape {x.shape[:2]}")
    if not m.any():
        raise ValueError("mask is empty: a masked metric needs at least one masked pixel")
    return x, y, m


def _gaussian_filter(values: np.ndarray) -> np.ndarray:
    """Separable 11-tap Gaussian over the first two axes, zero outside the image."""
    radius = WINDOW // 2
    t = np.arange(-radius, radius + 1, dtype=np.float64)
    kernel = np.exp(-0.5 * (t / SIGMA) ** 2)
    kernel /= kernel.sum()
    out = values
    for axis in (0, 1):
        pad = [(0, 0)] * out.ndim
        pad[axis] = (radius, radius)
        padded = np.pad(out, pad)
        size = out.shape[axis]
        acc = np.zeros_like(out)
        for offset, weight in enumerate(kernel):
            acc += weight * np.take(padded, np.arange(offset, offset + size), axis=axis)
        out = acc
    return out


def ssim(
    a: np.ndarray | Image.Image, b: np.ndarray | Image.Image, mask: np.ndarray | None = None
) -> float:
    """Mean SSIM (Gaussian window 11, sigma 1.5, K1 0.01, K2 0.03), channels averaged.

    With ``mask`` the SSIM map is computed from masked pixels only and averaged over them.
    Invariant: identical images give exactly 1.0.
    """
    x, y, m = _prepare(a, b, mask)
    w = m.astype(np.float64)[..., None]
    # zero the outside before filtering: weight 0 times any value is 0, so it cannot leak in
    x, y = np.where(w > 0, x, 0.0), np.where(w > 0, y, 0.0)
    norm = _gaussian_filter(w)
    norm = np.where(norm > 0, norm, 1.0)  # only masked pixels are read, and there norm > 0

    def local_mean(v: np.ndarray) -> np.ndarray:
        return _gaussian_filter(w * v) / norm

    mu_x, mu_y = local_mean(x), local_mean(y)
    var_x = local_mean(x * x) - mu_x * mu_x
    var_y = local_mean(y * y) - mu_y * mu_y
    cov = local_mean(x * y) - mu_x * mu_y
    c1, c2 = K1**2, K2**2
    num = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    den = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    ssim_map = (num / den).mean(axis=2)
    return float(ssim_map[m].mean())


def psnr(
    a: np.ndarray | Image.Image, b: np.ndarray | Image.Image, mask: np.ndarray | None = None
) -> float:
    """Peak signal-to-noise ratio in dB (data range 1) over all channels of the (masked) pixels;
    ``inf`` when they are identical."""
    x, y, m = _prepare(a, b, mask)
    mse = float(np.mean((x[m] - y[m]) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)

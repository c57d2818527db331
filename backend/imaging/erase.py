"""Erase: remove what is under the mask by filling it from its surroundings, with no diffusion
model (OpenCV's classical inpainting, Telea's fast marching method; IOPaint's "cv2" model).

An erase job is finished by CPU pre-processing itself (``backend.tasks.core.erase_job``): no
engine worker, no post-processing, a result in milliseconds to a second.

Invariants: the result has the template's size and mode RGB; every pixel where the feathered
alpha is 0 (outside ``masks.feather_support``, the processed mask itself when feather is 0) is
the template's own pixel, bit for bit; inside, pixels come from the surroundings only (a
painted-over object leaves no trace).
"""

from __future__ import annotations

import cv2
import numpy as np
from PIL import Image

from backend.imaging import masks
from backend.imaging.masks import MaskError

# how far around each filled pixel Telea's method looks for known pixels (IOPaint's default is 4)
ERASE_RADIUS_PX = 5


def require_erasable(mask: np.ndarray) -> None:
    """MaskError when nothing is left to fill from: the whole image is under the mask."""
    if np.asarray(mask).all():
        raise MaskError(
            "erase fills the painted area from the pixels around it, but the whole image is "
            "painted (after the mask ops, the feather's reach included): leave some of it "
            "unpainted, or use mode generate"
        )


def erase(template: Image.Image, mask: np.ndarray, feather_px: float = 0.0) -> Image.Image:
    """``template`` (RGB) with the area under ``mask`` (bool (H, W), True = erase, the processed
    mask at the template's own resolution) filled by ``cv2.inpaint(..., cv2.INPAINT_TELEA)``,
    pasted back with ``masks.feather(mask, feather_px)`` like a generated result."""
    rgb = template.convert("RGB")
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (rgb.height, rgb.width):
        raise MaskError(
            f"mask of {mask.shape[1]}x{mask.shape[0]} pixels does not match the image's "
            f"{rgb.width}x{rgb.height}"
        )
    masks.require_nonempty(mask)
    # fill every pixel paste-back takes from the filled image (the feather's reach too)
    area = masks.feather_support(mask, feather_px)
    require_erasable(area)
    filled = cv2.inpaint(np.asarray(rgb), area.astype(np.uint8), ERASE_RADIUS_PX, cv2.INPAINT_TELEA)
    alpha = masks.feather(mask, feather_px)
    return masks.paste_back(Image.fromarray(filled, mode="RGB"), rgb, alpha)

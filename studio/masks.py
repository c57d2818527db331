"""The mask a user painted in ``gr.ImageEditor``, and the previews shown while they paint.

The editor's value is ``{"background", "layers", "composite"}``. The mask is the union of the
ALPHA of the layers (anything painted, whatever its colour), never a diff of the composite against
the template: a brush colour may equal the image's pixels, and a diff would then see nothing.
The eraser lowers a layer's alpha, so erased strokes drop out of the mask on their own.

Sizes are checked, not trusted: a canvas whose layers are not the template's size (the editor has
downscaled large images silently in some versions) is scaled back to the template's size when the
aspect ratio agrees (any painted canvas pixel marks every template pixel under it, so thin strokes
survive), and refused with a message otherwise.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from backend.imaging import masks
from backend.imaging.masks import MaskError
from backend.protocol import MaskOps

ASPECT_TOLERANCE = 0.02  # relative: rounding when an editor scales a canvas
LAYER_RGB = (255, 48, 48)  # a recalled or uploaded mask shows in the brush's first colour
OVERLAY_RGB = (255, 0, 200)  # magenta: rare in photographs, unlike the brush's red
OVERLAY_OPACITY = 0.35
OUTSIDE_BRIGHTNESS = 0.35  # the kept area is dimmed and greyed, so the repainted one stands out
OUTLINE_RGB = (255, 255, 255)


def _as_image(value) -> Image.Image | None:
    if value is None:
        return None
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, np.ndarray):
        return Image.fromarray(value)
    if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__"):
        return Image.open(io.BytesIO(value) if isinstance(value, bytes) else value)
    raise MaskError(
        f"the editor sent a layer of an unexpected kind ({type(value).__name__}): reload the page"
    )


def mask_layer(mask: np.ndarray) -> Image.Image:
    """A bool (H, W) mask as an editor layer: the brush's colour where True, transparent
    elsewhere (``painted_mask`` reads it back as the same mask)."""
    layer = np.zeros((*mask.shape, 4), dtype=np.uint8)
    layer[mask] = (*LAYER_RGB, 255)
    return Image.fromarray(layer, mode="RGBA")


def _alpha(layer: Image.Image) -> np.ndarray:
    """Painted = alpha > 0; a layer without alpha is painted wherever it is not black."""
    if "A" in layer.getbands():
        return np.asarray(layer.getchannel("A")) > 0
    return np.asarray(layer.convert("L")) > 0


def to_size(painted: np.ndarray, size_wh: tuple[int, int]) -> np.ndarray:
    height, width = painted.shape
    tw, th = size_wh
    if (width, height) == (tw, th):
        return painted
    if abs(width / height - tw / th) > ASPECT_TOLERANCE * (tw / th):
        raise MaskError(
            f"the canvas is {width}x{height} but the template is {tw}x{th} (another shape): "
            "pick the template again and repaint"
        )
    image = Image.fromarray(painted.astype(np.uint8) * 255, mode="L")
    # BOX when shrinking (any painted pixel under a template pixel counts), NEAREST when enlarging
    resample = Image.Resampling.BOX if width > tw else Image.Resampling.NEAREST
    return np.asarray(image.resize((tw, th), resample)) > 0


def painted_mask(editor_value, size_wh: tuple[int, int]) -> np.ndarray:
    """Bool (H, W) mask at the template's ``size_wh`` (width, height): True where any layer is
    painted. An empty painting is returned as is (``require_painted`` refuses it)."""
    if not editor_value:
        raise MaskError("no canvas: pick a template in the gallery first")
    layers = [
        image for image in map(_as_image, editor_value.get("layers") or []) if image is not None
    ]
    tw, th = size_wh
    union = np.zeros((th, tw), dtype=bool)
    for layer in layers:
        union |= to_size(_alpha(layer), size_wh)
    return union


def require_painted(mask: np.ndarray) -> None:
    if not mask.any():
        raise MaskError("nothing is painted: paint over the area to change with the brush")


def mask_png(mask: np.ndarray) -> bytes:
    """The mask contract: grayscale PNG, 255 = repaint, 0 = keep."""
    buf = io.BytesIO()
    Image.fromarray(mask.astype(np.uint8) * 255, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def effective_mask(mask: np.ndarray, ops: MaskOps) -> np.ndarray:
    """Float (H, W) in [0, 1]: what paste-back will take from the generated image after the mask
    ops (``masks.effective_alpha``: the function pre- and post-processing use, in their order)."""
    return masks.effective_alpha(mask, ops)


def mask_ratio(weights: np.ndarray) -> float:
    """Share of the image that will be repainted (feathered edges count by their weight)."""
    return float(weights.mean()) if weights.size else 0.0


def overlay(template: Image.Image, weights: np.ndarray) -> Image.Image:
    """The template with the repainted area tinted and outlined, and the kept area dimmed to
    grey: readable on colourful images, where a tint alone gets lost."""
    base = np.asarray(template.convert("RGB"), dtype=np.float32)
    grey = base.mean(axis=2, keepdims=True) * OUTSIDE_BRIGHTNESS
    tint = np.asarray(OVERLAY_RGB, dtype=np.float32)
    inside = base * (1 - OVERLAY_OPACITY) + tint * OVERLAY_OPACITY
    weight = weights.astype(np.float32)[..., None]
    shown = inside * weight + grey * (1 - weight)
    shown[_outline(weights > 0.5)] = OUTLINE_RGB
    return Image.fromarray(np.clip(shown + 0.5, 0, 255).astype(np.uint8), mode="RGB")


def _outline(mask: np.ndarray) -> np.ndarray:
    """The mask's pixels with a 4-neighbour outside it (the image border counts as inside)."""
    padded = np.pad(mask, 1, mode="edge")
    interior = padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    return mask & ~interior

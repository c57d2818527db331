"""Deterministic sample templates (no files needed): photo-like images with smooth gradients,
soft shapes and texture, so edits and quality metrics have structure to work on."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def sample_template(width: int, height: int, seed: int = 0) -> Image.Image:
    """A reproducible RGB template of the given size; the same (size, seed) gives the same bytes."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            120 + 80 * np.sin(xs / width * np.pi * rng.uniform(0.5, 2.0) + rng.uniform(0, 6)),
            110 + 70 * np.cos(ys / height * np.pi * rng.uniform(0.5, 2.0) + rng.uniform(0, 6)),
            100 + 60 * np.sin((xs + ys) / (width + height) * np.pi * rng.uniform(1, 3)),
        ],
        axis=-1,
    )
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        radius = rng.uniform(0.05, 0.2) * min(width, height)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(radius=max(1, min(width, height) // 128)))
    noise = rng.normal(0, 4, (height, width, 3))
    return Image.fromarray(
        np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    )

"""Inpainting examples from the scenes: an image, a mask of the kind users paint, and the caption of
what lies under it.

One object of the scene is the target. The mask covers all of it, in one of the shapes people
paint in the studio: the object's own outline grown by a few pixels, a padded box, a loose ellipse
around it, or brush strokes scribbled over it. The caption is the target's ("a small red circle"),
so a model learns to paint under the mask what the prompt names, and the background around it.

Invariants: ``make_example(seed, split, size)`` is a pure function of its arguments (its own random
stream, apart from the scene's); the mask covers every visible pixel of the target object; the mask
never covers the whole image.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from backend.imaging.masks import grow
from backend.training.scenes import SPLITS, SUPERSAMPLE, Scene, SceneObject, make_scene

MASK_KINDS = ("outline", "box", "ellipse", "strokes")
EXAMPLE_STREAM = 2  # the examples' random stream, apart from the scenes' (0 and 1)


@dataclass(frozen=True)
class Example:
    scene: Scene = field(repr=False)
    target: SceneObject = field(repr=False)
    mask: np.ndarray = field(repr=False)  # bool (H, W), True = repaint
    mask_kind: str

    @property
    def image(self) -> Image.Image:
        return self.scene.image

    @property
    def caption(self) -> str:
        """What lies under the mask."""
        return self.target.caption


def make_example(seed: int, split: str = "train", size: int = 128) -> Example:
    """The example of ``seed`` in ``split`` (module invariants)."""
    scene = make_scene(seed, split, size)
    rng = np.random.default_rng([seed, SPLITS[split], EXAMPLE_STREAM])
    target = scene.objects[int(rng.integers(len(scene.objects)))]
    kind = str(rng.choice(MASK_KINDS))
    painted = _PAINTERS[kind](target, size, rng)
    mask = painted | grow(target.mask, 1)  # whatever was painted, the whole object is under it
    if mask.all():  # a huge object: keep a frame of the scene to paint around
        mask[:2, :] = mask[-2:, :] = mask[:, :2] = mask[:, -2:] = False
    return Example(scene=scene, target=target, mask=mask, mask_kind=kind)


def _outline(target: SceneObject, size: int, rng: np.random.Generator) -> np.ndarray:
    return grow(target.mask, int(rng.integers(2, 9)))


def _box(target: SceneObject, size: int, rng: np.random.Generator) -> np.ndarray:
    ys, xs = np.nonzero(target.mask)
    pad = int(rng.integers(2, 10))
    out = np.zeros((size, size), dtype=bool)
    out[
        max(0, ys.min() - pad) : ys.max() + pad + 1, max(0, xs.min() - pad) : xs.max() + pad + 1
    ] = True
    return out


def _ellipse(target: SceneObject, size: int, rng: np.random.Generator) -> np.ndarray:
    cx, cy = target.centre
    rx, ry = target.radius * rng.uniform(1.1, 1.5, size=2)
    yy, xx = np.mgrid[0:size, 0:size]
    return ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1.0


def _strokes(target: SceneObject, size: int, rng: np.random.Generator) -> np.ndarray:
    """A brush scribbled back and forth over the object, as a hand paints it."""
    big = size * SUPERSAMPLE
    canvas = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(canvas)
    cx, cy, r = (v * SUPERSAMPLE for v in (*target.centre, target.radius))
    width = max(2, int(r * rng.uniform(0.35, 0.6)))
    points = [
        (cx + r * rng.uniform(-1.1, 1.1), cy + r * rng.uniform(-1.1, 1.1))
        for _ in range(int(rng.integers(4, 9)))
    ]
    draw.line(points, fill=255, width=width, joint="curve")
    for x, y in points:  # round brush ends
        draw.ellipse([x - width / 2, y - width / 2, x + width / 2, y + width / 2], fill=255)
    return np.asarray(canvas.resize((size, size), Image.BOX)) >= 128


_PAINTERS = {"outline": _outline, "box": _box, "ellipse": _ellipse, "strokes": _strokes}

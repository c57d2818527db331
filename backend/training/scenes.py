"""Captioned scenes for training and judging the demo inpainting model: numpy and PIL only.

A scene is a background (solid, gradient, stripes, checkers or a noise texture) with one to three
objects (circle, square, triangle, star, ring, blob) drawn over it, each a named colour, size and
fill (solid or striped), and captions made with it: the whole scene's ("a small red circle and a
large blue striped square on a yellow background") and each object's ("a small red circle"), the
caption of what lies under a mask covering that object.

Invariants:
* ``make_scene(seed, split, size)`` is a pure function of its arguments: the same arguments give
  the same pixels and captions on every machine (numpy's PCG64 seeded with ``[seed, split id]``,
  PIL drawing at a fixed supersampling);
* the splits draw from disjoint random streams, so a held-out scene is never a training scene;
* each object's ``mask`` is the pixels where it is visible in the final image (objects drawn later
  cover earlier ones), and its colour dominates those pixels: a caption never names a colour that
  is not there;
* every colour is chosen distinct from its background's, so an object always stands out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

SPLITS = {"train": 0, "heldout": 1}
# (name, RGB): hues far enough apart that a dominant-hue check tells them apart
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 140, 20),
    "yellow": (240, 220, 30),
    "green": (40, 170, 60),
    "cyan": (40, 200, 210),
    "blue": (35, 70, 210),
    "purple": (140, 50, 190),
    "pink": (240, 120, 190),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "star", "ring", "blob")
SIZES = {"small": 0.12, "medium": 0.2, "large": 0.3}  # radius as a share of the scene's side
FILLS = ("solid", "striped")
BACKGROUNDS = ("solid", "gradient", "stripes", "checkers", "noise")
SUPERSAMPLE = 2  # shapes are drawn at twice the size and reduced: smooth edges


@dataclass(frozen=True)
class SceneObject:
    """One object as drawn: what its caption says, and where it is visible (``mask``)."""

    shape: str
    colour: str
    size: str
    fill: str
    centre: tuple[float, float]  # (x, y) in pixels
    radius: float
    mask: np.ndarray = field(repr=False, compare=False)  # bool (H, W): visible pixels

    @property
    def caption(self) -> str:
        fill = " striped" if self.fill == "striped" else ""
        return f"a {self.size} {self.colour}{fill} {self.shape}"


@dataclass(frozen=True)
class Scene:
    seed: int
    split: str
    image: Image.Image = field(repr=False, compare=False)
    background: str
    background_colour: str
    objects: tuple[SceneObject, ...]

    @property
    def caption(self) -> str:
        """The whole scene: its objects, then its background."""
        things = " and ".join(obj.caption for obj in self.objects)
        kind = "" if self.background == "solid" else f" {self.background}"
        article = "an" if self.background_colour[0] in "aeiou" else "a"
        return f"{things} on {article} {self.background_colour}{kind} background"


def make_scene(seed: int, split: str = "train", size: int = 128) -> Scene:
    """The scene of ``seed`` in ``split`` at ``size`` x ``size`` pixels (module invariants)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    if size < 32:
        raise ValueError(f"scenes are at least 32 px on a side, got {size}")
    rng = np.random.default_rng([seed, SPLITS[split]])
    background_colour = str(rng.choice(list(COLOURS)))
    background = str(rng.choice(BACKGROUNDS))
    pixels = _background(background, COLOURS[background_colour], size, rng)
    drawn: list[tuple[dict, np.ndarray]] = []
    for _ in range(int(rng.integers(1, 4))):
        spec = _object_spec(rng, size, exclude=background_colour)
        shape_mask = _shape_mask(spec, size, rng)
        pixels[shape_mask] = _fill(spec, size)[shape_mask]
        for _earlier, mask in drawn:
            mask &= ~shape_mask  # covered by the new object
        drawn.append((spec, shape_mask))
    # an object mostly hidden behind later ones is not captioned; the last one drawn is never
    # covered, so a scene always has at least one
    objects = tuple(
        SceneObject(mask=mask, **spec) for spec, mask in drawn if mask.sum() >= _min_visible(spec)
    )
    return Scene(
        seed=seed,
        split=split,
        image=Image.fromarray(pixels),
        background=background,
        background_colour=background_colour,
        objects=objects,
    )


def _min_visible(spec: dict) -> float:
    """Pixels an object must show to be captioned: a quarter of the smallest shape of its
    radius (a ring, about 0.7 x pi r^2), so that what a caption names is there to see."""
    return 0.25 * 0.7 * float(np.pi * spec["radius"] ** 2)


def _object_spec(rng: np.random.Generator, size: int, exclude: str) -> dict:
    colour = str(rng.choice([name for name in COLOURS if name != exclude]))
    size_name = str(rng.choice(list(SIZES)))
    radius = SIZES[size_name] * size * float(rng.uniform(0.85, 1.15))
    margin = radius * 0.8
    centre = (float(rng.uniform(margin, size - margin)), float(rng.uniform(margin, size - margin)))
    return {
        "shape": str(rng.choice(SHAPES)),
        "colour": colour,
        "size": size_name,
        "fill": str(rng.choice(FILLS, p=[0.75, 0.25])),
        "centre": centre,
        "radius": radius,
    }


def _background(kind: str, rgb: tuple[int, int, int], size: int, rng: np.random.Generator):
    """(size, size, 3) uint8 pixels of a background whose dominant colour is ``rgb``."""
    base = np.array(rgb, dtype=np.float32)
    shade = base * 0.7 + 0.3 * (255.0 if base.mean() < 128 else 0.0)  # same hue, other value
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    if kind == "solid":
        weight = np.zeros((size, size), np.float32)
    elif kind == "gradient":
        angle = float(rng.uniform(0, 2 * np.pi))
        ramp = np.cos(angle) * xx + np.sin(angle) * yy
        weight = (ramp - ramp.min()) / max(float(np.ptp(ramp)), 1e-6) * 0.8
    elif kind == "stripes":
        period = float(rng.uniform(0.08, 0.2))
        weight = ((xx + yy * float(rng.uniform(-1, 1))) / period % 1.0 < 0.35).astype(np.float32)
    elif kind == "checkers":
        cell = float(rng.uniform(0.1, 0.25))
        weight = ((np.floor(xx / cell) + np.floor(yy / cell)) % 2 == 1).astype(np.float32) * 0.8
    else:  # noise: a smooth texture, low-frequency noise upsampled
        coarse = rng.random((8, 8)).astype(np.float32)
        weight = np.asarray(
            Image.fromarray((coarse * 255).astype(np.uint8)).resize((size, size), Image.BICUBIC),
            dtype=np.float32,
        )
        weight = weight / 255.0 * 0.7
    pixels = base * (1 - weight[..., None]) + shade * weight[..., None]
    return np.clip(pixels, 0, 255).astype(np.uint8)


def _fill(spec: dict, size: int) -> np.ndarray:
    """The object's colour over the whole scene (stripes of a lighter shade when striped)."""
    rgb = np.array(COLOURS[spec["colour"]], dtype=np.float32)
    pixels = np.broadcast_to(rgb, (size, size, 3)).copy()
    if spec["fill"] == "striped":
        yy, xx = np.mgrid[0:size, 0:size]
        period = max(4, int(spec["radius"] / 2))
        stripes = (xx + yy) % period < period // 3
        lighter = rgb * 0.6 + (255.0 if rgb.mean() < 128 else 100.0) * 0.4
        pixels[stripes] = lighter
    return pixels.astype(np.uint8)


def _shape_mask(spec: dict, size: int, rng: np.random.Generator) -> np.ndarray:
    """Bool (size, size) pixels of the shape, drawn supersampled and reduced."""
    big = size * SUPERSAMPLE
    canvas = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(canvas)
    cx, cy = (c * SUPERSAMPLE for c in spec["centre"])
    r = spec["radius"] * SUPERSAMPLE
    shape = spec["shape"]
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    elif shape == "square":
        half = r * 0.85
        draw.rectangle([cx - half, cy - half, cx + half, cy + half], fill=255)
    elif shape == "triangle":
        draw.polygon(_polygon(cx, cy, r, 3, -np.pi / 2), fill=255)
    elif shape == "star":
        draw.polygon(_star(cx, cy, r), fill=255)
    elif shape == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
        inner = r * 0.55
        draw.ellipse([cx - inner, cy - inner, cx + inner, cy + inner], fill=0)
    else:  # blob: a polygon of jittered radii
        angles = np.linspace(0, 2 * np.pi, 12, endpoint=False)
        radii = r * rng.uniform(0.7, 1.1, size=12)
        points = [(cx + rad * np.cos(a), cy + rad * np.sin(a)) for a, rad in zip(angles, radii)]
        draw.polygon(points, fill=255)
    reduced = canvas.resize((size, size), Image.BOX)
    return np.asarray(reduced) >= 128


def _polygon(cx: float, cy: float, r: float, sides: int, start: float) -> list[tuple]:
    angles = start + np.arange(sides) * 2 * np.pi / sides
    return [(cx + r * np.cos(a), cy + r * np.sin(a)) for a in angles]


def _star(cx: float, cy: float, r: float) -> list[tuple]:
    angles = -np.pi / 2 + np.arange(10) * np.pi / 5
    radii = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
    return [(cx + rad * np.cos(a), cy + rad * np.sin(a)) for a, rad in zip(angles, radii)]


def palette_votes(image: Image.Image, mask: np.ndarray) -> np.ndarray:
    """Index into ``COLOURS`` of the named colour nearest to each pixel selected by ``mask``."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)[mask]
    palette = np.array(list(COLOURS.values()), dtype=np.float32)
    return np.argmin(((pixels[:, None, :] - palette[None]) ** 2).sum(-1), axis=1)


def dominant_colour(image: Image.Image, mask: np.ndarray) -> str:
    """The named colour nearest to most of the masked pixels (each pixel votes for its nearest
    palette colour)."""
    votes = palette_votes(image, mask)
    if votes.size == 0:
        raise ValueError("the mask selects no pixel")
    return list(COLOURS)[int(np.bincount(votes, minlength=len(COLOURS)).argmax())]

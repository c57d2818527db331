"""Does an edit paint what its prompt names? Colour checks over the masked area (numpy only).

The prompt of a judged edit names a colour and a shape ("a small green star") for a masked area.
The model may paint background around the object inside the mask, so the check ignores pixels
in the colours that surround the mask:

* **surrounding colours**: the named colours of at least ``SURROUND_SHARE`` of the pixels in a
  band just outside the mask (a gradient's darker shade votes for a neighbouring name, so this
  is a set, not one colour);
* **colour agreement**: among masked pixels not in a surrounding colour, the prompt's colour is
  the most common, and those pixels are at least ``MIN_PAINTED_SHARE`` of the mask (an edit that
  paints only background disagrees);
* **prompt share**: the share of masked pixels in the prompt's colour; an edit is *closer to the
  prompt* than its template when its share is higher.

Prompts are drawn so their colour is neither a surrounding colour nor the colour that was there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from backend.imaging.masks import grow
from backend.training.scenes import COLOURS, SHAPES, palette_votes

SURROUND_BAND_PX = 6
SURROUND_SHARE = 0.1
MIN_PAINTED_SHARE = 0.1
PROMPT_STREAM = 3  # the prompts' random stream, apart from the scenes' and examples'


@dataclass(frozen=True)
class Judgement:
    agrees: bool  # the painted colour is the prompt's
    painted_colour: str | None  # most common non-surrounding colour in the mask (None: none)
    painted_share: float  # share of the mask in non-surrounding colours
    prompt_share: float  # share of the mask in the prompt's colour


def surrounding_colours(image: Image.Image, mask: np.ndarray) -> set[str]:
    """Named colours of at least ``SURROUND_SHARE`` of a band of pixels just outside ``mask``."""
    band = grow(mask, SURROUND_BAND_PX) & ~mask
    if not band.any():  # the mask covers (nearly) everything: no surroundings to discount
        return set()
    counts = np.bincount(palette_votes(image, band), minlength=len(COLOURS)) / band.sum()
    return {name for name, share in zip(COLOURS, counts) if share >= SURROUND_SHARE}


def judge(image: Image.Image, mask: np.ndarray, colour: str, surroundings: set[str]) -> Judgement:
    """How ``image`` answers a prompt of ``colour`` inside ``mask`` (module doc)."""
    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}: use one of {', '.join(COLOURS)}")
    votes = palette_votes(image, mask)
    if votes.size == 0:
        raise ValueError("the mask selects no pixel")
    names = list(COLOURS)
    ignored = np.isin(votes, [names.index(name) for name in surroundings])
    painted = votes[~ignored]
    painted_share = painted.size / votes.size
    painted_colour = (
        names[int(np.bincount(painted, minlength=len(names)).argmax())] if painted.size else None
    )
    return Judgement(
        agrees=painted_share >= MIN_PAINTED_SHARE and painted_colour == colour,
        painted_colour=painted_colour,
        painted_share=float(painted_share),
        prompt_share=float(np.mean(votes == names.index(colour))),
    )


def edit_prompt(seed: int, size_name: str, excluded: set[str]) -> tuple[str, str]:
    """(prompt, colour) of judged edit ``seed``: an object of ``size_name`` in a colour not in
    ``excluded`` (the surroundings, and what was there) and a shape, from its own stream."""
    rng = np.random.default_rng([seed, PROMPT_STREAM])
    colour = str(rng.choice([name for name in COLOURS if name not in excluded]))
    shape = str(rng.choice(SHAPES))
    return f"a {size_name} {colour} {shape}", colour

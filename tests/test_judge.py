"""The colour judge of demo edits: it agrees with what is painted in the mask, and only that."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from backend.training.examples import make_example
from backend.training.judge import edit_prompt, judge, surrounding_colours
from backend.training.scenes import COLOURS


def _painted(image: Image.Image, mask: np.ndarray, colour: str) -> Image.Image:
    pixels = np.asarray(image.convert("RGB")).copy()
    pixels[mask] = COLOURS[colour]
    return Image.fromarray(pixels)


def test_a_template_agrees_with_the_colour_of_the_object_under_its_mask():
    agreed = 0
    for seed in range(60):
        example = make_example(seed, "heldout")
        around = surrounding_colours(example.image, example.mask) - {example.target.colour}
        agreed += judge(example.image, example.mask, example.target.colour, around).agrees
    assert agreed >= 57  # a few targets are mostly hidden behind others


def test_the_prompted_colour_is_new_and_a_template_never_agrees_with_it():
    for seed in range(60):
        example = make_example(seed, "heldout")
        around = surrounding_colours(example.image, example.mask)
        excluded = around | {example.target.colour}
        prompt, colour = edit_prompt(seed, example.target.size, excluded)
        assert colour not in excluded and prompt.startswith(f"a {example.target.size} {colour} ")
        assert not judge(example.image, example.mask, colour, around).agrees


def test_painting_the_mask_in_the_prompted_colour_agrees_and_background_does_not():
    example = make_example(3, "heldout")
    around = surrounding_colours(example.image, example.mask)
    _, colour = edit_prompt(3, "small", around | {example.target.colour})
    verdict = judge(_painted(example.image, example.mask, colour), example.mask, colour, around)
    assert verdict.agrees and verdict.prompt_share == 1.0 and verdict.painted_share == 1.0
    background = sorted(around)[0]
    erased = judge(_painted(example.image, example.mask, background), example.mask, colour, around)
    assert not erased.agrees and erased.painted_colour is None and erased.prompt_share == 0.0


def test_a_few_prompted_pixels_in_painted_background_do_not_agree():
    mask = np.zeros((64, 64), dtype=bool)
    mask[16:48, 16:48] = True
    image = _painted(Image.new("RGB", (64, 64), COLOURS["blue"]), mask, "blue")
    speck = np.zeros_like(mask)
    speck[30:32, 30:32] = True  # 4 of 1024 masked pixels
    verdict = judge(_painted(image, speck, "red"), mask, "red", {"blue"})
    assert not verdict.agrees and verdict.painted_colour == "red"
    assert verdict.painted_share < 0.1


def test_bad_arguments_are_refused_with_what_to_fix():
    image = Image.new("RGB", (8, 8))
    with pytest.raises(ValueError, match="unknown colour 'mauve'"):
        judge(image, np.ones((8, 8), bool), "mauve", set())
    with pytest.raises(ValueError, match="selects no pixel"):
        judge(image, np.zeros((8, 8), bool), "red", set())

"""The captioned scenes the demo model learns from: deterministic, split apart, captions true to
the pixels."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from backend.training.scenes import COLOURS, SHAPES, dominant_colour, make_scene


def digest(scene) -> str:
    return hashlib.sha256(np.asarray(scene.image).tobytes()).hexdigest()


@pytest.mark.parametrize("size", [64, 128, 256])
def test_the_same_seed_and_split_give_the_same_scene(size):
    first, again = make_scene(7, "train", size), make_scene(7, "train", size)
    assert digest(first) == digest(again) and first.caption == again.caption
    assert first.image.size == (size, size) and first.image.mode == "RGB"


def test_the_held_out_split_shares_no_scene_with_training():
    train = {digest(make_scene(seed, "train")) for seed in range(200)}
    heldout = {digest(make_scene(seed, "heldout")) for seed in range(200)}
    assert len(train) == 200 and len(heldout) == 200 and not train & heldout


def test_every_caption_names_a_colour_its_object_shows():
    for seed in range(120):
        scene = make_scene(seed, "heldout")
        for obj in scene.objects:
            assert obj.mask.any() and obj.colour != scene.background_colour
            assert dominant_colour(scene.image, obj.mask) == obj.colour, (seed, obj.caption)
            assert obj.caption in scene.caption and obj.shape in SHAPES


def test_objects_masks_are_where_they_are_visible():
    for seed in range(60):
        scene = make_scene(seed)
        masks = [obj.mask for obj in scene.objects]
        for i, first in enumerate(masks):  # later objects cover earlier ones: no pixel twice
            for second in masks[i + 1 :]:
                assert not (first & second).any()
        last = scene.objects[-1]  # the last object drawn is whole: its pixels are its colour
        rgb = np.asarray(scene.image)[last.mask]
        if last.fill == "solid":
            assert (np.abs(rgb.astype(int) - COLOURS[last.colour]).max(axis=1) <= 0).mean() > 0.9


def test_captions_read_as_english():
    scene = next(
        make_scene(seed) for seed in range(100) if make_scene(seed).background_colour == "orange"
    )
    assert " on an orange " in scene.caption
    assert make_scene(3).caption.startswith("a ")


def test_the_generator_covers_its_vocabulary():
    scenes = [make_scene(seed) for seed in range(300)]
    assert {o.shape for s in scenes for o in s.objects} == set(SHAPES)
    assert {s.background for s in scenes} == {"solid", "gradient", "stripes", "checkers", "noise"}
    assert {o.fill for s in scenes for o in s.objects} == {"solid", "striped"}
    assert {o.size for s in scenes for o in s.objects} == {"small", "medium", "large"}
    assert {len(s.objects) for s in scenes} == {1, 2, 3}  # one to three captioned objects


def test_bad_arguments_say_what_to_fix():
    with pytest.raises(ValueError, match="unknown split 'test'"):
        make_scene(0, "test")
    with pytest.raises(ValueError, match="at least 32 px"):
        make_scene(0, size=16)
    with pytest.raises(ValueError, match="selects no pixel"):
        dominant_colour(make_scene(0).image, np.zeros((128, 128), bool))

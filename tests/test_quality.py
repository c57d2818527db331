"""SSIM and PSNR: identity, monotonicity in noise, and masks that only look inside."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from backend.imaging.quality import psnr, ssim


def base_image(shape=(48, 48, 3)) -> np.ndarray:
    """Smooth float image in [0.2, 0.8] so added noise never clips."""
    yy, xx = np.mgrid[0 : shape[0], 0 : shape[1]] / shape[0]
    gray = 0.5 + 0.3 * np.sin(6 * xx) * np.cos(4 * yy)
    return np.repeat(gray[..., None], shape[2], axis=2) if len(shape) == 3 else gray


def test_identical_images_are_perfect():
    img = base_image()
    assert ssim(img, img) == 1.0 and psnr(img, img) == math.inf
    u8 = (img * 255).astype(np.uint8)
    assert ssim(u8, u8) == 1.0 and psnr(Image.fromarray(u8), Image.fromarray(u8)) == math.inf


def test_more_noise_scores_lower():
    img = base_image()
    noise = np.random.default_rng(0).normal(0, 1, img.shape)
    levels = [0.01, 0.03, 0.08, 0.15]
    ssims = [ssim(img, np.clip(img + s * noise, 0, 1)) for s in levels]
    psnrs = [psnr(img, np.clip(img + s * noise, 0, 1)) for s in levels]
    assert all(a > b for a, b in zip(ssims, ssims[1:])) and ssims[0] < 1.0
    assert all(a > b for a, b in zip(psnrs, psnrs[1:]))


def test_psnr_matches_its_definition_on_uint8():
    a = np.full((8, 8), 100, np.uint8)
    b = a.copy()
    b[0, 0] = 110
    mse = (10 / 255) ** 2 / 64
    assert psnr(a, b) == pytest.approx(10 * math.log10(1 / mse))


def test_masked_metrics_ignore_differences_outside_the_mask():
    img = base_image((48, 48))
    mask = np.zeros((48, 48), bool)
    mask[10:30, 12:36] = True
    inside = np.clip(img + 0.05 * np.random.default_rng(1).normal(0, 1, img.shape) * mask, 0, 1)
    scrambled = inside.copy()
    scrambled[~mask] = np.random.default_rng(2).uniform(0, 1, (~mask).sum())
    assert ssim(img, inside, mask) == ssim(img, scrambled, mask)
    assert psnr(img, inside, mask) == psnr(img, scrambled, mask)
    assert ssim(img, inside, mask) < 1.0 and ssim(img, scrambled) < ssim(img, inside)
    only_outside = img.copy()
    only_outside[~mask] = 0.0
    assert ssim(img, only_outside, mask) == 1.0 and psnr(img, only_outside, mask) == math.inf


def test_full_mask_equals_no_mask():
    img = base_image()
    noisy = np.clip(img + 0.05 * np.random.default_rng(3).normal(0, 1, img.shape), 0, 1)
    full = np.ones(img.shape[:2], bool)
    assert ssim(img, noisy, full) == pytest.approx(ssim(img, noisy), abs=1e-12)
    assert psnr(img, noisy, full) == psnr(img, noisy)


@pytest.mark.parametrize(
    "a,b,mask,match",
    [
        (np.zeros((4, 4)), np.zeros((4, 5)), None, "shape"),
        (np.full((4, 4), 2.0), np.zeros((4, 4)), None, r"\[0, 1\]"),
        (np.zeros((4, 4)), np.zeros((4, 4)), np.zeros((4, 4), bool), "empty"),
        (np.zeros((4, 4)), np.zeros((4, 4)), np.ones((3, 3), bool), "mask shape"),
    ],
)
def test_invalid_inputs_are_rejected(a, b, mask, match):
    with pytest.raises(ValueError, match=match):
        ssim(a, b, mask)

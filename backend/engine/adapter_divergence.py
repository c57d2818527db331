"""How early an adapter must join a row: the step at which it starts to matter (after Katz).

Katz observed that an adapter changes a diffusion trajectory only gradually: latents with and
without it stay nearly parallel for the first steps, so an adapter that is not on the device yet
may join a running row a few steps late at little cost. ``divergence`` runs the same edit with and
without the adapters, the two rows side by side in one batch (a row without adapters gets exactly
the base computation), and after every step takes the cosine similarity of their latents over the
tokens the edit computes (its mask's fresh tokens). ``first_below`` is the first step (0-based:
step 0 is the first denoising step) after which that similarity falls below the threshold (0.99
as Katz used), or None when it never does: the latest step at which the adapter can join
without visibly changing the trajectory it would have had from the start is about there.

Invariant: the two rows share template, mask, prompt, seed, params and cache, so they differ only
by the adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.lora import RowAdapters

KATZ_THRESHOLD = 0.99


@dataclass(frozen=True)
class Divergence:
    cosines: tuple[float, ...]  # after each step, with vs without the adapters
    threshold: float
    step: int | None  # first_below(cosines, threshold)


def first_below(cosines: Sequence[float], threshold: float = KATZ_THRESHOLD) -> int | None:
    """Index of the first similarity below ``threshold``; None when there is none."""
    return next((step for step, value in enumerate(cosines) if value < threshold), None)


def _cosine(a: torch.Tensor, b: torch.Tensor, fresh: torch.Tensor) -> float:
    keep = fresh.expand_as(a)
    x, y = a[keep].double(), b[keep].double()
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


@torch.no_grad()
def divergence(
    engine: MaskAwareEngine,
    image: Image.Image,
    mask: Image.Image,
    prompt: str,
    seed: int,
    params: EditParams,
    adapters: RowAdapters,
    threshold: float = KATZ_THRESHOLD,
) -> Divergence:
    """Step the edit with and without ``adapters`` (resident) and compare them after each step.
    The rows read the template's cache when ``params.use_cache`` and one exists, else run dense
    (the caller picks; a full mask with ``use_cache=False`` compares whole images)."""
    if not adapters:
        raise ValueError("divergence needs at least one adapter to compare against the base model")
    cache = engine.lookup(image, params) if params.use_cache else None
    pixels = engine.pixel_mask(image, mask, params)
    plain, adapted = (
        engine.start(image, mask, prompt, seed, params, cache=cache, pixels=pixels, adapters=rows)
        for rows in ((), tuple(adapters))
    )
    cosines = []
    while not plain.done:
        engine.step([plain, adapted], params.mode)
        cosines.append(_cosine(plain.latents, adapted.latents, plain.fresh))
    return Divergence(tuple(cosines), threshold, first_below(cosines, threshold))

"""Stage 3: the inpainting denoiser, trained on noised example latents.

The objective is Stable Diffusion 2's (v or epsilon prediction, ``recipe.prediction``, on the
family's own noise schedule), with Min-SNR-gamma weighting and an exponential moving average of
the weights (the average is what ships). Captions are dropped to the empty prompt at
``caption_dropout`` so classifier-free guidance has its unconditional branch. The frozen text
encoder is run once per distinct caption. Latents are flipped left-right at random (the captions
do not say left or right).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from backend.training.latents import LatentSet
from backend.training.loop import Stage
from backend.training.parts import caption_embeddings
from backend.training.recipe import Recipe


class CaptionTable:
    """Each distinct caption's text states once; row 0 is the empty prompt."""

    def __init__(self, pipe, captions: list[str]):
        self.names = [""] + sorted(set(captions) - {""})
        index = {name: row for row, name in enumerate(self.names)}
        self.rows = torch.tensor([index[caption] for caption in captions])
        self.states = caption_embeddings(pipe, self.names)


def ema_update(average: torch.nn.Module, model: torch.nn.Module, step: int, decay: float) -> None:
    """Move ``average`` toward ``model``; early steps use a smaller decay so the average is
    not dominated by the random initial weights."""
    rate = min(decay, (1 + step) / (10 + step))
    with torch.no_grad():
        for kept, current in zip(average.parameters(), model.parameters()):
            kept.lerp_(current, 1.0 - rate)


def _batch(data: LatentSet, table: CaptionTable, recipe: Recipe, generator: torch.Generator):
    picks = torch.randint(len(data), (recipe.unet_batch,), generator=generator)
    flips = torch.rand(recipe.unet_batch, generator=generator) < 0.5
    dropped = torch.rand(recipe.unet_batch, generator=generator) < recipe.caption_dropout

    def flipped(values: torch.Tensor) -> torch.Tensor:
        chosen = values[picks]
        return torch.where(flips[:, None, None, None], chosen.flip(-1), chosen)

    rows = torch.where(dropped, 0, table.rows[picks])
    return flipped(data.latents), flipped(data.masks), flipped(data.masked), table.states[rows]


def _target(recipe: Recipe, latents, noise, alpha) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the denoiser should output, per-row loss weight) at noise level ``alpha`` (the
    rows' cumulative alphas). Weights are Min-SNR-gamma; for v the weight keeps at least the
    image-space weight 1 at low SNR (plain v-MSE's), where the epsilon form gives almost 0."""
    snr = alpha / (1 - alpha)
    clamped = torch.clamp(snr, max=recipe.min_snr_gamma)
    if recipe.prediction == "epsilon":
        return noise, clamped / snr
    scale = alpha.sqrt().view(-1, 1, 1, 1)
    velocity = scale * noise - (1 - scale**2).sqrt() * latents
    return velocity, (clamped + 1) / (snr + 1)


def denoiser_stage(
    unet, average, data: LatentSet, table: CaptionTable, alphas_cumprod, recipe: Recipe
) -> Stage:
    unet.train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=recipe.unet_lr, weight_decay=0.01)
    steps_total = len(alphas_cumprod)

    def step(index: int, generator: torch.Generator) -> float:
        latents, masks, masked, states = _batch(data, table, recipe, generator)
        noise = torch.randn(latents.shape, generator=generator)
        timesteps = torch.randint(steps_total, (len(latents),), generator=generator)
        alpha = alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        noisy = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise
        predicted = unet(torch.cat([noisy, masks, masked], 1), timesteps, states).sample
        target, weights = _target(recipe, latents, noise, alphas_cumprod[timesteps])
        per_row = F.mse_loss(predicted, target, reduction="none").mean(dim=(1, 2, 3))
        loss = (weights * per_row).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        ema_update(average, unet, index, recipe.ema_decay)
        return float(per_row.detach().mean())

    return Stage(
        name="unet",
        steps=recipe.unet_steps,
        lr=recipe.unet_lr,
        warmup_steps=recipe.warmup_steps,
        optimizer=optimizer,
        modules={"unet": unet, "ema": average},
        step_fn=step,
        fingerprint=recipe.fingerprint(),
    )


def averaged_copy(unet: torch.nn.Module) -> torch.nn.Module:
    """The EMA holder: a frozen copy of ``unet``."""
    average = copy.deepcopy(unet).eval()
    average.requires_grad_(False)
    return average

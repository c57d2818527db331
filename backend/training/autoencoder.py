"""Stage 1: the autoencoder, trained to reconstruct random crops of generated scenes.

A randomly initialised VAE decoder does not invert its encoder, so the denoiser could learn
nothing a user would see. Crops are smaller than the scenes (the VAE is fully convolutional and
its cost grows with pixels); the scaling factor is then set so the latents have unit variance,
as Stable Diffusion's is.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from backend.training.loop import Stage
from backend.training.recipe import AUTOENCODER_FIELDS, Recipe
from backend.training.scenes import make_scene

SCENE_SEED_BASE = 10_000_000  # the autoencoder's scenes: train split, apart from the examples'


def scene_pool(recipe: Recipe, count: int, progress: bool = True) -> torch.Tensor:
    """(count, 3, size, size) uint8 pixels of training scenes."""
    images = [
        np.asarray(make_scene(SCENE_SEED_BASE + index, "train", recipe.size).image)
        for index in tqdm(range(count), desc="scenes", unit="scene", disable=not progress)
    ]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] -> float [-1, 1] (the pipeline's image range)."""
    return pixels.float() / 127.5 - 1.0


def _crops(pool: torch.Tensor, recipe: Recipe, generator: torch.Generator) -> torch.Tensor:
    picks = torch.randint(len(pool), (recipe.vae_batch,), generator=generator)
    room = recipe.size - recipe.vae_crop + 1
    offsets = torch.randint(room, (recipe.vae_batch, 2), generator=generator)
    flips = torch.rand(recipe.vae_batch, generator=generator) < 0.5
    crops = []
    for pick, (top, left), flip in zip(picks, offsets, flips):
        crop = pool[pick, :, top : top + recipe.vae_crop, left : left + recipe.vae_crop]
        crops.append(crop.flip(-1) if flip else crop)
    return to_unit_range(torch.stack(crops))


def autoencoder_stage(vae, pool: torch.Tensor, recipe: Recipe) -> Stage:
    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=recipe.vae_lr, weight_decay=0.0)

    def step(_step: int, generator: torch.Generator) -> float:
        pixels = _crops(pool, recipe, generator)
        posterior = vae.encode(pixels).latent_dist
        rebuilt = vae.decode(posterior.sample(generator)).sample
        reconstruction = F.l1_loss(rebuilt, pixels) + F.mse_loss(rebuilt, pixels)
        loss = reconstruction + recipe.vae_kl_weight * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        return float(reconstruction.detach())

    return Stage(
        name="vae",
        steps=recipe.vae_steps,
        lr=recipe.vae_lr,
        warmup_steps=min(50, recipe.vae_steps),
        optimizer=optimizer,
        modules={"vae": vae},
        step_fn=step,
        fingerprint=recipe.fingerprint(*AUTOENCODER_FIELDS),
    )


@torch.no_grad()
def set_scaling_factor(vae, pool: torch.Tensor) -> float:
    """Scale latents to unit standard deviation over (up to) 256 scenes of ``pool``."""
    vae.eval()
    means = [vae.encode(to_unit_range(chunk)).latent_dist.mean for chunk in pool[:256].split(32)]
    factor = float(1.0 / torch.cat(means).std())
    vae.register_to_config(scaling_factor=factor)
    return factor

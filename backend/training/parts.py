"""The demo pipeline's parts, built from a recipe with fixed seeds, and the pipeline around them.

Training goes through the diffusers pipeline's own helpers (prompt encoding, image and mask
pre-processing, masked-image latents), so what the denoiser learns from is exactly what it is
given when serving.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, StableDiffusionInpaintPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

from backend.models.builders import _seeded, build_scheduler
from backend.models.tokenizers import build_clip_tokenizer
from backend.training.recipe import FAMILY, Recipe


def build_parts(recipe: Recipe) -> dict:
    """Untrained components of the recipe (each from seed 0; the text encoder stays so)."""
    configs = recipe.configs()
    return dict(
        vae=_seeded(AutoencoderKL, **configs["vae"]),
        unet=_seeded(UNet2DConditionModel, **configs["unet"]),
        text_encoder=_seeded(CLIPTextModel, CLIPTextConfig(**configs["text_encoder"])),
        tokenizer=build_clip_tokenizer(),
        scheduler=build_scheduler(FAMILY, prediction_type=recipe.prediction),
    )


def as_pipeline(parts: dict) -> StableDiffusionInpaintPipeline:
    """The serving pipeline over ``parts`` (shared, not copied)."""
    pipe = StableDiffusionInpaintPipeline(
        **parts, safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def caption_embeddings(pipe: StableDiffusionInpaintPipeline, captions: list[str]) -> torch.Tensor:
    """(len(captions), tokens, width) text-encoder states of each caption, as the pipeline
    encodes a prompt (``""`` is the unconditional prompt of classifier-free guidance)."""
    states = [pipe.encode_prompt(caption, torch.device("cpu"), 1, False)[0] for caption in captions]
    return torch.cat(states)

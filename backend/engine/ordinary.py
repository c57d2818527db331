"""The ordinary diffusers pipeline call that MaskServe is measured and tested against."""

from __future__ import annotations

import torch
from PIL import Image

from backend.engine.editor import EditParams
from backend.engine.families import ADAPTERS, DENOISER, TEXT_ENCODERS, VAE, require_parts


def run_ordinary(
    pipe,
    spec,
    image: Image.Image,
    mask: Image.Image,
    prompt: str,
    seed: int,
    params: EditParams,
    output_type: str = "pil",
):
    """Run ``pipe`` exactly as a user of diffusers would for this edit; returns an image or
    latents. ``pipe`` must hold every part of the model (``MissingComponentError`` otherwise)."""
    require_parts(
        pipe,
        ADAPTERS[spec.family].denoiser_name,
        "the ordinary pipeline",
        DENOISER,
        TEXT_ENCODERS,
        VAE,
    )
    kwargs = {"negative_prompt": params.negative_prompt} if spec.uses_cfg else {}
    if spec.max_sequence_length:
        kwargs["max_sequence_length"] = spec.max_sequence_length
    height, width = params.size
    result = pipe(
        prompt=prompt,
        image=image,
        mask_image=mask,
        height=height,
        width=width,
        num_inference_steps=params.steps,
        guidance_scale=params.guidance,
        strength=params.strength,
        generator=torch.Generator().manual_seed(seed),
        output_type=output_type,
        **kwargs,
    )
    return result.images if output_type == "latent" else result.images[0]

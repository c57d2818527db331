"""The ordinary diffusers pipeline call that MaskServe is measured and tested against.

``run_ordinary_batch`` is one pipeline call over several edits that share what one call shares
(model, size, steps, strength, guidance), as a user batching requests would write it: lists of
prompts, negative prompts, images and masks, and one ``torch.Generator`` per row. Invariant: a
row's noise comes from its own generator only, so each row equals a one-row call with its seed (up
to the order of sums in a batched matmul); ``run_ordinary`` is that one-row call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from PIL import Image

from backend.engine.editor import EditParams
from backend.engine.families import ADAPTERS, DENOISER, TEXT_ENCODERS, VAE, require_parts

# callback_on_step_end(pipe, step index, timestep, tensors) -> tensors (diffusers' signature)
StepCallback = Callable[[object, int, object, dict], dict]


def run_ordinary_batch(
    pipe,
    spec,
    images: Sequence[Image.Image],
    masks: Sequence[Image.Image],
    prompts: Sequence[str],
    seeds: Sequence[int],
    params: EditParams,
    output_type: str = "pil",
    callback: StepCallback | None = None,
    negative_prompts: Sequence[str] | None = None,
) -> list[Image.Image] | torch.Tensor:
    """Run ``pipe`` once over the rows (``images[i]``, ``masks[i]``, ``prompts[i]``,
    ``seeds[i]``), exactly as a user of diffusers would; returns one image per row, or for
    ``output_type="latent"`` the final latents (one row per edit, in the engine's own latent
    format). ``negative_prompts``: one per row (default ``params.negative_prompt`` for every row).
    ``callback``: diffusers' ``callback_on_step_end``. ``pipe`` must hold every part of the model
    (``MissingComponentError`` otherwise)."""
    rows = len(images)
    negative_prompts = negative_prompts or [params.negative_prompt] * rows
    if not rows or not len(masks) == len(prompts) == len(seeds) == len(negative_prompts) == rows:
        raise ValueError(
            f"a batch needs as many masks, prompts, negative prompts and seeds as images (at "
            f"least one), got {rows} images, {len(masks)} masks, {len(prompts)} prompts, "
            f"{len(negative_prompts)} negative prompts, {len(seeds)} seeds"
        )
    require_parts(
        pipe,
        ADAPTERS[spec.family].denoiser_name,
        "the ordinary pipeline",
        DENOISER,
        TEXT_ENCODERS,
        VAE,
    )
    kwargs = {"negative_prompt": list(negative_prompts)} if spec.uses_cfg else {}
    if spec.max_sequence_length:
        kwargs["max_sequence_length"] = spec.max_sequence_length
    if callback is not None:
        kwargs["callback_on_step_end"] = callback
    height, width = params.size
    result = pipe(
        prompt=list(prompts),
        image=list(images),
        mask_image=list(masks),
        height=height,
        width=width,
        num_inference_steps=params.steps,
        guidance_scale=params.guidance,
        strength=params.strength,
        generator=[torch.Generator().manual_seed(seed) for seed in seeds],
        output_type=output_type,
        **kwargs,
    )
    return result.images


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
    """One edit through ``run_ordinary_batch``: an image, or latents of one row for
    ``output_type="latent"``."""
    images = run_ordinary_batch(pipe, spec, [image], [mask], [prompt], [seed], params, output_type)
    return images if output_type == "latent" else images[0]

"""Build pipelines of the built forms from ``configs.CONFIGS`` with fixed seeds (no downloads)."""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
)

from backend.models.configs import CONFIGS, SCHEDULERS
from backend.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer


def _seeded(factory, *args, **kwargs):
    # Every component from seed 0 (building twice gives identical weights), leaving the caller's RNG
    # alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return factory(*args, **kwargs).eval()


def build_scheduler(family: str, **overrides):
    """The family's scheduler (``configs.SCHEDULERS``, with ``overrides`` of its config); Euler
    steps add no noise, so an edit is a function of its inputs and seed."""
    kind = FlowMatchEulerDiscreteScheduler if family == "flux-fill" else EulerDiscreteScheduler
    # schedulers keep CPU tensors, even inside `with torch.device("meta")`
    with torch.device("cpu"):
        return kind(**{**SCHEDULERS[family], **overrides})


def build_components(family: str, form: str) -> dict:
    """Pipeline components of a built form; under ``with torch.device("meta")`` no weights are
    allocated."""
    configs = CONFIGS[(family, form)]
    parts = {
        "vae": _seeded(AutoencoderKL, **configs["vae"]),
        "text_encoder": _seeded(CLIPTextModel, CLIPTextConfig(**configs["text_encoder"])),
        "tokenizer": build_clip_tokenizer(),
    }
    if family == "flux-fill":
        parts.update(
            transformer=_seeded(FluxTransformer2DModel, **configs["transformer"]),
            text_encoder_2=_seeded(T5EncoderModel, T5Config(**configs["text_encoder_2"])),
            tokenizer_2=build_t5_tokenizer(),
            scheduler=build_scheduler(family),
        )
        return parts
    parts.update(
        unet=_seeded(UNet2DConditionModel, **configs["unet"]), scheduler=build_scheduler(family)
    )
    if family == "sdxl-inpaint":
        parts.update(
            text_encoder_2=_seeded(
                CLIPTextModelWithProjection, CLIPTextConfig(**configs["text_encoder_2"])
            ),
            tokenizer_2=build_clip_tokenizer(),
        )
    return parts


def build_pipeline(spec):
    """A diffusers pipeline of a built form (tiny, small or arch), weights from seed 0."""
    from backend.models.registry import pipeline_class

    parts = build_components(spec.family, spec.form)
    if spec.family == "sd2-inpaint":
        parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    elif spec.family == "sdxl-inpaint":
        parts.update(requires_aesthetics_score=False)
    pipe = pipeline_class(spec.family)(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe

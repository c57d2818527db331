"""Synthetic LoRA adapters for benchmarks and tests: random PEFT adapters on a model's denoiser.

``peft_adapter`` injects a ``LoraConfig`` with ``init_lora_weights=False`` (``lora_A`` and
``lora_B`` both random, so the adapter changes the output) into a copy of the denoiser and returns
its PEFT state dict and config (what a diffusers pipeline loads through ``load_lora_weights``) and
the same weights as the engine's ``LoraAdapter``. ``calibrated_adapter`` picks alpha so that the
adapter's strength is a chosen *relative delta*: the mean over its layers of
``||scale * B @ A||_F / ||W||_F`` (``relative_delta``), which makes adapters of different ranks and
models comparable. Random weights at alpha = rank are far too strong (a relative delta near 1 or
above turns images into noise); trained LoRAs change a layer by a few percent.

Invariants: the same (denoiser, seed, rank, alpha, targets) give the same weights, and the global
random state is left as it was; the ``LoraAdapter`` and the PEFT state dict hold the same tensors,
with the pair scale PEFT computes (alpha / rank).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict

from backend.engine.lora import LoraAdapter, LoraPair


@dataclass(frozen=True)
class SyntheticLora:
    state: dict[str, torch.Tensor]  # PEFT keys: <module>.lora_A.weight / <module>.lora_B.weight
    config: LoraConfig
    adapter: LoraAdapter


def peft_adapter(
    denoiser: torch.nn.Module,
    adapter_id: str,
    seed: int,
    rank: int,
    alpha: float,
    targets: Sequence[str],
) -> SyntheticLora:
    """A LoRA of ``rank`` on the ``targets`` modules of ``denoiser`` (left untouched: PEFT goes
    into a copy) with random A and B drawn from ``seed``."""
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = inject_adapter_in_model(config, copy.deepcopy(denoiser), adapter_name=adapter_id)
    state = get_peft_model_state_dict(model, adapter_name=adapter_id)
    pairs = {
        key.split(".lora_A.")[0]: LoraPair(
            value, state[key.replace(".lora_A.", ".lora_B.")], alpha / rank
        )
        for key, value in state.items()
        if ".lora_A." in key
    }
    return SyntheticLora(state, config, LoraAdapter(adapter_id, pairs))


@torch.no_grad()
def relative_delta(adapter: LoraAdapter, layers: Mapping[str, torch.nn.Linear]) -> float:
    """Mean over the adapter's pairs of ``||scale * up @ down||_F / ||W||_F`` (``layers``: the
    updated modules by name)."""
    ratios = [
        float(torch.linalg.matrix_norm(pair.scale * pair.up.float() @ pair.down.float()))
        / float(torch.linalg.matrix_norm(layers[name].weight.float()))
        for name, pair in adapter.pairs.items()
    ]
    return sum(ratios) / len(ratios)


def calibrated_adapter(
    denoiser: torch.nn.Module,
    layers: Mapping[str, torch.nn.Linear],
    adapter_id: str,
    seed: int,
    rank: int,
    strength: float,
) -> SyntheticLora:
    """``peft_adapter`` on every layer of ``layers`` with alpha chosen so that its
    ``relative_delta`` is ``strength`` (the delta is linear in alpha)."""
    targets = sorted(layers)
    unit = peft_adapter(denoiser, adapter_id, seed, rank, float(rank), targets)
    alpha = rank * strength / relative_delta(unit.adapter, layers)
    return peft_adapter(denoiser, adapter_id, seed, rank, alpha, targets)


def load_into_pipeline(pipe, denoiser_name: str, made: SyntheticLora, folder: Path) -> None:
    """Write ``made`` the way diffusers' training scripts do (the pipeline class's
    ``save_lora_weights``, the ``LoraConfig`` as adapter metadata) into ``folder`` and load it into
    ``pipe`` through ``load_lora_weights`` under its adapter id (PEFT layers)."""
    prefix = "transformer" if denoiser_name == "transformer" else "unet"
    type(pipe).save_lora_weights(
        folder,
        **{
            f"{prefix}_lora_layers": made.state,
            f"{prefix}_lora_adapter_metadata": made.config.to_dict(),
        },
    )
    pipe.load_lora_weights(folder, adapter_name=made.adapter.adapter_id)

"""Tiny LoRA adapter files for tests, made with PEFT on the tiny models' denoisers (fixed seeds).

``make_adapter_file(model_id, path, ...)`` injects a ``LoraConfig`` (``init_lora_weights=False``:
``lora_B`` is random too, so the adapter changes the output) into the model's denoiser built from
its config with seed 0, and writes the adapter as a user would have it:

* ``layout="peft"``: the pipeline class's ``save_lora_weights`` (the diffusers layout, with the
  ``LoraConfig`` as its adapter metadata, like ``diffusers`` training scripts write it);
* ``layout="kohya"`` (SD2 and SDXL): ``lora_unet_<module with _>.lora_down.weight`` /
  ``.lora_up.weight`` / ``.alpha`` keys, what kohya's sd-scripts write (diffusers converts them).

``peft_pairs(...)`` gives the same adapter's weights as PEFT holds them,
``{module: (A, B, scale)}``, for tests that compare a read adapter against PEFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from backend.engine.lora import lora_targets
from backend.models import resolve_model
from backend.models.builders import build_components
from backend.models.registry import pipeline_class

DENOISER = {"sd2-inpaint": "unet", "sdxl-inpaint": "unet", "flux-fill": "transformer"}
KIND = {"sd2-inpaint": "unet", "sdxl-inpaint": "unet", "flux-fill": "flux"}


@cache
def _target_names(family: str) -> tuple[str, ...]:
    with torch.device("meta"):
        denoiser = build_components(family, "tiny")[DENOISER[family]]
    return tuple(lora_targets(denoiser, KIND[family]))


def default_targets(model_id: str) -> tuple[str, ...]:
    """Every layer adapters may update in the model's denoiser (module names)."""
    return _target_names(resolve_model(model_id).family)


def _adapted_denoiser(
    model_id: str, seed: int, rank: int, alpha: float | None, targets: Sequence[str] | None
):
    spec = resolve_model(model_id)
    denoiser = build_components(spec.family, spec.form)[DENOISER[spec.family]]
    config = LoraConfig(
        r=rank,
        lora_alpha=rank if alpha is None else alpha,
        target_modules=list(targets or default_targets(model_id)),
        init_lora_weights=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, denoiser, adapter_name="default")
    return spec, denoiser, config


def peft_pairs(
    model_id: str,
    seed: int = 0,
    rank: int = 4,
    alpha: float | None = None,
    targets: Sequence[str] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{module: (lora_A weight, lora_B weight, PEFT's scaling)}`` of the adapter
    ``make_adapter_file`` writes with the same arguments."""
    _spec, denoiser, _config = _adapted_denoiser(model_id, seed, rank, alpha, targets)
    return {
        name: (
            module.lora_A["default"].weight.detach().clone(),
            module.lora_B["default"].weight.detach().clone(),
            float(module.scaling["default"]),
        )
        for name, module in denoiser.named_modules()
        if isinstance(module, LoraLayer)
    }


def make_adapter_file(
    model_id: str,
    path: Path | str,
    seed: int = 0,
    rank: int = 4,
    alpha: float | None = None,
    targets: Sequence[str] | None = None,
    layout: str = "peft",
) -> Path:
    """Write a tiny adapter for ``model_id``'s denoiser to ``path`` (``.safetensors``); returns
    ``path``. ``alpha`` None: alpha = rank (scale 1); ``targets`` None: every targetable layer."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    spec, denoiser, config = _adapted_denoiser(model_id, seed, rank, alpha, targets)
    state = get_peft_model_state_dict(denoiser, adapter_name="default")
    if layout == "kohya":
        if spec.family == "flux-fill":
            raise ValueError("the kohya writer here covers SD2 and SDXL only")
        save_file(kohya_state_dict(state, config), str(path))
        return path
    if layout != "peft":
        raise ValueError(f"layout must be peft or kohya, got {layout!r}")
    prefix = DENOISER[spec.family]
    pipeline_class(spec.family).save_lora_weights(
        str(path.parent),
        weight_name=path.name,
        **{f"{prefix}_lora_layers": state, f"{prefix}_lora_adapter_metadata": config.to_dict()},
    )
    return path


def kohya_state_dict(state: dict[str, torch.Tensor], config: LoraConfig) -> dict[str, torch.Tensor]:
    """PEFT's ``<module>.lora_A.weight`` / ``lora_B`` keys as kohya names them, with each module's
    alpha (``config.lora_alpha``) as a scalar tensor."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module, _, kind = key.rpartition(".lora_")
        stem = "lora_unet_" + module.replace(".", "_")
        out[f"{stem}.{'lora_down' if kind.startswith('A') else 'lora_up'}.weight"] = tensor
        out[f"{stem}.alpha"] = torch.tensor(float(config.lora_alpha))
    return {key: value.contiguous() for key, value in out.items()}

"""The device tier's budget of an engine worker's template caches, measured once at start-up,
after the model is loaded: what the device has free then (``torch.cuda.mem_get_info``), less a
full batch's activations (estimated from the model's cost profile, when one ships for it) and a
margin; ``backend.cache.budgets.choose_device_budget`` decides from those numbers."""

from __future__ import annotations

import logging

import torch

from backend.cache.budgets import TierBudget, batch_activation_bytes, choose_device_budget
from backend.config import Settings
from backend.costmodel.profiles import device_kind, load_profile
from backend.dispatch.views import default_rows_per_request

log = logging.getLogger(__name__)

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def device_cache_budget(settings: Settings) -> TierBudget:
    """``settings.cache.device_budget_mb`` when set; else, on CUDA, the automatic budget; else
    (the CPU) none."""
    configured = settings.cache.device_budget_mb
    device = torch.device(settings.engine.device)
    share = settings.cache.device_margin_share
    if configured is not None or device.type != "cuda":
        return choose_device_budget(
            None if configured is None else configured << 20, None, 0, 0, share
        )
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return choose_device_budget(None, free_bytes, total_bytes, full_batch_bytes(settings), share)


def full_batch_bytes(settings: Settings) -> int:
    """A full batch's activations (``batch_activation_bytes``) of the worker's model; 0 without a
    cost profile of it (the margin alone then stands for them, and a step that runs out of memory
    makes the tier give memory back)."""
    engine = settings.engine
    try:
        profile = load_profile(
            settings.paths.profiles_dir,
            engine.model_id,
            device_kind(engine.device),
            engine.cache_mode,
        )
    except (OSError, ValueError) as exc:
        log.info("no cost profile to size a batch's activations (%s): the margin stands", exc)
        return 0
    return batch_activation_bytes(
        profile.units,
        settings.worker.max_batch,
        default_rows_per_request(engine.model_id),
        ELEMENT_BYTES[engine.dtype],
    )

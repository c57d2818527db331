"""Build an engine and its edit parameters from the settings tree (shared by CLI, worker and CPU workers)."""

from __future__ import annotations

import torch

from backend.config import Settings
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.profiler import load_planners
from backend.models import ModelSpec, load_pipeline, resolve_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_engine(
    settings: Settings, model_id: str | None = None, device: str | None = None
) -> MaskAwareEngine:
    """Load the model (built offline on first use) and wrap it in a mask-aware engine with its planners."""
    spec = resolve_model(model_id or settings.engine.model_id)
    device = device or settings.engine.device
    pipe = load_pipeline(
        spec.model_id,
        settings.paths.resolved_models_dir(),
        device=device,
        dtype=DTYPES[settings.engine.dtype],
    )
    engine = MaskAwareEngine(pipe, spec, settings.paths.resolved_cache_dir())
    engine.planners = load_planners(
        settings.paths.profiles_dir, spec.model_id, device, engine.num_units
    )
    return engine


def edit_params(
    spec: ModelSpec,
    settings: Settings,
    steps: int | None = None,
    size: int | tuple[int, int] | None = None,
    mode: str | None = None,
    **overrides,
) -> EditParams:
    """Edit parameters from the model's defaults and the engine settings; keyword overrides win.
    ``size``: a side (square) or (height, width); default the model's resolution."""
    size = size or spec.default_resolution
    fields = dict(
        steps=steps or spec.default_steps,
        guidance=spec.default_guidance,
        size=tuple(size) if isinstance(size, (tuple, list)) else (size, size),
        mode=mode or settings.engine.cache_mode,
        template_seed=settings.engine.template_seed,
        mask_margin=settings.engine.mask_margin_tokens,
        dense_above_ratio=settings.engine.dense_above_ratio,
        record_on_first_edit=settings.engine.record_on_first_edit,
    )
    fields.update(overrides)
    return EditParams(**fields)

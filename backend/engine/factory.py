"""Build an engine and its edit parameters from the settings tree (shared by CLI, worker and CPU
workers).

Each role loads only the parts of the model it runs (``ROLES``): the CPU stages (Celery children)
encode prompts and images and decode results, so they load the text encoders, tokenizers and
VAE; an engine worker only steps the denoiser, so it loads the denoiser and the scheduler (its
VAE's config values come without weights, see ``load_pipeline``), unless it runs the CPU stages
itself (``inline`` batching) or is the ``baseline`` worker (the ordinary pipeline, with its own text
encoders and VAE encode, as a user runs it). The CLI and the benchmarks load everything.
"""

from __future__ import annotations

import torch

from backend.config import Settings
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.graph_book import GraphBook
from backend.engine.profiler import load_planners
from backend.models import ModelSpec, load_pipeline, resolve_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

FULL, CPU_STAGES, DENOISER_ONLY = "full", "cpu-stages", "denoiser"
# role -> the pipeline parts it loads (None: every part the checkpoint has). Names cover every
# family; a name a pipeline does not have is simply not there to load.
ROLES: dict[str, frozenset[str] | None] = {
    FULL: None,
    CPU_STAGES: frozenset(
        {"vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"}
    ),
    DENOISER_ONLY: frozenset({"unet", "transformer", "scheduler"}),
}


def engine_worker_role(settings: Settings) -> str:
    """An engine worker loads the whole model when it runs the CPU stages itself (``inline``) or
    the ordinary pipeline (``baseline``); else the denoiser only."""
    return FULL if settings.worker.batching in ("inline", "baseline") else DENOISER_ONLY


def build_engine(
    settings: Settings,
    model_id: str | None = None,
    device: str | None = None,
    role: str = FULL,
    in_memory: bool = False,
) -> MaskAwareEngine:
    """Load the parts of the model that ``role`` runs (built offline on first use; with
    ``in_memory`` a built form is built without saving, every part) and wrap them in a mask-aware
    engine, with its planners when the role denoises."""
    if role not in ROLES:
        raise ValueError(f"unknown engine role {role!r}: use one of {', '.join(ROLES)}")
    spec = resolve_model(model_id or settings.engine.model_id)
    device = device or settings.engine.device
    pipe = load_pipeline(
        spec.model_id,
        settings.paths.resolved_models_dir(),
        device=device,
        dtype=DTYPES[settings.engine.dtype],
        components=ROLES[role],
        in_memory=in_memory,
    )
    engine = MaskAwareEngine(
        pipe,
        spec,
        settings.paths.resolved_cache_dir(),
        attention=settings.engine.attention,
        step_shapes=settings.engine.step_shapes,
        compile_steps=settings.engine.compile_steps,
        graphs=GraphBook(
            settings.engine.compiled_graphs, settings.engine.compiled_graphs_mb * 1024 * 1024
        ),
        lora_batching=settings.engine.lora_batching,
    )
    if role != CPU_STAGES:
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

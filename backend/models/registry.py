"""Model registry: ids -> ``ModelSpec``; building, saving and loading pipelines.

Ids: ``tiny-<family>``, ``small-<family>``, ``arch-<family>`` (built from configs with fixed seeds),
or ``<family>:<local diffusers directory or hub id>`` for real checkpoints.
Invariants: building an id twice gives identical weights; ``materialize`` publishes a model
directory atomically (built in a temp dir, renamed into place, completion marker written last).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.models.configs import BUILDER_VERSION, CONFIGS, DEFAULTS

FAMILIES = ("sd2-inpaint", "sdxl-inpaint", "flux-fill")
FORMS = ("tiny", "small", "arch")
MARKER = ".maskserve-complete"


class UnknownModelError(ValueError):
    """The model id names no known model; the message lists what is known."""


@dataclass(frozen=True)
class ModelSpec:
    model_id: str
    family: str
    form: str  # tiny | small | arch | checkpoint
    source: str | None  # checkpoint directory or hub id (form == "checkpoint")
    revision: str  # changes whenever the weights change
    default_resolution: int
    default_steps: int
    default_guidance: float
    uses_cfg: bool
    max_sequence_length: int | None


def known_model_ids() -> list[str]:
    return [f"{form}-{family}" for family in FAMILIES for form in FORMS]


def _config_revision(family: str, form: str) -> str:
    text = json.dumps({"configs": CONFIGS[(family, form)], "builder": BUILDER_VERSION, "seed": 0},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _checkpoint_revision(source: str) -> str:
    index = Path(source) / "model_index.json"
    if index.exists():
        return f"{Path(source).resolve()}@{int(index.stat().st_mtime)}"
    return source


def resolve_model(model_id: str) -> ModelSpec:
    """Spec of ``model_id``; raises ``UnknownModelError`` with the known ids otherwise."""
    family, form, source = None, None, None
    if ":" in model_id:
        family, source = model_id.split(":", 1)
        form = "checkpoint"
    else:
        for candidate in FORMS:
            if model_id.startswith(candidate + "-"):
                form, family = candidate, model_id[len(candidate) + 1:]
    if family not in FAMILIES or form is None or (form == "checkpoint" and not source):
        raise UnknownModelError(
            f"unknown model {model_id!r}: use one of {', '.join(known_model_ids())}, "
            f"or '<family>:<checkpoint dir or hub id>' with family in {', '.join(FAMILIES)}")
    defaults_form = "arch" if form == "checkpoint" else form
    resolution, steps, max_len = DEFAULTS[(family, defaults_form)]
    revision = _checkpoint_revision(source) if form == "checkpoint" else _config_revision(family, form)
    uses_cfg = family != "flux-fill"
    return ModelSpec(model_id, family, form, source, revision, resolution, steps, 7.5 if uses_cfg else 30.0,
                     uses_cfg, max_len)


def pipeline_class(family: str):
    from diffusers import FluxFillPipeline, StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline

    return {"sd2-inpaint": StableDiffusionInpaintPipeline, "sdxl-inpaint": StableDiffusionXLInpaintPipeline,
            "flux-fill": FluxFillPipeline}[family]


def materialize(model_id: str, models_dir: Path) -> Path:
    """Directory of a built model, building and saving it first when missing or stale."""
    from backend.models.builders import build_pipeline

    spec = resolve_model(model_id)
    if spec.form == "checkpoint":
        return Path(spec.source)
    target = Path(models_dir) / model_id
    marker = target / MARKER
    if marker.exists() and marker.read_text() == spec.revision:
        return target
    Path(models_dir).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_id}.", dir=models_dir))
    try:
        build_pipeline(spec).save_pretrained(staging)
        (staging / MARKER).write_text(spec.revision)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_pipeline(model_id: str, models_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The diffusers pipeline of ``model_id`` on ``device``, loaded with ``from_pretrained``."""
    import diffusers
    import transformers

    # Loading is quiet: progress bars and per-component chatter belong to interactive use.
    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    spec = resolve_model(model_id)
    path = materialize(model_id, models_dir)
    try:
        pipe = pipeline_class(spec.family).from_pretrained(str(path), dtype=dtype)
    except Exception as exc:  # hub, filesystem and format errors all mean "this checkpoint is unusable"
        raise UnknownModelError(f"cannot load {model_id!r} from {path}: {exc}") from exc
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe

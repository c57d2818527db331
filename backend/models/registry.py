"""Model registry: ids -> ``ModelSpec``; building, saving and loading pipelines.

Ids: ``tiny-<family>``, ``small-<family>``, ``arch-<family>`` (built from configs with fixed seeds),
``<family>:<local diffusers directory or hub id>`` for real checkpoints, or the path of a local
diffusers directory whose ``model_index.json`` names one of the three pipeline classes.
Invariants: building an id twice gives identical weights; ``materialize`` publishes a model
directory atomically (built in a temp dir, renamed into place, completion marker written last).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.models.configs import BUILDER_VERSION, CONFIGS, DEFAULTS, SCHEDULERS
from backend.models.tokenizers import tokenizer_fingerprint

FAMILIES = ("sd2-inpaint", "sdxl-inpaint", "flux-fill")
FORMS = ("tiny", "small", "arch")
MARKER = ".maskserve-complete"  # written last into a model directory; holds the spec's revision
PIPELINE_FAMILIES = {"StableDiffusionInpaintPipeline": "sd2-inpaint", "StableDiffusionPipeline": "sd2-inpaint",
                     "StableDiffusionXLInpaintPipeline": "sdxl-inpaint", "StableDiffusionXLPipeline": "sdxl-inpaint",
                     "FluxFillPipeline": "flux-fill"}


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
    text = json.dumps({"configs": CONFIGS[(family, form)], "scheduler": SCHEDULERS[family], "seed": 0,
                       "builder": BUILDER_VERSION, "tokenizers": tokenizer_fingerprint()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _checkpoint_revision(source: str) -> str:
    index = Path(source) / "model_index.json"
    if index.is_file():
        return f"{Path(source).resolve()}@{index.stat().st_mtime_ns}"
    return source  # a hub id (resolved by ``from_pretrained``)


def _directory_family(path: str) -> str | None:
    """Family of a local diffusers directory, from the pipeline class its model_index.json names."""
    index = Path(path) / "model_index.json"
    try:
        return PIPELINE_FAMILIES.get(json.loads(index.read_text()).get("_class_name"))
    except (OSError, ValueError, AttributeError):
        return None


def _unknown(model_id: str) -> UnknownModelError:
    return UnknownModelError(
        f"unknown model {model_id!r}: use one of {', '.join(known_model_ids())}, "
        f"'<family>:<diffusers checkpoint dir or hub id>' with family in {', '.join(FAMILIES)} "
        f"(e.g. 'flux-fill:/models/FLUX.1-Fill-dev'), or the path of a local diffusers directory")


def resolve_model(model_id: str) -> ModelSpec:
    """Spec of ``model_id``; raises ``UnknownModelError`` with the known ids otherwise."""
    family, form, source = None, None, None
    for candidate in FORMS:
        if model_id.startswith(candidate + "-") and model_id[len(candidate) + 1:] in FAMILIES:
            form, family = candidate, model_id[len(candidate) + 1:]
    prefix, colon, rest = model_id.partition(":")
    if form is None and colon and prefix in FAMILIES and rest:
        form, family, source = "checkpoint", prefix, rest
    if form is None and model_id and (family := _directory_family(model_id)) is not None:
        form, source = "checkpoint", model_id
    if form is None:
        raise _unknown(model_id)
    defaults_form = "arch" if form == "checkpoint" else form
    resolution, steps, max_len = DEFAULTS[(family, defaults_form)]
    revision = _checkpoint_revision(source) if form == "checkpoint" else _config_revision(family, form)
    uses_cfg = family != "flux-fill"
    return ModelSpec(model_id, family, form, source, revision, resolution, steps, 7.5 if uses_cfg else 30.0,
                     uses_cfg, max_len)


def pipeline_class(family: str):
    from diffusers import FluxFillPipeline, StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline

    classes = {"sd2-inpaint": StableDiffusionInpaintPipeline, "sdxl-inpaint": StableDiffusionXLInpaintPipeline,
               "flux-fill": FluxFillPipeline}
    if family not in classes:
        raise UnknownModelError(f"unknown family {family!r}: use one of {', '.join(FAMILIES)}")
    return classes[family]


def _is_complete(path: Path, revision: str) -> bool:
    marker = path / MARKER
    return marker.is_file() and marker.read_text() == revision


def materialize(model_id: str, models_dir: Path) -> Path:
    """Directory of ``model_id``: built forms are built and saved under ``models_dir/<model_id>``
    when missing, incomplete or stale; checkpoints are returned as given (a hub id stays a hub id)."""
    from backend.models.builders import build_pipeline

    spec = resolve_model(model_id)
    if spec.form == "checkpoint":
        return Path(spec.source)
    models_dir = Path(models_dir)
    target = models_dir / model_id
    if _is_complete(target, spec.revision):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_id}.building-", dir=models_dir))
    try:
        build_pipeline(spec).save_pretrained(staging)
        (staging / MARKER).write_text(spec.revision)  # last: a directory with the marker is complete
        _publish(staging, target, spec.revision)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _publish(staging: Path, target: Path, revision: str) -> None:
    """Move a finished build into place; readers never see a half-written ``target``."""
    for _ in range(3):
        try:
            os.rename(staging, target)  # atomic; fails when target exists and is not empty
            return
        except OSError:
            if _is_complete(target, revision):
                return  # another process published the same build first
        stale = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(target, stale)  # an incomplete or older build: set it aside, then retry
        except FileNotFoundError:
            continue  # another process set it aside first
        shutil.rmtree(stale, ignore_errors=True)
    raise OSError(f"cannot publish {staging} as {target}")


def _quiet_loading():
    """Silence download/loading progress bars and chatter; returns a function restoring the levels."""
    import diffusers
    import transformers

    libraries = (diffusers.utils.logging, transformers.utils.logging)
    saved = [(lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libraries]
    for lib in libraries:
        lib.set_verbosity_error()
        lib.disable_progress_bar()

    def restore():
        for lib, level, bars in saved:
            lib.set_verbosity(level)
            if bars:
                lib.enable_progress_bar()
    return restore


def load_pipeline(model_id: str, models_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The diffusers pipeline of ``model_id`` on ``device``, loaded with ``from_pretrained``.

    UNet checkpoints get an ``EulerDiscreteScheduler`` built from their own scheduler config, like the
    built forms: its steps add no noise, so an edit is a function of its inputs and seed.
    """
    spec = resolve_model(model_id)
    path = materialize(model_id, models_dir)
    restore = _quiet_loading()
    try:
        pipe = pipeline_class(spec.family).from_pretrained(str(path), dtype=dtype)
    except Exception as exc:  # hub, filesystem and format errors all mean "this checkpoint is unusable"
        hint = " (no model hub is reachable offline: pass a local diffusers directory)" \
            if spec.form == "checkpoint" and not Path(spec.source).exists() else ""
        raise UnknownModelError(f"cannot load {model_id!r} from {path}{hint}: {exc}") from exc
    finally:
        restore()
    if spec.form == "checkpoint" and spec.uses_cfg:
        from diffusers import EulerDiscreteScheduler

        pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    if torch.device(device).type == "cpu":
        _own_memory(pipe)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _own_memory(pipe) -> None:
    """Copy weights loaded as views of the checkpoint files into fresh (64-byte aligned) tensors.

    Unaligned views change the CPU kernels' summation order, so outputs would differ in the last bit
    from a freshly built model; fresh tensors also keep page faults out of the first timed step.
    """
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module._apply(torch.clone)  # what .to() uses; replaces parameters' and buffers' data

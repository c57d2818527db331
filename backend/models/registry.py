"""Model loading: building, saving and loading the pipelines of ``catalog`` specs.

Invariants: building an id twice gives identical weights; ``materialize`` publishes a model
directory atomically (built in a temp dir, renamed into place, completion marker written last).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Collection
from functools import cache
from pathlib import Path

import torch

from backend.models.catalog import (
    FAMILIES,
    FAMILY_TRAITS,
    ModelSpec,
    UnknownModelError,
    resolve_model,
)
from backend.models.configs import BUILDER_VERSION, CONFIGS, SCHEDULERS
from backend.models.tokenizers import tokenizer_fingerprint

MARKER = ".maskserve-complete"  # written last into a model directory; holds the spec's revision


def model_revision(spec: ModelSpec) -> str:
    """Changes whenever the weights of ``spec`` change (built config, builder, tokenizers or the
    checkpoint's ``model_index.json``)."""
    if spec.form != "checkpoint":
        return _config_revision(spec.family, spec.form)
    return _checkpoint_revision(spec.source or "")


@cache  # hashing the tokenizers costs about a second; configs never change in a process
def _config_revision(family: str, form: str) -> str:
    text = json.dumps(
        {
            "configs": CONFIGS[(family, form)],
            "scheduler": SCHEDULERS[family],
            "seed": 0,
            "builder": BUILDER_VERSION,
            "tokenizers": tokenizer_fingerprint(),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _checkpoint_revision(source: str) -> str:
    index = Path(source) / "model_index.json"
    if index.is_file():
        return f"{Path(source).resolve()}@{index.stat().st_mtime_ns}"
    return source  # a hub id (resolved by ``from_pretrained``)


def pipeline_class(family: str):
    """The diffusers pipeline class that loads ``family`` (named by the catalog's traits)."""
    if family not in FAMILY_TRAITS:
        raise UnknownModelError(f"unknown family {family!r}: use one of {', '.join(FAMILIES)}")
    import diffusers

    return getattr(diffusers, FAMILY_TRAITS[family].pipeline_class)


def _is_complete(path: Path, revision: str) -> bool:
    marker = path / MARKER
    return marker.is_file() and marker.read_text() == revision


def materialize(model_id: str, models_dir: Path) -> Path:
    """Directory of ``model_id``: built forms are built and saved under ``models_dir/<model_id>``
    when missing, incomplete or stale; checkpoints are returned as given (a hub id stays one)."""
    from backend.models.builders import build_pipeline

    spec = resolve_model(model_id)
    if spec.form == "checkpoint":
        return Path(spec.source)
    models_dir = Path(models_dir)
    target = models_dir / model_id
    if _is_complete(target, model_revision(spec)):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_id}.building-", dir=models_dir))
    try:
        build_pipeline(spec).save_pretrained(staging)
        (staging / MARKER).write_text(
            model_revision(spec)
        )  # last: a directory with the marker is complete
        _publish(staging, target, model_revision(spec))
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


def quiet_libraries():
    """Silence download/loading progress bars and chatter; returns a function restoring the
    levels."""
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


def load_pipeline(
    model_id: str,
    models_dir: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    components: Collection[str] | None = None,
    in_memory: bool = False,
):
    """The diffusers pipeline of ``model_id`` on ``device``, loaded with ``from_pretrained``.

    ``in_memory``: a built form (tiny, small, arch) is built and moved to ``device`` without
    being saved (every part; ``components`` is ignored): the same weights as the saved build, for
    models whose float32 files would not fit the disk (arch-flux-fill: 68 GB).

    ``components``: the names of the parts to load (e.g. ``{"unet", "scheduler"}``); every other
    part of the checkpoint is ``None`` on the pipeline and never read from disk. ``None`` loads
    every part. A VAE left out still gives the pipeline the values its config sets
    (``vae_scale_factor``, the image processors): see ``_left_out``.

    UNet checkpoints get an ``EulerDiscreteScheduler`` built from their own scheduler config, like
    the built forms: its steps add no noise, so an edit is a function of its inputs and seed.
    """
    spec = resolve_model(model_id)
    if in_memory and spec.form != "checkpoint":
        pipe = _built_in_memory(spec, device, dtype)
    else:
        pipe = _loaded(spec, models_dir, device, dtype, components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _built_in_memory(spec: ModelSpec, device: str, dtype: torch.dtype):
    """A built form, float32 on the host as ``materialize`` saves it, then moved (and cast) at
    once."""
    from backend.models.builders import build_pipeline

    restore = quiet_libraries()
    try:
        pipe = build_pipeline(spec)
        return pipe.to(device) if dtype == torch.float32 else pipe.to(device, dtype)
    finally:
        restore()


def _loaded(spec: ModelSpec, models_dir: Path, device: str, dtype: torch.dtype, components):
    """``spec``'s saved (or checkpoint) directory through ``from_pretrained``."""
    path = materialize(spec.model_id, models_dir)
    loader = pipeline_class(spec.family)
    restore = quiet_libraries()
    try:
        left_out = {} if components is None else _left_out(loader, path, components)
        pipe = loader.from_pretrained(str(path), dtype=dtype, **left_out)
    except Exception as exc:  # hub, filesystem and format errors: "this checkpoint is unusable"
        hint = (
            " (no model hub is reachable offline: pass a local diffusers directory)"
            if spec.form == "checkpoint" and not Path(spec.source).exists()
            else ""
        )
        raise UnknownModelError(f"cannot load {spec.model_id!r} from {path}{hint}: {exc}") from exc
    finally:
        restore()
    if "vae" in left_out:
        pipe.register_modules(vae=None)  # the constructor has read its config; it has no weights
    if spec.form == "checkpoint" and spec.uses_cfg and pipe.scheduler is not None:
        from diffusers import EulerDiscreteScheduler

        pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    if torch.device(device).type == "cpu":
        _own_memory(pipe)
    return pipe.to(device)


def _left_out(loader, path: Path, components: Collection[str]) -> dict:
    """``from_pretrained`` overrides leaving out every part of the checkpoint not in ``components``.

    A part left out is passed as ``None``, except the VAE: pipeline constructors derive
    ``vae_scale_factor``, latent channels and their image processors from the VAE's config, so it
    is built from that config on the meta device (no weights are allocated or read) and dropped
    once the pipeline exists.
    """
    index = loader.load_config(str(path))  # model_index.json: part name -> [library, class]
    left_out: dict = {
        name: None
        for name, entry in index.items()
        if isinstance(entry, (list, tuple)) and not name.startswith("_") and name not in components
    }
    if "vae" in left_out and index["vae"][0] is not None:
        library, class_name = index["vae"]
        vae_class = getattr(importlib.import_module(library), class_name)
        with torch.device("meta"):
            left_out["vae"] = vae_class.from_config(
                vae_class.load_config(str(path), subfolder="vae")
            )
    return left_out


def _own_memory(pipe) -> None:
    """Copy weights loaded as views of the checkpoint files into fresh (64-byte aligned) tensors.

    Unaligned views change the CPU kernels' summation order, so outputs would differ in the last bit
    from a freshly built model; fresh tensors also keep page faults out of the first timed step.
    """
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module._apply(torch.clone)  # what .to() uses; replaces parameters' and buffers' data

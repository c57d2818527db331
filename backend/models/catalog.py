"""The model catalog: ids, families and their traits, without loading anything (no torch).

Every role may import this module: the API and the studio validate model ids and fill defaults
from it, the dispatcher reads rows per request from it, and only the loading layer
(``backend.models.registry``) turns a ``ModelSpec`` into weights.

Ids: ``demo-sd2-inpaint`` (trained here by ``maskserve train-demo``, shipped in the repository
under ``backend/models/shipped/``), ``tiny-<family>``, ``small-<family>``, ``arch-<family>`` (built
from configs with fixed seeds, random weights), ``<family>:<local diffusers directory or hub id>``
for real checkpoints, or the path of a local diffusers directory whose ``model_index.json`` names
one of the pipeline classes below.
Invariant: ``resolve_model`` reads at most a ``model_index.json``; it never imports a model library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FORMS = ("tiny", "small", "arch")
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


@dataclass(frozen=True)
class FamilyTraits:
    """What serving needs to know about a family before any weights exist."""

    name: str
    pipeline_class: str  # the diffusers pipeline class that loads it
    uses_cfg: bool  # classifier-free guidance: two denoiser rows (uncond, cond) per request
    token_px: int  # image pixels per latent token side (VAE factor x patch size)
    grid_halvings: int  # how often the denoiser halves its token grid (UNet down blocks)
    default_guidance: float
    # diffusers pipeline classes of other checkpoints of the family that load as this one
    also_loads: tuple[str, ...] = ()

    @property
    def rows_per_request(self) -> int:
        """Denoiser rows one request occupies in a batch."""
        return 2 if self.uses_cfg else 1

    @property
    def size_multiple(self) -> int:
        """Image sides must be multiples of this."""
        return int(self.token_px * 2**self.grid_halvings)


FAMILY_TRAITS: dict[str, FamilyTraits] = {
    traits.name: traits
    for traits in (
        FamilyTraits(
            "sd2-inpaint",
            "StableDiffusionInpaintPipeline",
            uses_cfg=True,
            token_px=8,
            grid_halvings=3,
            default_guidance=7.5,
            also_loads=("StableDiffusionPipeline",),
        ),
        FamilyTraits(
            "sdxl-inpaint",
            "StableDiffusionXLInpaintPipeline",
            uses_cfg=True,
            token_px=8,
            grid_halvings=3,
            default_guidance=7.5,
            also_loads=("StableDiffusionXLPipeline",),
        ),
        FamilyTraits(
            "flux-fill",
            "FluxFillPipeline",
            uses_cfg=False,
            token_px=16,
            grid_halvings=0,
            default_guidance=30.0,
        ),
    )
}
FAMILIES = tuple(FAMILY_TRAITS)
PIPELINE_FAMILIES = {
    name: traits.name
    for traits in FAMILY_TRAITS.values()
    for name in (traits.pipeline_class, *traits.also_loads)
}

# (family, form) -> (default resolution, default steps, text max sequence length or None)
DEFAULTS: dict[tuple[str, str], tuple[int, int, int | None]] = {
    ("sd2-inpaint", "tiny"): (256, 20, None),
    ("sd2-inpaint", "small"): (512, 20, None),
    ("sd2-inpaint", "arch"): (512, 50, None),
    ("sdxl-inpaint", "tiny"): (256, 20, None),
    ("sdxl-inpaint", "small"): (512, 20, None),
    ("sdxl-inpaint", "arch"): (1024, 50, None),
    ("flux-fill", "tiny"): (256, 20, 48),
    ("flux-fill", "small"): (512, 20, 64),
    ("flux-fill", "arch"): (1024, 28, 512),
}


@dataclass(frozen=True)
class ShippedModel:
    """A trained checkpoint that ships in ``SHIPPED_DIR/<id>`` with its serving defaults."""

    family: str
    resolution: int  # the resolution it was trained at
    steps: int
    guidance: float


SHIPPED: dict[str, ShippedModel] = {
    "demo-sd2-inpaint": ShippedModel("sd2-inpaint", resolution=128, steps=20, guidance=7.5),
}
DEFAULT_MODEL = "demo-sd2-inpaint"


class UnknownModelError(ValueError):
    """The model id names no known model; the message lists what is known."""


@dataclass(frozen=True)
class ModelSpec:
    model_id: str
    family: str
    form: str  # tiny | small | arch | checkpoint
    source: str | None  # checkpoint directory or hub id (form == "checkpoint")
    default_resolution: int
    default_steps: int
    default_guidance: float
    uses_cfg: bool
    max_sequence_length: int | None

    @property
    def traits(self) -> FamilyTraits:
        return FAMILY_TRAITS[self.family]


def known_model_ids() -> list[str]:
    return [*SHIPPED, *(f"{form}-{family}" for family in FAMILIES for form in FORMS)]


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
        f"(e.g. 'flux-fill:/models/FLUX.1-Fill-dev'), or the path of a local diffusers directory"
    )


def _parse(model_id: str) -> tuple[str, str, str | None]:
    """(family, form, source) of ``model_id``; raises ``UnknownModelError``."""
    for form in FORMS:
        named = model_id.removeprefix(form + "-")
        if named != model_id and named in FAMILIES:
            return named, form, None
    prefix, colon, rest = model_id.partition(":")
    if colon and prefix in FAMILIES and rest:
        return prefix, "checkpoint", rest
    if model_id and (directory_family := _directory_family(model_id)) is not None:
        return directory_family, "checkpoint", model_id
    raise _unknown(model_id)


def resolve_model(model_id: str) -> ModelSpec:
    """Spec of ``model_id``; raises ``UnknownModelError`` with the known ids otherwise."""
    if model_id in SHIPPED:
        return _shipped_spec(model_id)
    family, form, source = _parse(model_id)
    traits = FAMILY_TRAITS[family]
    resolution, steps, max_len = DEFAULTS[(family, "arch" if form == "checkpoint" else form)]
    return ModelSpec(
        model_id,
        family,
        form,
        source,
        resolution,
        steps,
        traits.default_guidance,
        traits.uses_cfg,
        max_len,
    )


def _shipped_spec(model_id: str) -> ModelSpec:
    shipped = SHIPPED[model_id]
    traits = FAMILY_TRAITS[shipped.family]
    return ModelSpec(
        model_id,
        shipped.family,
        "checkpoint",
        str(SHIPPED_DIR / model_id),
        shipped.resolution,
        shipped.steps,
        shipped.guidance,
        traits.uses_cfg,
        DEFAULTS[(shipped.family, "tiny")][2],
    )


def rows_per_request(model_id: str) -> int:
    """Denoiser rows a request of ``model_id`` occupies; raises ``UnknownModelError``."""
    return resolve_model(model_id).traits.rows_per_request

"""An edit as the job service takes it (``JobRequest``), as it checked it (``CheckedJob``) and
what it builds from a checked one: the ``EditJob`` message and the job record's fields.

Pure: dataclasses and the functions that turn one into the others; the service (``service``)
checks, stores and queues. Invariant: the message and the record of one job are built from the
same ``CheckedJob``, so what the record says was asked is what the job runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.api.adapter_requests import AdapterChoice, adapter_fields
from backend.api.service_levels import level_fields
from backend.api.template_source import CheckedTemplate
from backend.imaging.uploads import DEFAULT_CROP_PADDING_PX
from backend.protocol import AdapterUse, EditJob, MaskOps, ServiceLevel


@dataclass(frozen=True)
class JobRequest:
    """One edit as a caller asks for it. Exactly one of ``template_id`` (a gallery template) and
    ``image`` (the bytes of an uploaded image) is given. ``None`` means the model's default (and,
    for the seed, a random one)."""

    mask: bytes
    prompt: str
    template_id: str | None = None
    image: bytes | None = None
    negative_prompt: str = ""
    model: str | None = None  # None: the deployment's default model (settings.engine.model_id)
    steps: int | None = None
    guidance: float | None = None
    strength: float = 1.0
    seed: int | None = None
    mask_ops: MaskOps = field(default_factory=MaskOps)
    resolution: int = 0  # 0: the model's default resolution bucket
    # "generate", or "erase": filled from the surroundings in pre-processing (no model, no prompt)
    mode: str = "generate"
    # "whole", or "masked": a padded crop around the mask at the model's resolution, pasted back
    inpaint_area: str = "whole"
    crop_padding_px: int = DEFAULT_CROP_PADDING_PX
    use_cache: bool = True
    adapters: tuple[AdapterChoice, ...] = ()  # LoRA adapters, each with a scale
    # its service level (``service_levels``): None = the class's default (REST: batch)
    service_class: str | None = None
    deadline_s: float | None = None  # seconds from submission; None: the class's target
    priority: int = 0  # 0..9, higher goes first
    # the tenant that owns it (``backend.api.security.Caller.owner``): only it can see the job
    owner: str = ""
    # whose history lists it (a studio user within the studio's tenant); empty: the owner's
    listed_for: str = ""


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    seed: int
    model_id: str
    steps: int


@dataclass(frozen=True)
class CheckedJob:
    """A request that passed every check (``JobService.check``), with the values it runs with:
    the model's defaults filled in, the seed chosen, its service level admitted."""

    request: JobRequest
    template: CheckedTemplate
    model_id: str
    steps: int
    guidance: float
    seed: int
    submitted_at: float
    level: ServiceLevel
    forecast: Any  # admission_control.Forecast | None
    adapters: tuple[AdapterUse, ...]


@dataclass(frozen=True)
class BatchLink:
    """The batch a job is an item of (``backend.api.batches``): its id and the item's index."""

    batch_id: str
    index: int


def edit_job(
    checked: CheckedJob, job_id: str, template_ref: str, mask_ref: str, batch: BatchLink | None
) -> EditJob:
    request = checked.request
    return EditJob(
        job_id=job_id,
        model_id=checked.model_id,
        template_ref=template_ref,
        mask_ref=mask_ref,
        prompt=request.prompt,
        seed=checked.seed,
        steps=checked.steps,
        guidance=checked.guidance,
        negative_prompt=request.negative_prompt,
        strength=float(request.strength),
        use_cache=bool(request.use_cache),
        mask_ops=request.mask_ops,
        resolution=request.resolution,
        submitted_at=checked.submitted_at,
        template_id=request.template_id or "",
        mode=request.mode,
        inpaint_area=request.inpaint_area,
        crop_padding_px=request.crop_padding_px,
        adapters=list(checked.adapters),
        service=checked.level,
        batch_id=batch.batch_id if batch else "",
    )


def record_fields(
    checked: CheckedJob, template_ref: str, mask_ref: str, batch: BatchLink | None
) -> dict[str, Any]:
    """The ``JobRecord`` fields of a new job (``JobStateStore.create``)."""
    request, (width, height) = checked.request, checked.template.size
    return dict(
        model_id=checked.model_id,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        seed=checked.seed,
        steps=checked.steps,
        guidance=checked.guidance,
        strength=float(request.strength),
        resolution=request.resolution,
        use_cache=bool(request.use_cache),
        mask_ops=vars(request.mask_ops),
        mode=request.mode,
        inpaint_area=request.inpaint_area,
        crop_padding_px=request.crop_padding_px,
        adapters=adapter_fields(checked.adapters),
        template_id=request.template_id or "",
        width=width,
        height=height,
        template_ref=template_ref,
        mask_ref=mask_ref,
        owner=request.owner,
        **({"batch_id": batch.batch_id, "batch_index": batch.index} if batch else {}),
        **level_fields(checked.level, checked.forecast),
    )

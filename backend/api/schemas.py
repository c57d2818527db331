"""The job as a client sees it, typed: the response models of ``/v1/jobs`` (and so the OpenAPI
schema at ``/openapi.json``).

``JobView`` is ``protocol.JobRecord`` (the job hash, typed in one place) less the services' own
fields (``protocol.INTERNAL_JOB_FIELDS``: blob refs, the owner's digest, the post-processing
guard), with ``reached_at`` flattened to ``<status>_at`` and what the API adds: the links.
tests/test_job_schema.py keeps it field for field in step with ``JobRecord``.

The routes answer with ``response_model_exclude_unset``: a field the job does not have yet (a
status it never reached, ``queue_position`` while it is not in a worker's queue, a forecast before
there is one, ``met_deadline`` before it is done, ``thumbnail_url`` before it is done) is left out,
not sent as null; every other field is always there.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from backend.config_deadlines import SERVICE_CLASSES
from backend.protocol import JOB_STATES, MaskOps
from backend.protocol.messages import JOB_MODES

# protocol.JOB_STATES, in the order a job moves through them (Literal of a tuple = of its items)
JobStatus = Literal[JOB_STATES]  # type: ignore[valid-type]
JobKind = Literal["edit", "prepare"]
ServiceClass = Literal[SERVICE_CLASSES]  # type: ignore[valid-type]

_REACHED = "Unix time at which the job first reached this status; absent until it has"


_STATUS_URL = "This job (GET)"
_EVENTS_URL = "Its server-sent events (GET, resumable with Last-Event-ID)"
_RESULT_URL = "Its result, a PNG once the job is done"


class AdapterChoiceView(BaseModel):
    id: str = Field(description="The adapter's id (GET /v1/adapters)")
    scale: float = Field(description="How strongly it applies (1: as trained)")


class JobView(BaseModel):
    """One job: what was asked, how far it got, where its time went, and its links."""

    job_id: str = Field(description="32 hex digits")
    status: JobStatus = Field(
        description="Moves only forward: queued, preprocessing, waiting, running, postprocessing, "
        "then done, failed or cancelled"
    )
    kind: JobKind = Field(
        description="edit (an inpainting) or prepare (a template's cache recording: no image)"
    )
    message: str = Field(
        description="What is happening now or why it ended: why it failed, that it waits for a "
        "worker of its model (and which models live workers serve), that it was re-dispatched; "
        "empty when there is nothing to say"
    )
    step: int = Field(description="Denoising steps done")
    num_steps: int = Field(description="Denoising steps it runs (0 until pre-processed)")
    queue_position: int | None = Field(
        None,
        description="Only while it waits in a worker's queue: 1 = next to join the running "
        "batch (the worker's latest heartbeat, else its latest report); null while on its way to "
        "that worker",
    )
    service_class: ServiceClass = Field(
        description="interactive (someone waits for it) or batch: its default deadline and "
        "whether admission control sheds it"
    )
    priority: int = Field(description="0..9, higher goes first")
    deadline: float = Field(
        description="Unix time by which its result should be stored (0: none, a job from before "
        "deadlines)"
    )
    late: bool = Field(
        description="Accepted though admission control predicted it to finish too late for its "
        "deadline, or found the queue full (its class is not shed)"
    )
    predicted_start: float | None = Field(
        None,
        description="Unix time of its predicted first denoising step: admission control's "
        "forecast, then its worker's as it waits and runs; absent until there is one",
    )
    predicted_finish: float | None = Field(
        None,
        description="Unix time of the predicted end of its denoising (same sources); absent "
        "until there is one",
    )
    met_deadline: bool | None = Field(
        None,
        description="Once done: whether its result was stored by its deadline; absent while it "
        "runs, when it failed or was cancelled, or without a deadline",
    )
    worker_id: str = Field(description="The engine worker it was routed to; empty until then")
    timings: dict[str, float] = Field(
        description="Seconds per stage it went through: queue_s, pre_s, wait_s, denoise_s, "
        "post_s, and total_s (creation to the end) once it finished (done, failed or "
        "cancelled); empty while it runs"
    )
    created_at: float = Field(description="Unix time of its submission")
    updated_at: float = Field(description="Unix time of its latest change")
    queued_at: float | None = Field(None, description=_REACHED)
    preprocessing_at: float | None = Field(None, description=_REACHED)
    waiting_at: float | None = Field(None, description=_REACHED)
    running_at: float | None = Field(None, description=_REACHED)
    postprocessing_at: float | None = Field(None, description=_REACHED)
    done_at: float | None = Field(None, description=_REACHED)
    failed_at: float | None = Field(None, description=_REACHED)
    cancelled_at: float | None = Field(None, description=_REACHED)
    redeliveries: int = Field(
        description="How often it was delivered again after its worker was lost"
    )
    model_id: str = Field(description="The model it runs on")
    prompt: str
    negative_prompt: str
    seed: int = Field(description="The seed it runs with (chosen at submission when not given)")
    steps: int = Field(description="Denoising steps asked for")
    guidance: float
    strength: float
    resolution: int = Field(description="Resolution bucket side; 0: the model's default")
    use_cache: bool = Field(description="Reuse the template's cached activations")
    mask_ops: MaskOps = Field(description="The mask operations pre-processing applies")
    mode: Literal[JOB_MODES] = Field(  # type: ignore[valid-type]
        description="generate: the model paints the mask; erase: filled from the surroundings "
        "(OpenCV Telea, no model)"
    )
    inpaint_area: Literal["whole", "masked"] = Field(
        description="whole: the model edits the whole image; masked: a padded crop around the "
        "mask at the model's resolution, pasted back"
    )
    crop_padding_px: int = Field(
        description="Pixels of context around the mask in the masked-area crop (0..1024)"
    )
    adapters: list[AdapterChoiceView] = Field(
        description="The LoRA adapters it applies, each with its scale (empty: the base model)"
    )
    adapter_steps: dict[str, int] = Field(
        description="Once denoised: adapter id -> the denoising step at which the adapter joined "
        "(0: from the start; later when it was still loading, see docs/design/adapters.md)",
    )
    template_id: str = Field(description="The gallery template it edits; empty for an upload")
    batch_id: str | None = Field(
        None, description="The batch it is an item of (GET /v1/batches/{id}); absent for none"
    )
    batch_index: int | None = Field(
        None, description="Its index among its batch's items (0 first); only with batch_id"
    )
    width: int = Field(description="The image's width, pixels")
    height: int = Field(description="The image's height, pixels")
    status_url: str = Field(description=_STATUS_URL)
    events_url: str = Field(description=_EVENTS_URL)
    result_url: str = Field(description=_RESULT_URL)
    thumbnail_url: str | None = Field(
        None, description="Its result's thumbnail (WebP); only once the job is done"
    )


class JobList(BaseModel):
    jobs: list[JobView] = Field(description="The caller's own jobs, newest first")


class JobAccepted(BaseModel):
    """A submitted job: its id at once, then follow ``status_url`` or ``events_url``."""

    job_id: str
    seed: int = Field(description="The seed it runs with (chosen here when not given)")
    model: str = Field(description="The model it runs on")
    steps: int
    status: Literal["queued"]
    status_url: str = Field(description=_STATUS_URL)
    events_url: str = Field(description=_EVENTS_URL)
    result_url: str = Field(description=_RESULT_URL)


class JobCancelled(BaseModel):
    job_id: str
    status: Literal["cancelled"]
    worker_notified: bool = Field(description="It was on a worker, which drops it at its next step")

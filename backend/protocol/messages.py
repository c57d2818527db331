"""Every message that crosses a process boundary, and its one wire format (versioned JSON).

Invariants:
* nothing is pickled between processes: ``encode`` writes JSON, ``decode`` reads it back into the
  same dataclass (``decode(encode(m)) == m``), nested dataclasses included;
* images, masks and tensors never travel inside a message: a message carries references (blob refs,
  see ``backend.blobs``) to files every process on the host can read;
* a message names its type and its schema version ``"<major>.<minor>"``. A reader rejects another
  major version with ``ProtocolError``; within a major version it ignores fields it does not know (a
  newer minor version added them, optional by rule), so processes can be upgraded one at a time;
* a message that cannot be decoded may still name its job: ``job_id_of`` reads it, so the reader
  can fail that job with a terminal event instead of dropping it silently.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from backend.protocol.fieldtypes import conform_fields

SCHEMA_MAJOR = 1
# 1.1: typed heartbeat rows and paste-back plans; unknown fields tolerated. 1.2: mask ops
# fill_holes and min_area_px, an edit job's mode (erase). 1.3: an edit job's inpaint_area and
# crop_padding_px. 1.4: a prepared job's prompt (the baseline worker runs the pipeline on it).
# 1.5: LoRA adapters on edit, prepared and denoised jobs; adapters resident in a heartbeat.
# 1.6: service levels (class, deadline, priority) on edit and prepared jobs and heartbeat rows;
# a waiting row's steps already run (parked); predicted start/finish and queue position on events
# 1.7: the batch an edit or prepared job is an item of (its items are routed to one worker)
# 1.8: the service level on denoised jobs (post-processing is queued in service order)
# 1.9: a worker's finish tail on its heartbeat (routing and admission plan against it)
# 1.10: heartbeat rows' starvation-bound state (a waiting row's wait, due rows), so routing and
# admission see the rows the worker lets in first
# 1.11: the template caches on a worker's device tier (a cache read from there loads nothing)
SCHEMA_MINOR = 11
PROTOCOL_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"


class ProtocolError(ValueError):
    """A message could not be read: wrong version, unknown type, or missing/extra fields."""


@dataclass(frozen=True)
class MaskOps:
    """Mask operations applied in pre-processing, in this order: threshold, fill holes, remove
    specks, invert, grow/shrink, feather (``backend.imaging.masks.apply_ops``). New fields have
    defaults that change nothing, so older messages still read the same."""

    threshold: int = 127  # mask pixels above this (0-255) are repainted
    invert: bool = False
    grow_px: int = 0  # negative shrinks
    feather_px: float = 0.0
    fill_holes: bool = False  # fill what a closed painted outline encloses (lasso)
    min_area_px: int = 0  # drop painted areas smaller than this many pixels (0: keep all)


@dataclass(frozen=True)
class PastePlan:
    """How post-processing pastes a bucket-sized result back into the upload (pre -> post)."""

    mask_ref: str  # blob ref of the mask at the upload's resolution
    # left, top, right, bottom in the upload of the bucket's crop, or of the masked-area crop
    crop_box: list[int]
    feather_px: float = 0.0


@dataclass(frozen=True)
class AdapterUse:
    """One LoRA adapter a request applies (API -> pre-processing -> worker). ``sha256`` names the
    adapter's normalized file in the adapter store (content-addressed: workers load and keep
    adapters by it); ``adapter_id`` is the user's record, for events and records."""

    adapter_id: str
    sha256: str
    scale: float = 1.0
    nbytes: int = 0  # the adapter's tensors, for the router's load estimate (0: unknown)


@dataclass(frozen=True)
class ServiceLevel:
    """What a job was promised (1.6): its class, when it should be done, how it ranks."""

    service_class: str = "batch"  # "interactive" | "batch" (config_deadlines.SERVICE_CLASSES)
    deadline: float = 0.0  # epoch seconds by which its result should be stored (0: none)
    priority: int = 0  # 0..9, higher goes first (after rows past the starvation bound)
    late: bool = False  # accepted though predicted to finish past its deadline


@dataclass(frozen=True)
class RunningRow:
    """A row in a worker's running batch, as its heartbeat reports it."""

    job_id: str
    mask_ratio: float
    remaining_steps: int
    template: str = ""  # cache digest of the row's template ("" = none), for residency routing
    adapters: list[str] = field(default_factory=list)  # sha256 of each adapter the row applies
    deadline: float = 0.0  # the job's ServiceLevel (1.6), for routing by deadline
    priority: int = 0
    # let in to keep the starvation bound: the worker never parks it (routing models the bound)
    due: bool = False


@dataclass(frozen=True)
class WaitingRow:
    """A row waiting in a worker's queue, in admission order, as its heartbeat reports it."""

    job_id: str
    mask_ratio: float
    num_steps: int
    template: str = ""
    adapters: list[str] = field(default_factory=list)  # sha256 of each adapter the row applies
    deadline: float = 0.0  # the job's ServiceLevel (1.6), for routing by deadline
    priority: int = 0
    step: int = 0  # steps already run: a row parked at a step boundary resumes from here (1.6)
    # seconds it has waited (queued and parked, summed) at the heartbeat's ``at``, and whether
    # the worker found it due for the starvation bound: due rows take slots before any other
    waited_s: float = 0.0
    due: bool = False


@dataclass(frozen=True)
class EditJob:
    """A user's edit request as submitted (API -> pre-processing)."""

    TYPE: ClassVar[str] = "edit_job"
    job_id: str
    model_id: str
    template_ref: str  # blob ref of the template image file
    mask_ref: str  # blob ref of the mask PNG (white = repaint)
    prompt: str
    seed: int
    steps: int
    guidance: float
    negative_prompt: str = ""
    strength: float = 1.0
    use_cache: bool = True
    mask_ops: MaskOps = field(default_factory=MaskOps)
    # the resolution bucket's side (about resolution^2 pixels); 0 = the model's default
    resolution: int = 0
    submitted_at: float = 0.0
    # the gallery template edited, if any (its cache status is kept per model)
    template_id: str = ""
    prepare: bool = False  # record the template's activation cache only: no mask, no image result
    # "generate" (the diffusion model), or "erase": filled from the surroundings by OpenCV (Telea)
    # in pre-processing, which finishes the job itself (no worker, no post-processing)
    mode: str = "generate"
    # "whole" (the model edits the whole image), or "masked": a padded crop around the mask, at
    # the model's resolution, pasted back (``uploads.masked_crop_box``; docs/design/crop.md)
    inpaint_area: str = "whole"
    crop_padding_px: int = 32  # context kept around the mask when inpaint_area is "masked"
    adapters: list[AdapterUse] = field(default_factory=list)  # LoRA adapters, at most a few
    service: ServiceLevel = field(default_factory=ServiceLevel)  # 1.6
    # the batch it is an item of (1.7; "" none): the dispatcher routes a batch's items together
    batch_id: str = ""


JOB_MODES = ("generate", "erase")


@dataclass(frozen=True)
class PreparedJob:
    """A pre-processed job, ready for a worker's running batch (pre-processing -> worker inbox)."""

    TYPE: ClassVar[str] = "prepared_job"
    job_id: str
    model_id: str
    prepared_ref: str  # blob ref of the PreparedRequest file (tensors)
    # the template as uploaded (full resolution), for paste-back in post-processing
    template_ref: str
    num_steps: int
    mask_ratio: float  # painted pixels / all pixels at the model resolution
    cache_digest: str  # CacheKey digest of the template cache this job reads ("" = no cache)
    paste: PastePlan | None = None  # None: prepared at the model resolution, no bucket crop
    submitted_at: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds so far
    prepare: bool = False  # a recording: the worker records and finishes it, no post-processing
    # the request's prompt as submitted: the ``baseline`` worker's pipeline encodes it itself
    prompt: str = ""
    adapters: list[AdapterUse] = field(default_factory=list)
    service: ServiceLevel = field(default_factory=ServiceLevel)  # 1.6
    batch_id: str = ""  # EditJob.batch_id (1.7)


@dataclass(frozen=True)
class DenoisedJob:
    """A job whose denoising finished (worker -> post-processing)."""

    TYPE: ClassVar[str] = "denoised_job"
    job_id: str
    model_id: str
    latents_ref: str  # blob ref of the final latents (safetensors)
    prepared_ref: str
    template_ref: str
    used_cache: bool
    paste: PastePlan | None = None
    submitted_at: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    # adapter id -> the denoising step at which it joined the row (0: from the start)
    adapter_steps: dict[str, int] = field(default_factory=dict)
    service: ServiceLevel = field(default_factory=ServiceLevel)  # 1.8


@dataclass(frozen=True)
class CancelJob:
    TYPE: ClassVar[str] = "cancel_job"
    job_id: str


JOB_STATES = (
    "queued",
    "preprocessing",
    "waiting",
    "running",
    "postprocessing",
    "done",
    "failed",
    "cancelled",
)


@dataclass(frozen=True)
class JobEvent:
    """A change in one job's life: a state change or a finished denoising step."""

    TYPE: ClassVar[str] = "job_event"
    job_id: str
    status: str  # one of JOB_STATES
    at: float
    step: int = 0
    num_steps: int = 0
    worker_id: str = ""
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    result_ref: str = ""
    thumbnail_ref: str = ""
    # a running event's live preview, a ``data:image/png;base64,...`` URL (1.2; empty: none); on
    # the job's event stream only, never in its record (``records.event_fields``)
    preview: str = ""
    # the post-processing (done) event: adapter id -> the step it joined the row at (1.5)
    adapter_steps: dict[str, int] = field(default_factory=dict)
    # the worker's forecast (1.6; 0: none): 1 = next to join its batch, epoch seconds of the
    # predicted first step and of the predicted end of denoising
    queue_position: int = 0
    predicted_start: float = 0.0
    predicted_finish: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in JOB_STATES:
            raise ProtocolError(
                f"unknown job status {self.status!r}; expected one of {', '.join(JOB_STATES)}"
            )


@dataclass(frozen=True)
class WorkerHeartbeat:
    """A worker's live state, refreshed about every second under a key with a short TTL: when the
    key expires, the worker is presumed dead and its unfinished jobs are re-dispatched."""

    TYPE: ClassVar[str] = "worker_heartbeat"
    worker_id: str
    model_id: str
    device: str
    at: float
    max_batch: int
    batching: str
    running: list[RunningRow] = field(default_factory=list)
    waiting: list[WaitingRow] = field(default_factory=list)  # in admission order
    resident_ram: list[str] = field(default_factory=list)  # template cache digests per tier
    resident_disk: list[str] = field(default_factory=list)
    # ... and on its device tier (1.11): rows of these read their cache where it lies, no copy
    resident_device: list[str] = field(default_factory=list)
    # sha256 of the LoRA adapters per tier of the worker (routing prefers where a job's are)
    adapters_device: list[str] = field(default_factory=list)
    adapters_host: list[str] = field(default_factory=list)
    # seconds its jobs take from the last step to done (a high quantile of the measured tails):
    # its rows' published deadlines are their jobs' less this, and a new job's should be
    finish_tail_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)  # free-form counters for /metrics


Message = EditJob | PreparedJob | DenoisedJob | CancelJob | JobEvent | WorkerHeartbeat
MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (EditJob, PreparedJob, DenoisedJob, CancelJob, JobEvent, WorkerHeartbeat)
}
# field name -> the dataclass its value (or each item of its list) decodes into
_NESTED: dict[str, type] = {"mask_ops": MaskOps, "paste": PastePlan, "service": ServiceLevel}
_NESTED_LISTS: dict[str, type] = {
    "running": RunningRow,
    "waiting": WaitingRow,
    "adapters": AdapterUse,
}


def to_dict(message: Message) -> dict[str, Any]:
    """The message as a JSON-ready dict, with its type and schema version."""
    # shallow except the nested fields: a worker encodes one progress event per row per step,
    # and dataclasses.asdict deep-copies every value; json.dumps copies nested values anyway
    payload: dict[str, Any] = {"type": message.TYPE, "version": PROTOCOL_VERSION}
    for f in fields(message):
        value = getattr(message, f.name)
        if f.name in _NESTED and value is not None:
            value = asdict(value)
        elif f.name in _NESTED_LISTS:
            value = [asdict(item) for item in value]
        payload[f.name] = value
    return payload


def encode(message: Message) -> str:
    return json.dumps(to_dict(message), separators=(",", ":"), sort_keys=True)


def _major(version: object) -> int | None:
    """The major version of ``version`` ("1.1" -> 1; a bare 1 from the first schema -> 1)."""
    if isinstance(version, int) and not isinstance(version, bool):
        return version
    if isinstance(version, str):
        head = version.split(".", 1)[0]
        # ASCII digits only ("²".isdigit() is true, int("²") fails) and short (int() refuses
        # strings of thousands of digits)
        return int(head) if head.isascii() and head.isdigit() and len(head) < 10 else None
    return None


def _known(cls: type, payload: dict[str, Any]) -> dict[str, Any]:
    """The payload's fields ``cls`` knows; newer minor versions may add others (ignored)."""
    names = {f.name for f in fields(cls)}
    return {name: value for name, value in payload.items() if name in names}


def _construct(cls: type, known: dict[str, Any], where: str) -> Any:
    try:
        return cls(**conform_fields(cls, known))
    except TypeError as exc:  # a required field is missing, or a value is not of its field's type
        raise ProtocolError(f"{where}: {exc}") from exc


def _build(cls: type, payload: object, where: str) -> Any:
    """A nested dataclass from its JSON object (fields it does not know are ignored)."""
    if not isinstance(payload, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(payload).__name__}")
    return _construct(cls, _known(cls, payload), where)


def from_dict(payload: dict[str, Any]) -> Message:
    payload = dict(payload)
    version, type_name = payload.pop("version", None), payload.pop("type", None)
    if _major(version) != SCHEMA_MAJOR:
        raise ProtocolError(
            f"message version {version!r}, this build speaks {SCHEMA_MAJOR}.x ({PROTOCOL_VERSION})"
        )
    cls = MESSAGE_TYPES.get(type_name)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r}")
    payload = _known(cls, payload)
    for name, nested in _NESTED.items():
        if payload.get(name) is not None:
            payload[name] = _build(nested, payload[name], f"{type_name}.{name}")
    for name, nested in _NESTED_LISTS.items():
        if name in payload:
            items = payload[name]
            if not isinstance(items, list):
                raise ProtocolError(f"{type_name}.{name}: expected a list")
            payload[name] = [_build(nested, item, f"{type_name}.{name}[]") for item in items]
    message: Message = _construct(cls, payload, type_name)
    return message


def _payload(text: str | bytes) -> dict[str, Any]:
    try:
        payload = json.loads(text)
    except ValueError as exc:  # not JSON, not UTF-8, or a number of thousands of digits
        raise ProtocolError(f"message is not JSON: {exc}") from exc
    except RecursionError:  # arrays nested thousands deep
        raise ProtocolError("message is nested too deeply to be read") from None
    if not isinstance(payload, dict):
        raise ProtocolError("message must be a JSON object")
    return payload


def decode(text: str | bytes) -> Message:
    return from_dict(_payload(text))


def job_id_of(text: str | bytes) -> str | None:
    """The job id an undecodable message names, when it names one (a non-empty string)."""
    try:
        job_id = _payload(text).get("job_id")
    except ProtocolError:
        return None
    return job_id if isinstance(job_id, str) and job_id else None

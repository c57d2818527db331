"""Every message that crosses a process boundary, and its one wire format (versioned JSON).

Invariants:
* nothing is pickled between processes: ``encode`` writes JSON, ``decode`` reads it back into the
  same dataclass (``decode(encode(m)) == m``);
* images, masks and tensors never travel inside a message: a message carries references (blob refs,
  see ``backend.blobs``) to files every process on the host can read;
* a message names its type and the protocol version; a reader rejects another major version with
  ``ProtocolError`` instead of guessing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A message could not be read: wrong version, unknown type, or missing/extra fields."""


@dataclass(frozen=True)
class MaskOps:
    """Mask operations applied in pre-processing, in this order: threshold, invert, grow/shrink, feather."""

    threshold: int = 127  # mask pixels above this (0-255) are repainted
    invert: bool = False
    grow_px: int = 0  # negative shrinks
    feather_px: float = 0.0


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
    resolution: int = (
        0  # the resolution bucket's side (about resolution^2 pixels); 0 = the model's default
    )
    submitted_at: float = 0.0
    template_id: str = (
        ""  # the gallery template edited, if any (its cache status is kept per model)
    )
    prepare: bool = False  # record the template's activation cache only: no mask, no image result


@dataclass(frozen=True)
class PreparedJob:
    """A pre-processed job, ready for a worker's running batch (pre-processing -> worker inbox)."""

    TYPE: ClassVar[str] = "prepared_job"
    job_id: str
    model_id: str
    prepared_ref: str  # blob ref of the PreparedRequest file (tensors)
    template_ref: (
        str  # the template as uploaded (full resolution), for paste-back in post-processing
    )
    num_steps: int
    mask_ratio: float  # painted pixels / all pixels at the model resolution
    cache_digest: str  # CacheKey digest of the template cache this job reads ("" = no cache)
    paste: dict = field(
        default_factory=dict
    )  # post-processing's paste-back plan (see backend.tasks.core)
    submitted_at: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds so far
    prepare: bool = (
        False  # a cache recording: the worker records and finishes it, no post-processing
    )


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
    paste: dict = field(default_factory=dict)
    submitted_at: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


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

    def __post_init__(self):
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
    running: list[dict] = field(default_factory=list)  # job_id, mask_ratio, remaining_steps
    waiting: list[dict] = field(default_factory=list)  # job_id, mask_ratio, num_steps
    resident_ram: list[str] = field(default_factory=list)  # template cache digests per tier
    resident_disk: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (EditJob, PreparedJob, DenoisedJob, CancelJob, JobEvent, WorkerHeartbeat)
}
_NESTED = {"mask_ops": MaskOps}


def to_dict(message) -> dict:
    # shallow on purpose: dataclasses.asdict deep-copies every value, and a worker encodes one
    # progress event per row per step; json.dumps copies the nested dicts and lists anyway
    payload = {"type": message.TYPE, "version": PROTOCOL_VERSION}
    for f in fields(message):
        value = getattr(message, f.name)
        payload[f.name] = asdict(value) if f.name in _NESTED else value
    return payload


def encode(message) -> str:
    return json.dumps(to_dict(message), separators=(",", ":"), sort_keys=True)


def from_dict(payload: dict):
    payload = dict(payload)
    version, type_name = payload.pop("version", None), payload.pop("type", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"message version {version!r}, this build speaks {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(type_name)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r}")
    names = {f.name for f in fields(cls)}
    if set(payload) - names:
        raise ProtocolError(f"{type_name}: unexpected fields {sorted(set(payload) - names)}")
    try:
        for name, nested in _NESTED.items():
            if isinstance(payload.get(name), dict):
                payload[name] = nested(**payload[name])
        return cls(**payload)
    except TypeError as exc:
        raise ProtocolError(f"{type_name}: {exc}") from exc


def decode(text: str | bytes):
    try:
        payload = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"message is not JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise ProtocolError("message must be a JSON object")
    return from_dict(payload)

"""The job record: one Redis hash per job (``keys.job_key``), typed in one place.

Writers store every value as text (dicts as JSON); ``JobRecord.from_hash`` is the only reader that
turns the hash back into typed values, and ``JobRecord.as_dict`` is what the API returns. A field
this build does not know (written by a newer minor version) is ignored, like in messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from backend.protocol.messages import JOB_STATES, JobEvent
from backend.protocol.wire import to_text

TERMINAL = ("done", "failed", "cancelled")
TIMING_PREFIX = "timing."  # hash field ``timing.<stage>`` holds that stage's seconds
REACHED_SUFFIX = "_at"  # hash field ``<status>_at`` holds when the job first reached it
# The stage a job is in while it has each status, in order; ``total_s`` is creation to the end. A
# done job's stages are measured by the services that ran them (its ``done`` event carries them);
# a failed or cancelled job's are the times between the statuses it reached (``jobstate`` derives
# them when the terminal event is recorded), so every finished job reports where its time went.
STAGE_TIMINGS = (
    ("queued", "queue_s"),
    ("preprocessing", "pre_s"),
    ("waiting", "wait_s"),
    ("running", "denoise_s"),
    ("postprocessing", "post_s"),
)
TOTAL_TIMING = "total_s"
# terminal statuses whose timings are derived from the statuses the job reached
DERIVED_TIMINGS = ("failed", "cancelled")


@dataclass
class JobRecord:
    """A job as stored: what was asked (set at creation) and how far it got (set by events)."""

    job_id: str
    status: str = "queued"
    kind: str = "edit"  # edit | prepare (a template cache recording)
    created_at: float = 0.0
    updated_at: float = 0.0
    reached_at: dict[str, float] = field(default_factory=dict)  # status -> first reached
    step: int = 0
    num_steps: int = 0
    worker_id: str = ""
    message: str = ""
    result_ref: str = ""
    thumbnail_ref: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds (STAGE_TIMINGS)
    model_id: str = ""
    prompt: str = ""
    negative_prompt: str = ""
    seed: int = 0
    steps: int = 0
    guidance: float = 0.0
    strength: float = 1.0
    resolution: int = 0
    use_cache: bool = True
    mask_ops: dict[str, Any] = field(default_factory=dict)
    mode: str = "generate"  # generate | erase: filled from the surroundings, no model
    inpaint_area: str = "whole"  # whole | masked: a padded crop around the mask (design/crop.md)
    crop_padding_px: int = 32
    adapters: list[dict[str, Any]] = field(default_factory=list)  # [{"id", "scale"}] (LoRA)
    # adapter id -> the denoising step at which it joined (0: from the start), set when denoised
    adapter_steps: dict[str, int] = field(default_factory=dict)
    template_id: str = ""
    width: int = 0
    height: int = 0
    template_ref: str = ""  # the refs keep these blobs from the janitor while the job runs
    mask_ref: str = ""
    owner: str = ""  # the submitting tenant, a digest (api.security.Caller): only it sees it
    redeliveries: int = 0  # deliveries again after a lost worker (bounded; docs/design/delivery.md)
    denoised: int = 0  # denoises handed to post-processing: 1 when done, never more
    # what it was promised (messages.ServiceLevel), set at creation
    service_class: str = "batch"  # interactive | batch
    priority: int = 0  # 0..9, higher goes first
    deadline: float = 0.0  # epoch seconds by which its result should be stored (0: none)
    late: bool = False  # accepted though admission control predicted it to finish too late
    # the latest forecast (0: none yet): the API's at admission, then its worker's (JobEvent)
    queue_position: int = 0  # 1 = next to join its worker's batch
    predicted_start: float = 0.0  # epoch seconds of its predicted first step
    predicted_finish: float = 0.0  # epoch seconds of the predicted end of its denoising
    met_deadline: bool | None = None  # once done: stored at or before its deadline (with one)
    batch_id: str = ""  # the batch it is an item of (``keys.batch_key``; "" none)
    batch_index: int = 0  # its index among the batch's items

    @classmethod
    def from_hash(cls, job_id: str, raw: Mapping[Any, Any]) -> JobRecord:
        """The record of a job hash as Redis returns it (bytes or text keys and values)."""
        record = cls(job_id=job_id)
        for key, value in ((to_text(k), to_text(v)) for k, v in raw.items()):
            if key.startswith(TIMING_PREFIX):
                record.timings[key.removeprefix(TIMING_PREFIX)] = float(value)
            elif key.endswith(REACHED_SUFFIX) and key.removesuffix(REACHED_SUFFIX) in JOB_STATES:
                record.reached_at[key.removesuffix(REACHED_SUFFIX)] = float(value)
            elif key in _STORED_TYPES:
                setattr(record, key, _parse(_STORED_TYPES[key], value))
        return record

    def creation_fields(self) -> dict[str, str]:
        """The hash fields of a new record (status ``queued``), as text (a field without a value
        yet, ``None``, is left out)."""
        now = self.created_at
        values = {
            name: value
            for name, value in asdict(self).items()
            if name not in ("job_id", "reached_at", "timings") and value is not None
        }
        values |= {"updated_at": now, f"queued{REACHED_SUFFIX}": now}
        return {name: _format(value) for name, value in values.items()}

    def as_dict(self) -> dict[str, Any]:
        """The record as the API shows it: typed values, ``<status>_at`` flattened; a field of
        ``UNSET_JOB_FIELDS`` only once it has a value."""
        shown = asdict(self)
        reached = shown.pop("reached_at")
        for name, unset in UNSET_JOB_FIELDS.items():
            if shown[name] == unset:
                del shown[name]
        if "batch_id" not in shown:  # index 0 is an item's too: shown with its batch only
            del shown["batch_index"]
        return shown | {f"{status}{REACHED_SUFFIX}": at for status, at in reached.items()}


# fields a record has only once something set them (their default means "none yet"): left out of
# what the API shows until then
UNSET_JOB_FIELDS: dict[str, object] = {
    "queue_position": 0,
    "predicted_start": 0.0,
    "predicted_finish": 0.0,
    "met_deadline": None,
    "batch_id": "",
}


# what the services keep in a record for themselves, never shown to a client: blob refs (the API
# gives URLs instead), the owner's digest, the post-processing guard
INTERNAL_JOB_FIELDS = frozenset(
    {"template_ref", "mask_ref", "result_ref", "thumbnail_ref", "owner", "denoised"}
)


# field -> the type of its value, from the defaults (the hash stores every value as text)
_STORED_TYPES: dict[str, type] = {
    name: type(value)
    for name, value in asdict(JobRecord(job_id="")).items()
    if name not in ("job_id", "timings", "reached_at")
} | {"met_deadline": bool}


def _parse(kind: type, text: str) -> object:
    if kind is bool:
        return text not in ("0", "False", "false", "")
    if kind is int:
        return int(float(text))
    if kind in (dict, list):
        return json.loads(text)
    return kind(text)  # float, str


def _format(value: object) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


# a worker's forecast on its events (1.6): the record keeps the latest value given (0: none)
FORECAST_FIELDS = ("queue_position", "predicted_start", "predicted_finish")


def event_fields(event: JobEvent) -> dict[str, str]:
    """The hash fields an event sets on its job's record, as text. Never the ``preview``: the
    record stays small; previews live on the event stream only."""
    values: dict[str, object] = {"status": event.status, "updated_at": event.at}
    if event.num_steps:
        values |= {"step": event.step, "num_steps": event.num_steps}
    for name in ("worker_id", "message", "result_ref", "thumbnail_ref", *FORECAST_FIELDS):
        if getattr(event, name):  # a forecast: the latest one given (0: none)
            values[name] = getattr(event, name)
    if event.adapter_steps:
        values["adapter_steps"] = json.dumps(event.adapter_steps)
    values |= {f"{TIMING_PREFIX}{stage}": seconds for stage, seconds in event.timings.items()}
    return {name: str(value) for name, value in values.items()}


def event_payload(event: JobEvent) -> dict[str, Any]:
    """An event as the job's event stream (and the API's server-sent events) carry it: the
    status and time always, other fields only when set. A failed or cancelled event's timings are
    the job's, added by ``jobstate`` when it records the event (``DERIVED_TIMINGS``)."""
    payload: dict[str, Any] = {"status": event.status, "at": event.at}
    shown = ("step", "num_steps", "worker_id", "message", "result_ref", "thumbnail_ref")
    for name in (*shown, *FORECAST_FIELDS):
        if getattr(event, name):
            payload[name] = getattr(event, name)
    if event.timings and event.status not in DERIVED_TIMINGS:
        payload["timings"] = event.timings
    if event.status == "running" and PREVIEW_URL.fullmatch(event.preview):
        payload["preview"] = event.preview  # last: ``jobstate`` cuts it out when the job moves on
    return payload


# a live preview as the event stream carries it (no quote or escape: ``jobstate`` cuts it out of
# the stored JSON text)
PREVIEW_URL = re.compile(r"data:image/png;base64,[A-Za-z0-9+/]+={0,2}")


@dataclass(frozen=True)
class BatchRecord:
    """A batch as stored (``keys.batch_key``): written once at submission and never changed; how
    far it got is its items' job records (``backend.api.batch_progress``)."""

    batch_id: str
    owner: str  # the submitting tenant's digest, like a job's: only it sees the batch
    created_at: float
    job_ids: tuple[str, ...]  # item i's job is job_ids[i]
    template_id: str = ""  # the gallery template its items edit; "" for an upload
    model_id: str = ""
    listed_for: str = ""  # whose batch list shows it (a studio user); "" the owner's

    def fields(self) -> dict[str, str]:
        """The hash fields, as text."""
        values = asdict(self) | {"job_ids": json.dumps(list(self.job_ids))}
        return {name: _format(value) for name, value in values.items()}

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> BatchRecord:
        """The record of a batch hash as Redis returns it; fields it does not know are ignored."""
        values = {to_text(k): to_text(v) for k, v in raw.items()}
        return cls(
            batch_id=values["batch_id"],
            owner=values.get("owner", ""),
            created_at=float(values.get("created_at", 0.0)),
            job_ids=tuple(json.loads(values.get("job_ids", "[]"))),
            template_id=values.get("template_id", ""),
            model_id=values.get("model_id", ""),
            listed_for=values.get("listed_for", ""),
        )

"""The adapter-ingest messages between the API and a CPU worker, in the wire format of
``backend.protocol.messages`` (same envelope, same version rule, same typed decoding).

The API stages an upload as a blob and sends ``IngestAdapter`` as the argument of the
``keys.ADAPTER_INGEST_TASK`` Celery task; the CPU worker answers one ``AdapterIngested`` on
``keys.adapter_reply_key(request_id)``, which the API waits on. Invariant: a worker acts on a
request only before its ``deadline`` (after it the API has answered 503 and removed the staged
blob), so a late task writes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from backend.protocol.fieldtypes import conform_fields
from backend.protocol.messages import PROTOCOL_VERSION, SCHEMA_MAJOR, ProtocolError, _major


@dataclass(frozen=True)
class IngestAdapter:
    """Read, validate and normalize an uploaded adapter (API -> CPU worker)."""

    TYPE: ClassVar[str] = "ingest_adapter"
    request_id: str
    upload_ref: str  # blob ref of the uploaded file
    normalized_ref: str  # blob ref the worker writes the normalized adapter to
    model_id: str
    max_rank: int
    deadline: float  # seconds since the epoch; past it the worker does nothing


@dataclass(frozen=True)
class AdapterIngested:
    """The worker's answer (CPU worker -> API): the normalized adapter's facts, or why not."""

    TYPE: ClassVar[str] = "adapter_ingested"
    request_id: str
    ok: bool
    error: str = ""  # what the user must fix (when not ok)
    code: str = ""  # invalid | unsupported_format | unavailable (when not ok)
    family: str = ""
    model_id: str = ""
    source_layout: str = ""  # peft | kohya
    ranks: dict[str, int] = field(default_factory=dict)  # module -> rank
    nbytes: int = 0  # bytes of the pairs' tensors


AdapterMessage = IngestAdapter | AdapterIngested
_M = TypeVar("_M", IngestAdapter, AdapterIngested)


def encode_adapter_message(message: AdapterMessage) -> str:
    payload: dict[str, Any] = {"type": message.TYPE, "version": PROTOCOL_VERSION}
    payload |= {f.name: getattr(message, f.name) for f in fields(message)}
    return json.dumps(payload, separators=(",", ":"), sort_keys=True)


def decode_adapter_message(text: str | bytes, expected: type[_M]) -> _M:
    """The message of type ``expected``; ProtocolError when it is not one (fields it does not
    know are ignored, like ``messages.decode`` does)."""
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"adapter message is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ProtocolError("adapter message must be a JSON object")
    if _major(payload.get("version")) != SCHEMA_MAJOR:
        raise ProtocolError(f"adapter message version {payload.get('version')!r}")
    if payload.get("type") != expected.TYPE:
        raise ProtocolError(f"expected a {expected.TYPE}, got {payload.get('type')!r}")
    names = {f.name for f in fields(expected)}
    try:
        return expected(
            **conform_fields(expected, {k: v for k, v in payload.items() if k in names})
        )
    except TypeError as exc:
        raise ProtocolError(f"{expected.TYPE}: {exc}") from None

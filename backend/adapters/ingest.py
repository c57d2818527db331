"""The CPU worker's side of an adapter upload (the ``keys.ADAPTER_INGEST_TASK`` task body): read
the staged file through diffusers, validate it against the model's layers, write it normalized,
and answer the waiting API on ``keys.adapter_reply_key``.

Invariants: every request that is decodable and not past its deadline gets exactly one answer
(a user error says what to fix; an unexpected error says what failed); past the deadline nothing is
written and nothing answered (the API has answered 503 and removed the staged blob).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from redis import Redis

from backend.adapters.files import AdapterFileError, NormalizedMeta, read_for_model, save_normalized
from backend.blobs import BlobError, BlobMissing, BlobStore
from backend.models import UnknownModelError, resolve_model
from backend.protocol.adapters import (
    AdapterIngested,
    IngestAdapter,
    decode_adapter_message,
    encode_adapter_message,
)
from backend.protocol.keys import adapter_reply_key
from backend.protocol.messages import ProtocolError

log = logging.getLogger(__name__)

REPLY_TTL_S = 300  # an answer nobody read (the API gave up) expires


def ingest(
    message: IngestAdapter, blobs: BlobStore, now: Callable[[], float] = time.time
) -> AdapterIngested | None:
    """Read, validate and normalize the staged upload; None when past the deadline."""
    if now() > message.deadline:
        return None

    def refused(error: str, code: str = "invalid") -> AdapterIngested:
        return AdapterIngested(request_id=message.request_id, ok=False, error=error, code=code)

    try:
        family = resolve_model(message.model_id).family
        with blobs.reading(message.upload_ref) as upload:
            read = read_for_model(upload, message.model_id, max_rank=message.max_rank)
        if now() > message.deadline:
            return None
        meta = NormalizedMeta(family, message.model_id, read.source_layout)
        kind, _, name = blobs.checked(message.normalized_ref).partition("/")
        with blobs.writing(kind, name) as (_ref, path):
            save_normalized(read.adapter, meta, path)
    except BlobMissing:
        return refused("the staged upload is gone: upload the adapter again", "unavailable")
    except AdapterFileError as exc:
        return refused(str(exc), exc.code)
    except (UnknownModelError, BlobError) as exc:
        return refused(str(exc))
    return AdapterIngested(
        request_id=message.request_id,
        ok=True,
        family=family,
        model_id=message.model_id,
        source_layout=read.source_layout,
        ranks={module: pair.rank for module, pair in read.adapter.pairs.items()},
        nbytes=read.adapter.nbytes,
    )


def answer(client: Redis, reply: AdapterIngested) -> None:
    key = adapter_reply_key(reply.request_id)
    with client.pipeline(transaction=True) as pipe:
        pipe.rpush(key, encode_adapter_message(reply))
        pipe.expire(key, REPLY_TTL_S)
        pipe.execute()


def run_ingest_task(client: Redis, blobs: BlobStore, text: str) -> None:
    """The task: decode, ingest, answer. An undecodable request is logged (it names no one to
    answer); an unexpected failure is answered with what failed."""
    try:
        message = decode_adapter_message(text, IngestAdapter)
    except ProtocolError as exc:
        log.error("unreadable adapter ingest request: %s", exc)
        return
    try:
        reply = ingest(message, blobs)
    except Exception as exc:  # a bug or an adapter diffusers chokes on: the API must not wait
        log.exception("ingesting adapter upload %s failed", message.request_id)
        reply = AdapterIngested(
            request_id=message.request_id,
            ok=False,
            error=f"the adapter could not be read: {type(exc).__name__}: {exc}",
            code="invalid",
        )
    if reply is None:
        log.info("adapter upload %s skipped: past its deadline", message.request_id)
        return
    answer(client, reply)

"""The API's side of an adapter upload: stage the file, have a CPU worker ingest it, store it.

No torch here (the API never imports a model library): reading the file through diffusers runs in
a CPU worker (``backend.adapters.ingest``), asked over Celery and answered on a Redis key
(``backend.protocol.adapters``).

Invariants:
* nothing is stored on any error: the record is written only after the worker's answer is ok,
  and the staged upload and the normalized file are removed whatever happens;
* an upload over ``adapters.max_mb`` is refused (``too_large``) while it is being staged, before a
  worker sees it;
* the API waits at most ``adapters.ingest_timeout_s`` for a worker; then ``unavailable`` (503),
  saying that no CPU worker answered. The request carries that deadline, so a worker that takes it
  later does nothing.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import BinaryIO

from kombu.exceptions import OperationalError as BrokerError
from redis import Redis

from backend.adapters.container import safetensors_keys
from backend.adapters.store import (
    AdapterError,
    AdapterFacts,
    AdapterRecord,
    AdapterStore,
    adapter_name,
)
from backend.blobs import BlobStore
from backend.config import Settings
from backend.protocol.adapters import (
    AdapterIngested,
    IngestAdapter,
    decode_adapter_message,
    encode_adapter_message,
)
from backend.protocol.keys import ADAPTER_INGEST_TASK, adapter_reply_key
from backend.protocol.messages import ProtocolError

MB = 2**20
CHUNK = 1 << 20
WAIT_SLICE_S = 1  # one blocking read of the reply key; below the API client's socket timeout


class AdapterService:
    def __init__(
        self,
        settings: Settings,
        client: Redis,
        celery_app,
        blobs: BlobStore,
        store: AdapterStore,
        model_of: Callable[[str], object],
    ):
        """``model_of(model_id)``: the API's own model check (raises its 4xx for an unknown or
        unserved model id), so adapters are registered for the models jobs may name."""
        self.settings, self.client, self.celery_app = settings, client, celery_app
        self.blobs, self.store, self._model_of = blobs, store, model_of
        self.max_bytes = int(settings.adapters.max_mb * MB)

    def add(self, upload: BinaryIO, name: str, model: str | None, owner: str) -> AdapterRecord:
        """Register one of ``owner``'s adapter files for ``model`` (None: the default model).
        Raises AdapterError (``code``: invalid, unsupported_format, too_large, unavailable)."""
        model_id = model or self.settings.engine.model_id
        self._model_of(model_id)
        name = adapter_name(name)
        request_id = uuid.uuid4().hex
        staged = f"adapter-{request_id}.safetensors"
        upload_ref = self.blobs.ref("uploads", staged)
        normalized_ref = self.blobs.ref("uploads", f"adapter-{request_id}.normalized.safetensors")
        try:
            with self.blobs.writing("uploads", staged) as (_ref, path):
                self._stage(upload, path)  # stored when staged whole, nothing when refused
            reply = self._ingest(
                IngestAdapter(
                    request_id=request_id,
                    upload_ref=upload_ref,
                    normalized_ref=normalized_ref,
                    model_id=model_id,
                    max_rank=self.settings.adapters.max_rank,
                    deadline=time.time() + self.settings.adapters.ingest_timeout_s,
                )
            )
            if not reply.ok:
                raise AdapterError(reply.error, reply.code or "invalid")
            facts = AdapterFacts(
                reply.family, reply.model_id, reply.source_layout, reply.ranks, reply.nbytes
            )
            with self.blobs.reading(normalized_ref) as normalized:
                return self.store.add(normalized, facts, name, owner)
        finally:
            self.blobs.delete(upload_ref)
            self.blobs.delete(normalized_ref)

    def _stage(self, upload: BinaryIO, path) -> None:
        written = 0
        with open(path, "wb") as out:
            for chunk in iter(lambda: upload.read(CHUNK), b""):
                written += len(chunk)
                if written > self.max_bytes:
                    raise AdapterError(
                        f"adapter file is over this deployment's limit of "
                        f"{self.settings.adapters.max_mb:g} MB: use a smaller adapter (a lower "
                        "rank, or fewer layers)",
                        "too_large",
                    )
                out.write(chunk)
        if written == 0:
            raise AdapterError("the adapter file is empty: upload its .safetensors file")
        # not a safetensors container: refused here, before a CPU worker sees it (whether its
        # tensors are a LoRA of the model is the worker's to say)
        safetensors_keys(path)

    def _ingest(self, request: IngestAdapter) -> AdapterIngested:
        """Send the request to a CPU worker and wait for its answer until the deadline."""
        key = adapter_reply_key(request.request_id)
        try:
            self.celery_app.send_task(
                ADAPTER_INGEST_TASK,
                args=[encode_adapter_message(request)],
                queue=self.settings.celery.pre_queue,
            )
        except BrokerError as exc:
            raise AdapterError(
                f"the task queue is unavailable ({exc}): try again shortly", "unavailable"
            ) from exc
        try:
            while (left := request.deadline - time.time()) > 0:
                popped = self.client.blpop([key], timeout=min(WAIT_SLICE_S, math.ceil(left)))
                if popped is not None:
                    return decode_adapter_message(popped[1], AdapterIngested)
        except ProtocolError as exc:
            raise AdapterError(f"a CPU worker answered unreadably: {exc}", "unavailable") from None
        finally:
            self.client.delete(key)
        raise AdapterError(
            f"no CPU worker answered within {self.settings.adapters.ingest_timeout_s:g} s: the "
            "adapter is read and validated by a CPU worker (maskserve cpu-worker); start one, or "
            "try again when they are less busy",
            "unavailable",
        )

"""``/v1/batches``: one template edited with many masks and/or prompts in one call.

Submit a batch, read its overall and per-item progress, follow its events, cancel its unfinished
items, download every finished result as a zip. Every item is an ordinary job (``/v1/jobs/{id}``);
a batch belongs to the key that submitted it: another key gets 404, like for an id that never
existed (``backend.api.batches``).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, Security, UploadFile
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from backend.api.batch_items import PairingError, pair_items
from backend.api.batch_progress import FINISHED, BatchTracker
from backend.api.batches import BatchItem, BatchRequest, BatchService, iter_chunks
from backend.api.checks import ServiceError
from backend.api.edit_form import edit_form
from backend.api.errors import ADMISSION_REFUSED, ERROR_RESPONSES
from backend.api.routes_jobs import BLOCK_SLICE_MS, SSE_RETRY_MS, _run, job_links, public_event
from backend.api.security import api_key_query
from backend.api.submission import JobRequest

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=ERROR_RESPONSES)
ZIP_SPOOL_BYTES = 32 * 2**20  # a zip larger than this is spooled to a temporary file


class BatchItemAccepted(BaseModel):
    index: int = Field(description="The item's index (0 first)")
    job_id: str
    seed: int = Field(description="The seed it runs with (seed + index when a seed was given)")
    status_url: str
    events_url: str
    result_url: str


class BatchAccepted(BaseModel):
    """A submitted batch: its id and every item's job at once; follow ``status_url`` or
    ``events_url``."""

    batch_id: str
    status: Literal["queued"]
    model: str = Field(description="The model its items run on")
    steps: int
    items: list[BatchItemAccepted]
    status_url: str = Field(description="The batch (GET), or cancel it (DELETE)")
    events_url: str = Field(description="Its server-sent events (GET)")
    results_url: str = Field(description="Its finished results as a zip (GET)")


def _batches(request: Request) -> BatchService:
    return request.app.state.batches


def _owner(request: Request) -> str:
    return request.state.caller.owner


def batch_links(batch_id: str) -> dict:
    base = f"/v1/batches/{batch_id}"
    return {
        "status_url": base,
        "events_url": f"{base}/events",
        "results_url": f"{base}/results.zip",
    }


def public_batch(batch: dict) -> dict:
    """A batch as a client sees it: each item with its job's links."""
    items = [item | job_links(item["job_id"], item["status"] == "done") for item in batch["items"]]
    return batch | {"items": items} | batch_links(batch["batch_id"])


def batch_items(
    masks: list[bytes], prompts: list[str], shared_mask: bytes | None
) -> tuple[BatchItem, ...]:
    """The items of a form's masks and prompts (``batch_items.pair_items``'s rules)."""
    try:
        pairs = pair_items(len(masks), len(prompts), bool(shared_mask))
    except PairingError as exc:
        raise ServiceError(str(exc)) from None
    return tuple(
        BatchItem(
            mask=None if m is None else masks[m],
            prompt=None if p is None else prompts[p],
        )
        for m, p in pairs
    )


@router.post(
    "",
    status_code=202,
    summary="Submit a batch: one template, many masks and/or prompts (returns at once)",
    response_model=None,
    responses={
        202: {"model": BatchAccepted, "description": "Accepted: follow its status_url"},
        429: ADMISSION_REFUSED,
    },
)
def submit_batch(
    request: Request,
    masks: list[UploadFile] = File(
        [],
        description="One mask file per item (repeat the field), each the image's size: white = "
        "repaint, black = keep",
    ),
    prompts: list[str] = Form(
        [], description="One prompt per item (repeat the field); see docs/api.md for pairing"
    ),
    mask: UploadFile | None = File(
        None, description="One mask for every item (with a prompts list)"
    ),
    prompt: str = Form("", description="The prompt of items that have none of their own"),
    image: UploadFile | None = File(None, description="The image to edit (or give template_id)"),
    template_id: str | None = Form(
        None, description="A gallery template to edit (or upload image)"
    ),
    params: dict = Depends(edit_form),
) -> JSONResponse:
    shared_mask = mask.file.read() if mask is not None else b""
    items = batch_items([m.file.read() for m in masks], list(prompts), shared_mask)
    shared = JobRequest(
        mask=shared_mask,
        prompt=prompt,
        image=None if image is None else image.file.read(),
        template_id=template_id or None,
        owner=_owner(request),
        **params,
    )
    submitted = _batches(request).submit(BatchRequest(shared, items))
    request.app.state.metrics.jobs_submitted.labels(submitted.model_id, "rest").inc(
        len(submitted.job_ids)
    )
    body = {
        "batch_id": submitted.batch_id,
        "status": "queued",
        "model": submitted.model_id,
        "steps": submitted.steps,
        "items": [
            {"index": i, "job_id": job_id, "seed": seed} | job_links(job_id)
            for i, (job_id, seed) in enumerate(zip(submitted.job_ids, submitted.seeds))
        ],
        **batch_links(submitted.batch_id),
    }
    return JSONResponse(body, status_code=202, headers={"Location": body["status_url"]})


@router.get("", summary="The caller's own batches, newest first")
def list_batches(
    request: Request, limit: int = Query(20, ge=1, le=200, description="At most this many")
) -> dict:
    batches = _batches(request).history(_owner(request), limit)
    return {"batches": [public_batch(batch) for batch in batches]}


@router.get("/{batch_id}", summary="A batch's overall and per-item status and progress")
def get_batch(request: Request, batch_id: str) -> dict:
    return public_batch(_batches(request).get(batch_id, _owner(request)))


@router.delete("/{batch_id}", summary="Cancel every unfinished item of a batch")
def cancel_batch(request: Request, batch_id: str) -> dict:
    return {"batch_id": batch_id, **_batches(request).cancel(batch_id, _owner(request))}


@router.get(
    "/{batch_id}/results.zip",
    summary="Every finished result as a zip (<index>.png) with a manifest of every item",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/zip": {}}}},
)
def batch_results(request: Request, batch_id: str) -> StreamingResponse:
    spool = tempfile.SpooledTemporaryFile(max_size=ZIP_SPOOL_BYTES)  # closed once streamed
    try:
        _batches(request).write_zip(batch_id, _owner(request), spool)
    except BaseException:
        spool.close()
        raise

    def chunks():
        with spool:
            yield from iter_chunks(spool)

    return StreamingResponse(
        chunks(),
        media_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="batch-{batch_id}.zip"'},
    )


@router.get(
    "/{batch_id}/events",
    summary="Server-sent events of a batch: every item's events and the batch's progress",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
    dependencies=[Security(api_key_query)],
)
async def batch_events(request: Request, batch_id: str):
    """Replays every item's events from the start, then sends new ones as they happen; after
    each read, a ``batch`` message with the overall progress. Messages: ``data`` = JSON with
    ``type`` ``item`` (``index``, ``job_id`` and the job's event, previews left out) or ``batch``
    (``status``, ``total``, ``finished``, ``counts``, ``progress``). The stream ends once every
    item finished. A reconnect replays from the start."""
    service, app_state, owner = _batches(request), request.app.state, _owner(request)
    tracker = await _run(app_state, service.tracker, batch_id, owner)  # 404 before the stream
    stream = _batch_stream(app_state, service, batch_id, tracker)
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _batch_stream(
    app_state, service: BatchService, batch_id: str, tracker: BatchTracker
) -> AsyncIterator[str]:
    """Reads the items' event streams in slices (``routes_jobs._event_stream`` says why). When a
    read finds nothing, the items whose records say they finished are read once more without
    waiting (a terminal event that came after the read), and any still open then is settled from
    its record (expired, or its stream trimmed), so the stream always ends."""
    yield f"retry: {SSE_RETRY_MS}\n\n"
    cursors = {item.job_id: "0" for item in tracker.items}
    keepalive_s = app_state.settings.api.sse_keepalive_s
    block_ms = max(1, min(BLOCK_SLICE_MS, int(keepalive_s * 1000)))
    yield _summary(batch_id, tracker)
    last_sent, wait = time.monotonic(), None  # the first read replays without waiting
    while not tracker.finished:
        entries = await _run(app_state, service.events, cursors, wait)
        wait, ended = block_ms, {}
        if not entries:  # did an item end without a further event?
            statuses = await _run(app_state, service.job_statuses, list(cursors))
            ended = {job_id: s for job_id, s in statuses.items() if s in FINISHED}
            late = {job_id: cursors[job_id] for job_id in ended}
            entries = await _run(app_state, service.events, late, None) if late else []
        for job_id, event_id, event in entries:
            cursors[job_id] = event_id
            yield _item(tracker, job_id, event)
        for job_id, status in ended.items():  # settled from its record: no event says it
            if not tracker.items[tracker.index(job_id)].finished:
                yield _item(tracker, job_id, {"status": status})
        for job_id in [j for j in cursors if tracker.items[tracker.index(j)].finished]:
            cursors.pop(job_id)
        if entries or ended:
            yield _summary(batch_id, tracker)
            last_sent = time.monotonic()
        elif time.monotonic() - last_sent >= keepalive_s:
            yield ": keep-alive\n\n"
            last_sent = time.monotonic()


def _item(tracker: BatchTracker, job_id: str, event: dict) -> str:
    item = tracker.apply(job_id, event)
    event.pop("preview", None)  # a batch's stream stays small: previews are per job
    return _data(
        {"type": "item", "index": item.index, "job_id": job_id, **public_event(job_id, event)}
    )


def _summary(batch_id: str, tracker: BatchTracker) -> str:
    return _data({"type": "batch", "batch_id": batch_id, **tracker.summary()})


def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"

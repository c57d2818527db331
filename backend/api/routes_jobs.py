"""``/v1/jobs``: submit an edit, read its state, follow its events, fetch its result, cancel it.

Every route is about ONE job: there is no global progress and no global interrupt. Every job
belongs to the key that submitted it (``request.state.caller.owner``): another key gets 404, like
for an id that never existed.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Depends, File, Form, Header, Query, Request, Security, UploadFile
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from backend.api.edit_form import edit_form
from backend.api.errors import ADMISSION_REFUSED, ERROR_RESPONSES
from backend.api.schemas import JobAccepted, JobCancelled, JobList, JobView
from backend.api.security import api_key_query
from backend.api.service import JobRequest, JobService
from backend.jobstate import TERMINAL
from backend.protocol import INTERNAL_JOB_FIELDS

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)
SSE_RETRY_MS = 3000  # how long a browser's EventSource waits before it reconnects
BLOCK_SLICE_MS = 1000  # longest single blocking read of a job's events


def _service(request: Request) -> JobService:
    return request.app.state.service


def _owner(request: Request) -> str:
    return request.state.caller.owner


def job_links(job_id: str, done: bool = False) -> dict:
    base = f"/v1/jobs/{job_id}"
    links = {"status_url": base, "events_url": f"{base}/events", "result_url": f"{base}/result"}
    if done:
        links["thumbnail_url"] = f"{base}/result?thumbnail=1"
    return links


# the blob references a done event carries -> the link a client fetches each from
EVENT_REFS = {"result_ref": "result_url", "thumbnail_ref": "thumbnail_url"}


def public_event(job_id: str, event: dict) -> dict:
    """An event as a client sees it (the job's and a batch's event streams): a done event's blob
    references replaced by the URLs of its result and thumbnail (fetched with the same key)."""
    links = job_links(job_id, done=True)
    shown = {name: value for name, value in event.items() if name not in EVENT_REFS}
    return shown | {link: links[link] for ref, link in EVENT_REFS.items() if event.get(ref)}


def public_job(job: dict) -> dict:
    """A job as a client sees it (``schemas.JobView``): the record without the services' own
    fields, with its links."""
    shown = {name: value for name, value in job.items() if name not in INTERNAL_JOB_FIELDS}
    return shown | job_links(job["job_id"], done=job["status"] == "done")


def _read(upload: UploadFile | None) -> bytes | None:
    return None if upload is None else upload.file.read()


@router.post(
    "",
    status_code=202,
    summary="Submit an edit (returns at once)",
    response_model=None,
    responses={
        202: {"model": JobAccepted, "description": "Accepted: follow its status_url"},
        429: ADMISSION_REFUSED,
    },
)
def submit_job(
    request: Request,
    mask: UploadFile = File(
        ...,
        description="Mask, same size as the image: white (or any bright colour) = repaint, "
        "black = keep (or RGBA, painted area in alpha)",
    ),
    image: UploadFile | None = File(None, description="The image to edit (or give template_id)"),
    template_id: str | None = Form(
        None, description="A gallery template to edit (or upload image)"
    ),
    prompt: str = Form("", description="What to paint in the masked area"),
    params: dict = Depends(edit_form),
) -> JSONResponse:
    job_request = JobRequest(
        mask=_read(mask) or b"",
        image=_read(image),
        template_id=template_id or None,
        prompt=prompt,
        owner=_owner(request),
        **params,
    )
    submitted = _service(request).submit(job_request)
    request.app.state.metrics.jobs_submitted.labels(submitted.model_id, "rest").inc()
    body = {
        "job_id": submitted.job_id,
        "seed": submitted.seed,
        "model": submitted.model_id,
        "steps": submitted.steps,
        "status": "queued",
        **job_links(submitted.job_id),
    }
    return JSONResponse(body, status_code=202, headers={"Location": body["status_url"]})


@router.get(
    "",
    summary="The caller's own jobs, newest first (submitted with this API key)",
    response_model=JobList,
    response_model_exclude_unset=True,
)
def list_jobs(
    request: Request, limit: int = Query(50, ge=1, le=500, description="At most this many")
) -> dict:
    jobs = _service(request).history(_owner(request), limit)
    return {"jobs": [public_job(job) for job in jobs]}


@router.get(
    "/{job_id}",
    summary="A job's status, step, seed, timings and links",
    response_model=JobView,
    response_model_exclude_unset=True,
)
def get_job(request: Request, job_id: str) -> dict:
    return public_job(_service(request).get(job_id, _owner(request)))


@router.get(
    "/{job_id}/result",
    summary="The result (PNG), or its thumbnail (WebP) with ?thumbnail=1",
    response_class=FileResponse,
)
def job_result(request: Request, job_id: str, thumbnail: bool = Query(False)) -> FileResponse:
    service, owner = _service(request), _owner(request)
    if thumbnail:
        return FileResponse(service.thumbnail_path(job_id, owner), media_type="image/webp")
    return FileResponse(
        service.result_path(job_id, owner),
        media_type="image/png",
        filename=f"{job_id}.png",
        content_disposition_type="inline",
    )


@router.delete(
    "/{job_id}",
    summary="Cancel a job (queued: dropped; running: leaves its batch at the next step)",
    response_model=JobCancelled,
)
def cancel_job(request: Request, job_id: str) -> dict:
    return {"job_id": job_id, **_service(request).cancel(job_id, _owner(request))}


# the one route that takes the key as ?api_key= too: a browser's EventSource cannot send headers
@router.get(
    "/{job_id}/events",
    summary="Server-sent events of one job",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
    dependencies=[Security(api_key_query)],
)
async def job_events(
    request: Request,
    job_id: str,
    last_event_id: str | None = Header(None, alias="Last-Event-ID"),
    after: str | None = Query(None, description="Replay after this event id (default: all)"),
):
    """Replays the job's events from the start (or after ``Last-Event-ID`` / ``after``), then sends
    new ones as they happen; the stream ends after a terminal status (done, failed, cancelled).
    Each message: ``id`` = the event id, ``data`` = the event as JSON. Comment lines keep an idle
    connection open."""
    service, app_state, owner = _service(request), request.app.state, _owner(request)
    start = last_event_id or after or "0"
    # 404 before the stream starts (another owner's job too); validates ``start`` too
    first = await _run(app_state, service.events, job_id, owner, start, None)
    stream = _event_stream(
        app_state, service, job_id, start, first, app_state.settings.api.sse_keepalive_s
    )
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _run(app_state, func, *args):
    """A blocking Redis call on a thread of the event streams' own pool: streams waiting on Redis
    never starve the pool the other (sync) routes run on."""
    return await anyio.to_thread.run_sync(
        lambda: func(*args), limiter=app_state.sse_limiter, abandon_on_cancel=True
    )


async def _event_stream(
    app_state, service: JobService, job_id: str, cursor: str, entries: list, keepalive_s: float
) -> AsyncIterator[str]:
    """Blocking reads are sliced (``BLOCK_SLICE_MS``): a Redis client's socket timeout (5 s by
    default in redis-py) must never cut a read short, and an idle stream notices within a slice when
    its job ended without a further event (expired, or finished at or before ``cursor``). The job's
    owner was checked before the stream started, so it reads the job state directly."""
    yield f"retry: {SSE_RETRY_MS}\n\n"
    last_sent = time.monotonic()
    while True:
        for event_id, event in entries:
            cursor = event_id
            yield _message(job_id, event_id, event)
            last_sent = time.monotonic()
            if event.get("status") in TERMINAL:
                return
        if not entries:
            status = await _run(app_state, service.jobstate.status, job_id)
            if status is None or status in TERMINAL:
                late = await _run(app_state, service.jobstate.events, job_id, cursor, None)
                for event_id, event in late:
                    # a terminal event that came after our read
                    yield _message(job_id, event_id, event)
                return
            if time.monotonic() - last_sent >= keepalive_s:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
        block_ms = max(1, min(BLOCK_SLICE_MS, int(keepalive_s * 1000)))
        entries = await _run(app_state, service.jobstate.events, job_id, cursor, block_ms)


def _message(job_id: str, event_id: str, event: dict) -> str:
    data = {"job_id": job_id, **public_event(job_id, event)}
    return f"id: {event_id}\ndata: {json.dumps(data)}\n\n"

"""``POST /v1/images/edits``: OpenAI's image-edit API, so the tools that speak it use MaskServe.

The call is checked and converted by ``openai_images`` (pure); one edit is submitted as a job
(``JobService``), ``n`` > 1 as a batch (``BatchService``: one template, one mask, seeds
``seed..seed+n-1``, one cache read shared by all), and the answer waits for them: ``{created,
data: [{url | b64_json}], size, output_format, job_ids}``, in seed order. Errors are in OpenAI's
shape (``openai_errors``; its middleware reshapes the errors that the shared parts of the API
raise). Docs: docs/openai.md.

Invariants: nothing is stored before every field, the image and the mask are checked (the job
service validates the rest before it stores anything); a job submitted is never lost: when the
wait (``api.openai_wait_s``) runs out or an edit fails, the error names every job id, whose
records and results stay under ``/v1/jobs``; ``url``s are absolute, built from the request's base
URL, and need the same key as the call.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.datastructures import UploadFile

from backend.api.adapter_requests import FORM_HELP, parse_choices
from backend.api.batches import BatchItem, BatchRequest, BatchService
from backend.api.openai_errors import NO_RETRY, OPENAI_ERROR_RESPONSES, OpenAIError
from backend.api.openai_images import (
    EXTRA_FIELDS,
    MAX_N,
    RESPONSE_FORMATS,
    SIZES,
    EditCall,
    EditImages,
    edit_images,
    first_seed,
    parse_edit,
)
from backend.api.service import JobRequest, JobService
from backend.jobstate import TERMINAL
from templates_store.store import TemplateNotFound

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/images", tags=["openai"], responses=OPENAI_ERROR_RESPONSES)
POLL_S = 0.1  # how often a waiting call looks at its jobs' status (one Redis read each)
MAX_FORM_FILES = 16  # OpenAI takes up to 16 images; the first is edited


class ImageData(BaseModel):
    url: str | None = None
    """Our result endpoint (``GET /v1/jobs/{job_id}/result``): send the same key to fetch it."""
    b64_json: str | None = None
    """The PNG, base64-encoded."""


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    size: str
    """The results' WIDTHxHEIGHT."""
    output_format: str = "png"
    job_ids: list[str]
    """MaskServe's jobs, in the order of ``data`` (``GET /v1/jobs/{job_id}``)."""
    batch_id: str | None = None
    """With n > 1: the batch of those jobs (``GET /v1/batches/{batch_id}``)."""
    warnings: list[str] | None = None
    """What was not done as sent (several images: the first is edited)."""


_FILE = {"type": "string", "format": "binary"}
_FORM_SCHEMA = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "image": {**_FILE, "description": "PNG, JPEG or WebP to edit (or image[]: the first)"},
        "image[]": {"type": "array", "items": _FILE},
        "mask": {**_FILE, "description": "PNG of the image's size: alpha 0 = edit here"},
        "prompt": {"type": "string"},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        "size": {"type": "string", "enum": list(SIZES)},
        "response_format": {"type": "string", "enum": list(RESPONSE_FORMATS)},
        "model": {
            "type": "string",
            "description": "A MaskServe model id; OpenAI names (dall-e-2, "
            "gpt-image-1, ...) mean the deployment's default",
        },
        "user": {"type": "string"},
        **{
            name: {"type": "string", "description": "MaskServe extra (extra_body)"}
            for name in EXTRA_FIELDS
        },
        "adapters": {"type": "string", "description": FORM_HELP},
    },
}


def _service(request: Request) -> JobService:
    return request.app.state.service


async def _form(request: Request) -> tuple[list[tuple[str, str]], list[tuple[str, bytes]]]:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise OpenAIError(
            "send the edit as multipart/form-data (image, mask, prompt, ...), as the openai "
            "client does"
        )
    pairs: list[tuple[str, str]] = []
    files: list[tuple[str, bytes]] = []
    async with request.form(max_files=MAX_FORM_FILES) as form:  # closes the spooled files
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                files.append((name, await value.read()))
            else:
                pairs.append((name, value))
    return pairs, files


@dataclass(frozen=True)
class Plan:
    """The edits of one call: ``n`` of ``request`` (its seed the first edit's; edit i runs with
    seed + i); ``size``: the results' (width, height)."""

    request: JobRequest
    n: int
    size: tuple[int, int]


def _template_size(service: JobService, template_id: str, owner: str) -> tuple[int, int]:
    try:
        record = service.templates.get(template_id, owner)
    except TemplateNotFound:
        raise OpenAIError(
            f"no gallery template {template_id[:64]!r}: upload it with POST /v1/templates or pick "
            "one of GET /v1/templates",
            status=404,
            param="template_id",
        ) from None
    return record.width, record.height


def plan(service: JobService, call: EditCall, owner: str) -> Plan:
    """The jobs of ``call`` (checked here as far as the call's own fields go; nothing stored)."""
    extras = dict(call.extras)
    template_id = extras.pop("template_id", None) or None
    template_size = None if template_id is None else _template_size(service, template_id, owner)
    images: EditImages = edit_images(call, service.settings.celery.max_upload_pixels, template_size)
    adapters = tuple(parse_choices(extras.pop("adapters", "")))
    seed = first_seed(extras.pop("seed", None), call.n)
    # what is left of the extras are JobRequest fields by the same names (steps, guidance, ...)
    request = JobRequest(
        mask=images.mask,
        prompt=call.prompt,
        template_id=template_id,
        image=images.image,
        model=call.model,
        resolution=images.resolution,
        adapters=adapters,
        owner=owner,
        seed=seed,
        **extras,
    )
    return Plan(request, call.n, images.size)


def submit(service: JobService, batches: BatchService, work: Plan) -> tuple[str | None, list[str]]:
    """(batch id, job ids): one edit is a job; n edits are a batch of n items on one template with
    the same mask and prompt (its seeds seed..seed+n-1), so they share the template's cache load
    and run in one running batch where slots allow. A refused call stores nothing."""
    if work.n == 1:
        return None, [service.submit(work.request).job_id]
    batch = batches.submit(BatchRequest(work.request, (BatchItem(),) * work.n))
    return batch.batch_id, list(batch.job_ids)


async def wait(service: JobService, job_ids: list[str], owner: str, timeout_s: float) -> list[dict]:
    """The records of ``job_ids`` once all are done; OpenAIError when one ends otherwise or the
    time runs out (naming every job id: none is lost)."""
    deadline = time.monotonic() + timeout_s
    for job_id in job_ids:
        while (status := await anyio.to_thread.run_sync(service.jobstate.status, job_id)) not in (
            *TERMINAL,
            None,
        ):
            if time.monotonic() >= deadline:
                raise OpenAIError(
                    f"the edits did not finish within {timeout_s:g} s (api.openai_wait_s); they "
                    "go on running: follow them with GET /v1/jobs/{job_id} and fetch each result "
                    "with GET /v1/jobs/{job_id}/result",
                    status=504,
                    code="timeout",
                    headers=NO_RETRY,
                    extra={"job_ids": job_ids},
                )
            await anyio.sleep(POLL_S)
        if status != "done":
            record = await anyio.to_thread.run_sync(service.get, job_id, owner)
            raise OpenAIError(
                f"edit {job_id} {record['status']}: {record.get('message') or 'no reason given'}",
                status=500,
                code=f"job_{record['status']}",
                headers=NO_RETRY,
                extra={"job_ids": job_ids},
            )
    return [await anyio.to_thread.run_sync(service.get, job_id, owner) for job_id in job_ids]


def _item(service: JobService, record: dict, response_format: str, base_url: str) -> dict:
    if response_format == "url":
        return {"url": f"{base_url}v1/jobs/{record['job_id']}/result"}
    return {"b64_json": base64.b64encode(service.blobs.get(record["result_ref"])).decode()}


@router.post(
    "/edits",
    summary="Edit an image (OpenAI-compatible; waits for the results)",
    response_model=ImagesResponse,
    response_model_exclude_none=True,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": _FORM_SCHEMA}},
        }
    },
)
async def create_edit(request: Request) -> JSONResponse:
    """OpenAI's ``images.edit``: the image's (or mask's) fully transparent pixels are edited, ``n``
    times, and the results come back once done. MaskServe's own parameters go in the client's
    ``extra_body``. See docs/openai.md."""
    try:
        return await _edit(request)
    except OpenAIError as exc:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _edit(request: Request) -> JSONResponse:
    service, owner = _service(request), request.state.caller.owner
    call = parse_edit(*await _form(request))
    work = await anyio.to_thread.run_sync(plan, service, call, owner)
    batch_id, job_ids = await anyio.to_thread.run_sync(
        submit, service, request.app.state.batches, work
    )
    model_id = work.request.model or service.settings.engine.model_id
    request.app.state.metrics.jobs_submitted.labels(model_id, "openai").inc(len(job_ids))
    # who asked (OpenAI's user / safety_identifier): recorded with the jobs it made
    log.info("openai edit for user %r: jobs %s", call.user[:128], ", ".join(job_ids))
    records = await wait(service, job_ids, owner, service.settings.api.openai_wait_s)
    base_url = str(request.base_url)
    data = [
        await anyio.to_thread.run_sync(_item, service, record, call.response_format, base_url)
        for record in records
    ]
    body = ImagesResponse(
        created=int(time.time()),
        data=[ImageData(**item) for item in data],
        size=f"{work.size[0]}x{work.size[1]}",
        job_ids=job_ids,
        batch_id=batch_id,
        warnings=list(call.warnings) or None,
    )
    return JSONResponse(body.model_dump(exclude_none=True))

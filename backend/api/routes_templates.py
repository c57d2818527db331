"""``/v1/templates``: the template gallery over REST (storage: ``templates_store.store``).

Every template belongs to the key that uploaded it (``request.state.caller.owner``): every route
names that owner, so another key's template is a 404 like an id that never existed."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlencode

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse, JSONResponse, Response

from backend.api.adapter_requests import FORM_HELP, parse_choices
from backend.api.errors import ERROR_RESPONSES
from templates_store.store import TemplateRecord, TemplateStore, split_tags

router = APIRouter(prefix="/v1/templates", tags=["templates"], responses=ERROR_RESPONSES)


def _store(request: Request) -> TemplateStore:
    return request.app.state.templates


def _owner(request: Request) -> str:
    return request.state.caller.owner


def template_view(record: TemplateRecord) -> dict:
    base = f"/v1/templates/{record.id}"
    return record.to_dict() | {
        "url": base,
        "image_url": f"{base}/image",
        "thumbnail_url": f"{base}/thumbnail",
    }


@router.post("", status_code=201, summary="Upload a template into the gallery")
def upload_template(
    request: Request,
    file: UploadFile = File(..., description="The image: PNG, JPEG, WebP or BMP"),
    name: str | None = Form(None, description="Display name (default: the file's name)"),
    tags: list[str] = Form([], description="Tags, comma-separated or repeated"),
) -> dict:
    data = file.file.read()
    display = name if name is not None else Path(file.filename or "").stem or "untitled"
    record = _store(request).add(data, display, _owner(request), split_tags(tags))
    return template_view(record)


@router.get("", summary="List templates, newest first")
def list_templates(
    request: Request,
    query: str = Query("", description="Name contains (case-insensitive)"),
    tag: str = Query("", description="Only templates with this tag"),
) -> dict:
    records = _store(request).list(_owner(request), query=query, tag=tag)
    return {"templates": [template_view(record) for record in records]}


@router.get("/{template_id}", summary="One template's record")
def get_template(request: Request, template_id: str) -> dict:
    return template_view(_store(request).get(template_id, _owner(request)))


@router.delete("/{template_id}", status_code=204, summary="Delete a template")
def delete_template(request: Request, template_id: str) -> Response:
    request.app.state.service.delete_template(template_id, _owner(request))
    return Response(status_code=204)


@router.get("/{template_id}/image", summary="The template image (PNG)", response_class=FileResponse)
def template_image(request: Request, template_id: str) -> FileResponse:
    return FileResponse(
        _store(request).image_path(template_id, _owner(request)),
        media_type="image/png",
        headers={"Cache-Control": "private, max-age=86400"},
    )


@router.get(
    "/{template_id}/thumbnail", summary="The template thumbnail (WebP)", response_class=FileResponse
)
def template_thumbnail(request: Request, template_id: str) -> FileResponse:
    return FileResponse(
        _store(request).thumbnail_path(template_id, _owner(request)),
        media_type="image/webp",
        headers={"Cache-Control": "private, max-age=86400"},
    )


@router.post(
    "/{template_id}/prepare",
    status_code=202,
    summary="Record the template's activation cache for a model",
)
def prepare_template(
    request: Request,
    template_id: str,
    model: str | None = Form(None, description="Model id (default: the server's model)"),
    steps: int | None = Form(None, description="Steps the edits will use (default: the model's)"),
    resolution: int = Form(0, description="Resolution bucket side; 0: the model's default"),
    adapters: str = Form(
        "",
        description="Pin the cache to these LoRA adapters (edits naming exactly them read "
        "it): " + FORM_HELP,
    ),
) -> JSONResponse:
    submitted = request.app.state.service.prepare_template(
        template_id, _owner(request), model, steps, resolution, tuple(parse_choices(adapters))
    )
    body = {
        "job_id": submitted.job_id,
        "model": submitted.model_id,
        "steps": submitted.steps,
        "status": "queued",
        "status_url": f"/v1/jobs/{submitted.job_id}",
        "cache_url": f"/v1/templates/{template_id}/cache?"
        + urlencode(
            {"model": submitted.model_id, "steps": submitted.steps, "resolution": resolution}
            | ({"adapters": adapters} if adapters else {})
        ),
    }
    return JSONResponse(body, status_code=202, headers={"Location": body["status_url"]})


@router.get(
    "/{template_id}/cache", summary="The template's cache status for an edit with given settings"
)
def template_cache(
    request: Request,
    template_id: str,
    model: str | None = Query(None, description="Model id (default: the server's model)"),
    steps: int | None = Query(None, description="Steps of the edit (default: the model's)"),
    strength: float = Query(1.0, description="Strength of the edit, in (0, 1]"),
    guidance: float | None = Query(
        None, description="Guidance of the edit (default: the model's; with CFG it changes nothing)"
    ),
    resolution: int = Query(0, description="Resolution bucket side; 0: the model's default"),
    adapters: str = Query(
        "",
        description="The cache pinned to these LoRA adapters (as prepare pinned it); empty: the "
        "base model's cache. " + FORM_HELP,
    ),
) -> dict:
    """Where the cache that an edit of this template with these settings reads is: ``not
    prepared``, ``preparing``, ``on disk``, ``in RAM`` or ``on device`` (``workers``: which, those
    of the fastest tier first). The cache follows the template's pixels, so a copy of the same
    picture under another name shows the same status."""
    return request.app.state.service.cache_status(
        template_id,
        _owner(request),
        model,
        steps=steps,
        strength=strength,
        guidance=guidance,
        resolution=resolution,
        adapters=tuple(parse_choices(adapters)),
    )

"""``/v1/adapters``: the LoRA adapter registry over REST (storage: ``backend.adapters.store``; an
upload is read and validated by a CPU worker: ``backend.adapters.service``).

Every adapter belongs to the key that uploaded it (``request.state.caller.owner``): every route
names that owner, so another key's adapter is a 404 like an id that never existed."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response

from backend.adapters.service import AdapterService
from backend.adapters.store import AdapterRecord, AdapterStore
from backend.api.errors import ERROR_RESPONSES

router = APIRouter(prefix="/v1/adapters", tags=["adapters"], responses=ERROR_RESPONSES)


def _store(request: Request) -> AdapterStore:
    return request.app.state.adapters


def _service(request: Request) -> AdapterService:
    return request.app.state.adapter_service


def _owner(request: Request) -> str:
    return request.state.caller.owner


def adapter_view(record: AdapterRecord, modules: bool = True) -> dict:
    """A record as the API shows it: ``targets`` counts the targeted modules by kind; ``ranks``
    (module -> rank, every targeted module) only when ``modules`` (one adapter's inspection)."""
    url = f"/v1/adapters/{record.adapter_id}"
    view = record.to_dict() | {"targets": record.targets, "url": url}
    del view["owner"]
    if not modules:
        del view["ranks"]
    return view


@router.post("", status_code=201, summary="Register a LoRA adapter (.safetensors)")
def upload_adapter(
    request: Request,
    file: UploadFile = File(
        ..., description="The adapter: .safetensors in the diffusers/PEFT or the kohya layout"
    ),
    name: str | None = Form(None, description="Display name (default: the file's name)"),
    model: str | None = Form(
        None, description="Model the adapter is for (default: the server's model)"
    ),
) -> dict:
    display = name if name is not None else Path(file.filename or "").stem or "untitled"
    record = _service(request).add(file.file, display, model, _owner(request))
    return adapter_view(record)


@router.get("", summary="List adapters, newest first")
def list_adapters(request: Request) -> dict:
    records = _store(request).list(_owner(request))
    return {"adapters": [adapter_view(record, modules=False) for record in records]}


@router.get("/{adapter_id}", summary="One adapter: family, model, ranks, targeted modules, size")
def get_adapter(request: Request, adapter_id: str) -> dict:
    return adapter_view(_store(request).get(adapter_id, _owner(request)))


@router.delete("/{adapter_id}", status_code=204, summary="Delete an adapter")
def delete_adapter(request: Request, adapter_id: str) -> Response:
    _store(request).delete(adapter_id, _owner(request))
    return Response(status_code=204)

"""What the studio does with LoRA adapters (no Gradio here): list the tenant's adapters for a model,
register one from a ``.safetensors`` file, delete one, turn the editor's picker into the
``AdapterChoice``s of a ``JobRequest``, and say which adapters a job ran with.

The studio is one tenant (``owner``), so its users share its adapters as they share its gallery;
an API key's adapters are never listed here, nor the studio's to a key.

Invariants:
* a registration runs the REST upload's own code (``AdapterService.add``: a CPU worker reads and
  validates the file, nothing is stored on any error), so the studio accepts exactly what
  ``POST /v1/adapters`` accepts, with the same messages (a 503's "no CPU worker answered" too);
* the picker offers only the owner's adapters registered for the selected model;
* this module checks nothing an edit's adapters are checked for (count, scale range, owner, model):
  ``JobService.submit`` does, and its ``AdapterError`` reaches the user as a ``StudioError``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path

from backend.adapters.service import AdapterService
from backend.adapters.store import AdapterNotFound, AdapterRecord, AdapterStore
from backend.api.adapter_requests import AdapterChoice
from backend.api.middleware import human_bytes
from backend.config import AdapterSettings
from studio.errors import StudioError, service_call

NO_ADAPTER = ""  # a picker slot's value when it names no adapter
ADAPTER_HEADERS = ["name", "model", "family", "rank", "size", "layout", "added", "id"]


class StudioAdapters:
    def __init__(
        self,
        store: AdapterStore,
        uploads: AdapterService | None,
        owner: str,
        limits: AdapterSettings,
    ):
        """``uploads`` None: this studio cannot register adapters (it still lists and uses them).
        ``limits``: the deployment's ``adapters`` settings (slots and the scale range)."""
        self.store, self.uploads, self.owner, self.limits = store, uploads, owner, limits

    # ----- listing --------------------------------------------------------------------------------
    def listed(self, model: str = "") -> list[AdapterRecord]:
        """The owner's adapters, newest first; only those registered for ``model`` when given."""
        return [r for r in self.store.list(self.owner) if not model or r.model_id == model]

    @staticmethod
    def label(record: AdapterRecord) -> str:
        """How the picker names an adapter: its name, rank and size."""
        return f"{record.name} · rank {record.rank} · {human_bytes(record.nbytes)}"

    def choices(self, model: str) -> list[tuple[str, str]]:
        """The picker's (label, adapter id) pairs for ``model``; none without a model."""
        return [(self.label(r), r.adapter_id) for r in self.listed(model)] if model else []

    def rows(self) -> tuple[list[list], list[str]]:
        """The Adapters tab's table (``ADAPTER_HEADERS``), and the adapter id of each row."""
        records = self.listed()
        rows = [
            [
                r.name,
                r.model_id,
                r.family,
                r.rank,
                human_bytes(r.nbytes),
                r.source_layout,
                dt.datetime.fromtimestamp(r.created_at).strftime("%Y-%m-%d %H:%M"),
                r.adapter_id,
            ]
            for r in records
        ]
        return rows, [r.adapter_id for r in records]

    def get(self, adapter_id: str) -> AdapterRecord:
        if not adapter_id:
            raise StudioError("no adapter selected: pick one in the list")
        return service_call(self.store.get, adapter_id, self.owner)

    # ----- registry -------------------------------------------------------------------------------
    def register(self, file, name: str = "", model: str = "") -> AdapterRecord:
        """Register the uploaded ``file`` (a path, or a temp file) for ``model`` ("" : the
        deployment's default), named ``name`` or else after the file. Blocks while a CPU worker
        reads it (at most ``adapters.ingest_timeout_s``)."""
        if self.uploads is None:
            raise StudioError("this studio cannot register adapters: use POST /v1/adapters")
        if not file:
            raise StudioError("no file chosen: pick the adapter's .safetensors file")
        path = Path(file if isinstance(file, str) else file.name)
        display = (name or "").strip() or path.stem or "untitled"
        try:
            handle = path.open("rb")
        except OSError as exc:
            raise StudioError(f"the uploaded file cannot be read ({exc}): upload again") from None
        with handle:
            return service_call(self.uploads.add, handle, display, model or None, self.owner)

    def delete(self, adapter_id: str) -> str:
        """Delete one of the owner's adapters; its name."""
        record = self.get(adapter_id)
        service_call(self.store.delete, record.adapter_id, self.owner)
        return record.name

    # ----- edits ----------------------------------------------------------------------------------
    @staticmethod
    def picked(ids: Sequence[str | None], scales: Sequence[float | None]) -> tuple:
        """The ``AdapterChoice``s of the picker's slots (slot i: ``ids[i]`` at ``scales[i]``), in
        slot order; empty slots are skipped, so none chosen is the base model."""
        return tuple(
            AdapterChoice(adapter_id, 1.0 if scale is None else float(scale))
            for adapter_id, scale in zip(ids, scales, strict=True)
            if adapter_id
        )

    def describe(self, job: dict) -> str:
        """A job's adapters as ``name ×scale`` each, with the denoising step it joined at once the
        job is denoised ("" for none). A deleted adapter is named by its id's start."""
        steps = job.get("adapter_steps") or {}
        parts = []
        for use in job.get("adapters") or []:
            try:
                name = self.store.get(use["id"], self.owner).name
            except AdapterNotFound:
                name = f"{use['id'][:8]} (deleted)"
            joined = f" from step {steps[use['id']]}" if use["id"] in steps else ""
            parts.append(f"{name} ×{float(use['scale']):g}{joined}")
        return ", ".join(parts)

    def recalled(self, job: dict) -> tuple[list[str], list[float], list[str]]:
        """The picker's slot values for a job recalled from the history: (ids, scales) padded to
        ``max_per_request`` slots, and one message per adapter that is gone (not recalled)."""
        ids, scales, gone = [], [], []
        for use in job.get("adapters") or []:
            try:
                record = self.store.get(use["id"], self.owner)
            except AdapterNotFound:
                gone.append(f"adapter {use['id'][:8]} was deleted: the edit is recalled without it")
                continue
            ids.append(record.adapter_id)
            scales.append(float(use["scale"]))
        slots = self.limits.max_per_request
        ids, scales = ids[:slots], scales[:slots]
        pad = slots - len(ids)
        return ids + [NO_ADAPTER] * pad, scales + [1.0] * pad, gone

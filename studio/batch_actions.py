"""What the studio's Batches tab does, over the batch service (``backend.api.batches``): submit one
gallery template with several uploaded masks, list the signed-in user's batches, read one (overall
and per item), follow it until every item finished, cancel it. No Gradio here: errors the user can
fix are ``StudioError``s.

The studio acts as one tenant (``StudioActions.owner``); a user's batches are listed for that user
only (``listed_for``), like their history.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from backend.api.batches import BatchItem, BatchRequest, SubmittedBatch
from backend.api.security import studio_user
from backend.api.submission import JobRequest
from studio.actions import StudioActions
from studio.deadlines import STUDIO_CLASS
from studio.errors import StudioError, service_call

BATCH_HEADERS = ["submitted", "status", "progress", "done", "failed", "items", "batch"]
ITEM_HEADERS = ["#", "status", "step", "progress", "prompt", "seed", "message"]
FOLLOW_EVERY_S = 1.0


@dataclass(frozen=True)
class BatchForm:
    """What the tab's form sends: the template, one or more mask files, the prompt and the few
    settings a batch asks for (every other parameter takes the model's default)."""

    template_id: str
    masks: tuple[str | Path, ...]
    prompt: str = ""
    steps: int | None = None
    seed: int | None = None  # None: a random seed per item; else item i runs with seed + i


def seed_of(text) -> int | None:
    """The seed box's text as ``BatchForm.seed``: empty (or blanks) is None, random seeds."""
    text = str(text or "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise StudioError(
            f"the seed must be a whole number, or empty for random seeds, not {text!r}"
        ) from None


class StudioBatches:
    def __init__(self, actions: StudioActions):
        self.actions = actions
        self.batches = actions.batches  # the one the editor submits its variations with

    def submit(self, user: str, form: BatchForm) -> SubmittedBatch:
        if not form.template_id:
            raise StudioError("pick a template for the batch first")
        if not form.masks:
            raise StudioError("upload one or more masks (white = repaint), one item per mask")
        masks = []
        for path in form.masks:
            try:
                masks.append(Path(path).read_bytes())
            except OSError as exc:
                raise StudioError(f"the mask {Path(path).name} cannot be read: {exc}") from None
        shared = JobRequest(
            mask=b"",
            prompt=form.prompt or "",
            template_id=form.template_id,
            steps=None if form.steps is None else int(form.steps),
            seed=None if form.seed is None else int(form.seed),
            service_class=STUDIO_CLASS,
            owner=self.actions.owner,
            listed_for=studio_user(user),
        )
        request = BatchRequest(shared, tuple(BatchItem(mask=m) for m in masks))
        submitted = service_call(self.batches.submit, request)
        for _ in submitted.job_ids:
            self.actions.on_submitted(submitted.model_id)
        return submitted

    def list(self, user: str, limit: int = 20) -> list[dict]:
        """The user's batches, newest first (as ``BatchService.get`` gives them)."""
        return self.batches.history(self.actions.owner, limit, listed_for=studio_user(user))

    def get(self, batch_id: str) -> dict:
        return service_call(self.batches.get, batch_id, self.actions.owner)

    def cancel(self, batch_id: str) -> str:
        answer = service_call(self.batches.cancel, batch_id, self.actions.owner)
        return f"cancelled {answer['cancelled']} item(s); {answer['already_finished']} had finished"

    def follow(self, batch_id: str, timeout_s: float = 3600.0) -> Iterator[dict]:
        """The batch now, then again every ``FOLLOW_EVERY_S`` while it changes, until every item
        finished (or ``timeout_s``)."""
        until, last = time.monotonic() + timeout_s, None
        while True:
            batch = self.get(batch_id)
            seen = (batch["progress"], tuple(item["status"] for item in batch["items"]))
            if seen != last:
                yield batch
                last = seen
            if batch["finished"] == batch["total"] or time.monotonic() > until:
                return
            time.sleep(FOLLOW_EVERY_S)

    def thumbnails(self, batch: dict) -> list[tuple[str, str]]:
        """(thumbnail path, caption) of every done item's result."""
        shown = []
        for item in batch["items"]:
            if item["status"] != "done":
                continue
            try:
                job = self.actions.job(item["job_id"])
            except StudioError:  # expired since the batch was read
                continue
            if path := self.actions.thumbnail_of(job):
                shown.append((str(path), f"#{item['index']} {item.get('prompt', '')[:30]}"))
        return shown


def batch_rows(batches: list[dict]) -> list[list]:
    """The table of a user's batches (``BATCH_HEADERS``)."""
    return [
        [
            dt.datetime.fromtimestamp(b["created_at"]).strftime("%Y-%m-%d %H:%M:%S"),
            b["status"],
            f"{b['progress']:.0%}",
            b["counts"].get("done", 0),
            b["counts"].get("failed", 0),
            b["total"],
            b["batch_id"],
        ]
        for b in batches
    ]


def item_rows(batch: dict) -> list[list]:
    """One batch's items (``ITEM_HEADERS``)."""
    return [
        [
            item["index"],
            item["status"],
            f"{item['step']}/{item['num_steps']}" if item["num_steps"] else "",
            f"{item['progress']:.0%}",
            item.get("prompt", ""),
            item.get("seed", ""),
            item["message"],
        ]
        for item in batch["items"]
    ]


def summary_line(batch: dict) -> str:
    """The batch as a whole, in words."""
    counts = ", ".join(f"{n} {status}" for status, n in sorted(batch["counts"].items()))
    return (
        f"Batch {batch['batch_id'][:8]}: **{batch['status']}**, {batch['progress']:.0%} · "
        f"{batch['finished']}/{batch['total']} finished ({counts})"
    )

"""Batches: one template edited with many masks and/or prompts in one call, one batch id.

``BatchService`` is what the REST routes (``routes_batches``), the studio and the OpenAI-style
edits route (``n`` > 1) call. A batch is N jobs (its *items*) made by the job service's own
machinery (``JobService.check`` / ``JobService.create``) with a record listing them
(``protocol.records.BatchRecord`` under ``keys.batch_key``); its progress is its items' job
states (``batch_progress``).

Invariants:
* every item is checked before anything is stored: a refused batch stores nothing (no blob, no
  job, no record), and its error names the item (``detail.item``, its 0-based index) and what to
  fix;
* the template is checked once and stored once for all items; every item's ``EditJob`` carries the
  batch id, so the dispatcher routes the items to one worker (``dispatch.groups``) where the
  template's cache is read once and the rows batch together;
* item i runs with ``seed + i`` when the request gives a seed (reproducible), else its own random
  seed (returned);
* an item is an ordinary job: it fails, is cancelled and expires on its own, and a failed item
  never fails the others; the batch is only a view over them;
* a batch, like each of its items, belongs to its submitter (``owner``): any other caller gets the
  same ``not_found`` as for an id that never existed;
* a batch the job queue could not take whole (the broker went away) is cancelled: the items
  queued so far are cancelled, and the caller gets ``unavailable`` (503) to submit it again.
"""

from __future__ import annotations

import hmac
import json
import re
import time
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import BinaryIO

from backend.api.batch_progress import EXPIRED, BatchTracker, ItemProgress, summary
from backend.api.checks import MAX_SEED, Overloaded, ServiceError
from backend.api.service import JobService
from backend.api.submission import BatchLink, CheckedJob, JobRequest, SubmittedJob
from backend.blobs import BlobError
from backend.protocol import TERMINAL, JobRecord
from backend.protocol.keys import batch_history_key, batch_key, job_events_key, job_key
from backend.protocol.records import BatchRecord
from backend.protocol.wire import to_text

_BATCH_ID = re.compile(r"^[0-9a-f]{32}$")
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class BatchItem:
    """One item of a batch: its mask and its prompt; ``None`` takes the batch's shared one
    (``BatchRequest.shared.mask`` / ``.prompt``)."""

    mask: bytes | None = None
    prompt: str | None = None


@dataclass(frozen=True)
class BatchRequest:
    """A batch as a caller asks for it. ``shared`` holds the template (exactly one of
    ``template_id`` and ``image``), the owner, and every edit parameter the items share (model,
    steps, guidance, seed, adapters, service class, mask ops, ...) as for one job; its ``mask`` and
    ``prompt`` are the defaults of items that give none. ``items``: 1 to ``api.max_batch_items``.
    """

    shared: JobRequest
    items: tuple[BatchItem, ...]


@dataclass(frozen=True)
class SubmittedBatch:
    batch_id: str
    job_ids: tuple[str, ...]  # item i's job
    seeds: tuple[int, ...]  # item i's seed
    model_id: str
    steps: int


@dataclass(frozen=True)
class ItemResult:
    """One item's outcome: its result's PNG bytes when it is done and its result is still
    stored; else ``data`` is None and ``message`` says why."""

    index: int
    job_id: str
    status: str
    data: bytes | None
    message: str = ""


class BatchItemError(ServiceError):
    """An item of a batch was refused: the message and ``detail.item`` name it."""

    def __init__(self, index: int, error: ServiceError):
        super().__init__(f"item {index}: {error}", error.code)
        self.headers = error.headers
        self.detail = {**(error.detail or {}), "item": index}


class BatchService:
    def __init__(self, jobs: JobService):
        self.jobs = jobs
        self.client, self.settings = jobs.client, jobs.settings

    # ----- submit ---------------------------------------------------------------------------------
    def submit(self, request: BatchRequest) -> SubmittedBatch:
        """Check every item, then store the template once and queue one job per item (module
        docstring). Raises ``ServiceError`` (``BatchItemError`` naming the item) before anything is
        stored."""
        shared, count = request.shared, len(request.items)
        limit = self.settings.api.max_batch_items
        if not 1 <= count <= limit:
            raise ServiceError(
                f"a batch holds 1 to {limit} items (masks and/or prompts), this one has {count}: "
                "split it into several batches"
            )
        if shared.seed is not None and not 0 <= shared.seed <= MAX_SEED - (count - 1):
            raise ServiceError(
                f"seed {shared.seed} is out of range for {count} items (item i runs with seed + "
                f"i): use 0..{MAX_SEED - (count - 1)}, or leave it out for random seeds"
            )
        self.jobs.check_queued(shared.owner, count)
        template = self.jobs.sources.check(shared.template_id, shared.image, shared.owner)
        now = time.time()
        checked = [
            self._check_item(shared, item, index, template, now)
            for index, item in enumerate(request.items)
        ]
        # every item passed: store the template once, then each item's mask, job and record
        template_ref = template.store()
        batch_id = uuid.uuid4().hex
        submitted: list[SubmittedJob] = []
        try:
            for index, item in enumerate(checked):
                link = BatchLink(batch_id, index)
                submitted.append(self.jobs.create(item, template_ref, link))
        except ServiceError as exc:
            self._cancel_jobs([job.job_id for job in submitted], shared.owner)
            raise ServiceError(
                f"{exc} (the batch was not queued whole: its {len(submitted)} queued item(s) "
                "were cancelled; submit it again)",
                exc.code,
            ) from exc
        job_ids = tuple(job.job_id for job in submitted)
        self._store(
            BatchRecord(
                batch_id=batch_id,
                owner=shared.owner,
                created_at=now,
                job_ids=job_ids,
                template_id=shared.template_id or "",
                model_id=submitted[0].model_id,
                listed_for=shared.listed_for,
            )
        )
        return SubmittedBatch(
            batch_id,
            job_ids,
            tuple(job.seed for job in submitted),
            submitted[0].model_id,
            submitted[0].steps,
        )

    def _check_item(self, shared: JobRequest, item: BatchItem, index: int, template, now: float):
        mask = shared.mask if item.mask is None else item.mask
        prompt = shared.prompt if item.prompt is None else item.prompt
        if not mask:
            raise BatchItemError(
                index, ServiceError("no mask: give one mask per item, or one mask for them all")
            )
        seed = None if shared.seed is None else shared.seed + index
        request = replace(shared, mask=mask, prompt=prompt, seed=seed)
        try:
            checked: CheckedJob = self.jobs.check(request, template, now)
        except Overloaded:
            raise  # the deployment's bound, not this item's fault: said for the whole batch
        except ServiceError as exc:
            raise BatchItemError(index, exc) from None
        return checked

    def _store(self, record: BatchRecord) -> None:
        ttl = 2 * self.jobs.jobstate.ttl_s  # items expire ttl_s after they finish (docs/api.md)
        listed = batch_history_key(record.listed_for or record.owner)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(batch_key(record.batch_id), mapping=record.fields())
            pipe.zadd(listed, {record.batch_id: record.created_at})
            pipe.zremrangebyrank(listed, 0, -self.settings.studio.history_limit - 1)
            if ttl:
                pipe.expire(batch_key(record.batch_id), ttl)
                pipe.expire(listed, ttl)
            pipe.execute()

    # ----- read -----------------------------------------------------------------------------------
    def record(self, batch_id: str, owner: str) -> BatchRecord:
        """``owner``'s batch record; ``not_found`` for any other owner's, word for word like an id
        that never existed."""
        raw = self.client.hgetall(batch_key(batch_id)) if _BATCH_ID.match(str(batch_id)) else {}
        record = BatchRecord.from_hash(raw) if raw else None
        # compare_digest: how long the check takes does not say how much of an owner matched
        if record is None or not owner or not hmac.compare_digest(record.owner, owner):
            raise ServiceError(
                f"no batch with id {str(batch_id)[:40]!r} (never submitted, or expired)",
                "not_found",
            )
        return record

    def items(self, record: BatchRecord) -> list[JobRecord | None]:
        """Each item's job record (None: expired), in item order, read in one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            for job_id in record.job_ids:
                pipe.hgetall(job_key(job_id))
            raws = pipe.execute()
        return [
            JobRecord.from_hash(job_id, raw) if raw else None
            for job_id, raw in zip(record.job_ids, raws)
        ]

    def get(self, batch_id: str, owner: str) -> dict:
        """The batch as a whole (``batch_progress.summary``: status, counts, progress) and each
        item: index, job id, status, step, progress, message, prompt and seed."""
        record = self.record(batch_id, owner)
        jobs = self.items(record)
        pairs = enumerate(zip(record.job_ids, jobs))
        items = [_progress(index, job_id, job) for index, (job_id, job) in pairs]
        shown = [
            item.as_dict() | ({"prompt": job.prompt, "seed": job.seed} if job else {})
            for item, job in zip(items, jobs)
        ]
        return {
            "batch_id": record.batch_id,
            "created_at": record.created_at,
            "model_id": record.model_id,
            "template_id": record.template_id,
            **summary(items),
            "items": shown,
        }

    def history(self, owner: str, limit: int = 20, listed_for: str = "") -> list[dict]:
        """The batches listed for ``listed_for`` (default: the owner), newest first, as ``get``
        gives them; expired ones are skipped."""
        key = batch_history_key(listed_for or owner)
        batches = []
        for batch_id in self.client.zrevrange(key, 0, max(1, limit) - 1):
            try:
                batches.append(self.get(to_text(batch_id), owner))
            except ServiceError:  # expired
                self.client.zrem(key, batch_id)
        return batches

    def tracker(self, batch_id: str, owner: str) -> BatchTracker:
        """A tracker of the batch's items, all at ``queued``: its event stream replays each item's
        events into it (``events``)."""
        record = self.record(batch_id, owner)
        return BatchTracker([ItemProgress(i, job_id) for i, job_id in enumerate(record.job_ids)])

    def events(
        self, cursors: dict[str, str], block_ms: int | None = None
    ) -> list[tuple[str, str, dict]]:
        """(job id, event id, event) of the items' event streams after each item's cursor (job id
        -> event id, "0" from the start), waiting up to ``block_ms`` for the first. The caller
        checked the owner (``tracker``) and names only the batch's items."""
        if not cursors:
            return []
        streams = {job_events_key(job_id): after for job_id, after in cursors.items()}
        job_of = {job_events_key(job_id): job_id for job_id in cursors}
        reply = self.client.xread(streams, block=block_ms) or []
        found = []
        for stream, entries in reply:
            job_id = job_of[to_text(stream)]
            for entry_id, fields in entries:
                event = fields.get(b"event") or fields.get("event")
                found.append((job_id, to_text(entry_id), json.loads(to_text(event))))
        return found

    def job_statuses(self, job_ids: list[str]) -> dict[str, str]:
        """Each job's status now (``expired`` when its record is gone)."""
        with self.client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(job_key(job_id), "status")
            replies = pipe.execute()
        return {
            job_id: EXPIRED if status is None else to_text(status)
            for job_id, status in zip(job_ids, replies)
        }

    # ----- cancel ---------------------------------------------------------------------------------
    def cancel(self, batch_id: str, owner: str) -> dict:
        """Cancel every unfinished item (``JobService.cancel`` each): how many were cancelled,
        how many of those a worker was told about, and how many had finished already. ``conflict``
        when every item had finished."""
        record = self.record(batch_id, owner)
        jobs = self.items(record)
        open_ids = [
            job_id
            for job_id, job in zip(record.job_ids, jobs)
            if job is not None and job.status not in TERMINAL
        ]
        if not open_ids:
            raise ServiceError(
                "every item of the batch already finished: nothing to cancel", "conflict"
            )
        cancelled, notified = self._cancel_jobs(open_ids, owner)
        return {
            "status": "cancelled",
            "cancelled": cancelled,
            "workers_notified": notified,
            "already_finished": len(record.job_ids) - cancelled,
        }

    def _cancel_jobs(self, job_ids: list[str], owner: str) -> tuple[int, int]:
        cancelled = notified = 0
        for job_id in job_ids:
            try:
                answer = self.jobs.cancel(job_id, owner)
            except ServiceError:  # finished (or expired) in the meantime
                continue
            cancelled += 1
            notified += bool(answer["worker_notified"])
        return cancelled, notified

    # ----- results --------------------------------------------------------------------------------
    def results(self, batch_id: str, owner: str) -> list[ItemResult]:
        """Every item's outcome in item order; a done item's PNG is read from the blob store
        (``BlobStore.get``: a local directory or an object store alike)."""
        record = self.record(batch_id, owner)
        outcomes = []
        for index, (job_id, job) in enumerate(zip(record.job_ids, self.items(record))):
            outcomes.append(self._result(index, job_id, job))
        return outcomes

    def _result(self, index: int, job_id: str, job: JobRecord | None) -> ItemResult:
        if job is None:
            return ItemResult(index, job_id, EXPIRED, None, "the job's record expired")
        if job.status != "done":
            unfinished = "" if job.status in TERMINAL else "not finished yet"
            return ItemResult(index, job_id, job.status, None, job.message or unfinished)
        try:
            data = self.jobs.blobs.get(job.result_ref)
        except (BlobError, FileNotFoundError):
            hours = self.settings.retention.results_hours
            why = f"the result is no longer stored (results are kept {hours:g} hours)"
            return ItemResult(index, job_id, "gone", None, why)
        return ItemResult(index, job_id, "done", data, job.message)

    def write_zip(self, batch_id: str, owner: str, out: BinaryIO) -> dict:
        """Write every done item's result (``<index>.png``, the index zero-padded to the batch's
        width) and ``manifest.json`` (every item: index, job id, status, file or why there is
        none, prompt and seed) as a zip into ``out``; returns the manifest."""
        record = self.record(batch_id, owner)
        jobs = self.items(record)
        width = len(str(len(record.job_ids) - 1))
        entries = []
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
            for index, (job_id, job) in enumerate(zip(record.job_ids, jobs)):
                outcome = self._result(index, job_id, job)
                entry = {"index": index, "job_id": job_id, "status": outcome.status}
                if job is not None:
                    entry |= {"prompt": job.prompt, "seed": job.seed}
                if outcome.data is not None:
                    entry["file"] = f"{index:0{width}d}.png"
                    archive.writestr(entry["file"], outcome.data)  # PNG: compressed already
                else:
                    entry["message"] = outcome.message
                entries.append(entry)
            statuses = [entry["status"] for entry in entries]
            manifest = {
                "batch_id": record.batch_id,
                "complete": all(s in (*TERMINAL, EXPIRED, "gone") for s in statuses),
                "files": sum("file" in entry for entry in entries),
                "items": entries,
            }
            archive.writestr(MANIFEST, json.dumps(manifest, indent=2))
        return manifest


def _progress(index: int, job_id: str, job: JobRecord | None) -> ItemProgress:
    if job is None:
        return ItemProgress(index, job_id, EXPIRED, message="the job's record expired")
    return ItemProgress(index, job_id, job.status, job.step, job.num_steps, job.message)


def iter_chunks(source: BinaryIO, size: int = 1 << 16) -> Iterator[bytes]:
    """``source`` from its start, in chunks (a spooled zip streamed to a client)."""
    source.seek(0)
    while chunk := source.read(size):
        yield chunk

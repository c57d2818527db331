"""The blob janitor: deletes the blobs whose retention has passed (``backend.retention`` decides
which).

Where it runs: a daemon thread of the API process (``start_janitor``, started by ``run_api``),
sweeping at start and then every ``settings.retention.sweep_every_s``. The API is the role every
deployment runs that already holds both the blob store (it writes the uploads and serves the
results, so it is also where an expired result is reported as 410) and Redis (the job records say
which blobs are still in use). The dispatcher only moves messages and need not see the blob
store; engine and CPU workers scale with load and should spend it on jobs. When several API
processes share one Redis, a lock (``SET NX PX`` for most of a period) lets one of them sweep per
period; deleting is idempotent, so two sweeps that overlap anyway are harmless. A sweep lists
every blob and every job record: well under a second for tens of thousands of jobs, once per period.
It works the same on a local directory and on an object store (``backend.blobs``): listing with
modification times and ``delete_if_unchanged`` are the whole of what it needs.

Races with jobs being submitted: the blobs are listed before the job records are read, and a blob
is deleted only while its modification time is still the one listed. A job submitted during the
sweep that reuses a stored blob (an upload written again, a gallery template touched by
``JobService``) made it newer than the listing, so it is kept; a job whose record was not read yet
wrote or touched its blobs after the listing too.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from redis import Redis

from backend.blobs import BlobStore, job_blob_refs
from backend.config import Settings
from backend.jobstate import TERMINAL
from backend.protocol import to_text
from backend.protocol.keys import JANITOR_LOCK_KEY, JOB_PATTERN, job_id_of_key, job_key
from backend.retention import BlobFile, JobRecord, RetentionPolicy, expired_blobs

log = logging.getLogger(__name__)

REF_FIELDS = ("template_ref", "mask_ref", "result_ref", "thumbnail_ref")
_FIELDS = ("status", "updated_at", *REF_FIELDS, *(f"{status}_at" for status in TERMINAL))
_CHUNK = 500  # job records read per round trip


@dataclass
class SweepReport:
    deleted: Counter = field(default_factory=Counter)  # kind -> blobs deleted
    bytes_freed: Counter = field(default_factory=Counter)  # kind -> bytes
    kept_in_use: int = 0  # expired when listed, used again before it was deleted
    seconds: float = 0.0


def list_blobs(blobs: BlobStore) -> list[BlobFile]:
    return [BlobFile(blob.key, blob.size_bytes, blob.modified_at) for blob in blobs.files()]


def job_records(client: Redis) -> list[JobRecord]:
    """Every job record in Redis, with the blobs it references and when it finished."""
    scanned = (to_text(key) for key in client.scan_iter(match=JOB_PATTERN, count=1000))
    job_ids = [job_id for job_id in map(job_id_of_key, scanned) if job_id]
    records = []
    for start in range(0, len(job_ids), _CHUNK):
        chunk = job_ids[start : start + _CHUNK]
        with client.pipeline(transaction=False) as pipe:
            for job_id in chunk:
                pipe.hmget(job_key(job_id), *_FIELDS)
            rows = pipe.execute()
        for job_id, values in zip(chunk, rows):
            record = _record(job_id, values)
            if record is not None:
                records.append(record)
    return records


def _record(job_id: str, values: list) -> JobRecord | None:
    fields = {name: to_text(value) for name, value in zip(_FIELDS, values) if value is not None}
    status = fields.get("status")
    if status is None:
        return None  # expired between SCAN and HMGET
    refs = job_blob_refs(job_id) | {fields[name] for name in REF_FIELDS if fields.get(name)}
    finished_at = None
    if status in TERMINAL:
        finished_at = float(fields.get(f"{status}_at") or fields.get("updated_at") or 0.0)
    return JobRecord(job_id, frozenset(refs), finished_at)


class BlobJanitor:
    def __init__(self, client: Redis, blobs: BlobStore, policy: RetentionPolicy):
        self.client, self.blobs, self.policy = client, blobs, policy

    def sweep(self, now: float | None = None) -> SweepReport:
        """Delete every expired blob (at ``now``, default the time after listing); what it did."""
        started = time.monotonic()
        listed = list_blobs(self.blobs)  # before the job records: see the module docstring
        jobs = job_records(self.client)
        report = SweepReport()
        for blob in expired_blobs(listed, jobs, time.time() if now is None else now, self.policy):
            if self._delete_unchanged(blob):
                report.deleted[blob.kind] += 1
                report.bytes_freed[blob.kind] += blob.size_bytes
            else:
                report.kept_in_use += 1
        report.seconds = time.monotonic() - started
        return report

    def _delete_unchanged(self, blob: BlobFile) -> bool:
        # False when written or touched again since it was listed (in use), or gone already
        return self.blobs.delete_if_unchanged(blob.ref, blob.modified_at)


def start_janitor(
    settings: Settings,
    client: Redis,
    blobs: BlobStore,
    on_report: Callable[[SweepReport], None] = lambda report: None,
) -> threading.Event | None:
    """Sweep in a daemon thread: at once, then every ``sweep_every_s``. Returns the event that stops
    it, or None when there is nothing to do (no period, or every kind kept forever)."""
    retention = settings.retention
    policy = RetentionPolicy.from_hours(retention.inputs_hours, retention.results_hours)
    if retention.sweep_every_s <= 0 or (policy.inputs_s <= 0 and policy.results_s <= 0):
        log.info("blob janitor off: blobs are kept forever")
        return None
    janitor, stop = BlobJanitor(client, blobs, policy), threading.Event()
    owner = f"{socket.gethostname()}-{os.getpid()}"

    def sweep_periodically() -> None:
        while True:
            try:
                # held for most of a period: the next sweep may fall to any API process
                if client.set(
                    JANITOR_LOCK_KEY, owner, nx=True, px=max(1, int(retention.sweep_every_s * 900))
                ):
                    report = janitor.sweep()
                    on_report(report)
                    log.info(
                        "blob janitor: deleted %d blobs (%d bytes) in %.2f s",
                        sum(report.deleted.values()),
                        sum(report.bytes_freed.values()),
                        report.seconds,
                    )
            except Exception:  # Redis away, a disk or object store error: the next period retries
                log.warning("blob janitor sweep failed", exc_info=True)
            if stop.wait(retention.sweep_every_s):
                return

    threading.Thread(target=sweep_periodically, name="blob-janitor", daemon=True).start()
    return stop

"""Which blobs have expired: the pure decision of the blob janitor (no files, no Redis, no clock).

A blob's last use is the latest of its file's modification time (a write, or a new job reusing it)
and the finish time of every job that references it. It expires once its kind's retention has
passed since its last use.

Invariants:
* a blob that a job which has not finished references is never expired, whatever its age (the job
  may still read it: a queued edit's upload, a running row's prepared request);
* ``results`` and ``thumbnails`` are kept ``results_s``, every other kind ``inputs_s``; a retention
  of 0 keeps that kind forever;
* a blob no known job references (its job's record expired, or the job is being created) is judged
  by its modification time alone, so a blob written a moment ago is never expired.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

RESULT_KINDS = ("results", "thumbnails")
HOUR_S = 3600.0


@dataclass(frozen=True)
class BlobFile:
    ref: str  # "<kind>/<name>"
    size_bytes: int
    modified_at: float  # seconds since the epoch

    @property
    def kind(self) -> str:
        return self.ref.partition("/")[0]


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    refs: frozenset[str]  # every blob the job reads or writes
    finished_at: float | None  # None: the job has not finished (it may still use its blobs)


@dataclass(frozen=True)
class RetentionPolicy:
    inputs_s: float  # 0: forever
    results_s: float  # 0: forever

    @classmethod
    def from_hours(cls, inputs_hours: float, results_hours: float) -> RetentionPolicy:
        return cls(inputs_hours * HOUR_S, results_hours * HOUR_S)

    def keep_s(self, kind: str) -> float:
        return self.results_s if kind in RESULT_KINDS else self.inputs_s

    def expired(self, kind: str, last_use: float, now: float) -> bool:
        keep_s = self.keep_s(kind)
        return keep_s > 0 and now - last_use >= keep_s


def expired_blobs(
    blobs: Iterable[BlobFile], jobs: Iterable[JobRecord], now: float, policy: RetentionPolicy
) -> list[BlobFile]:
    """The blobs whose retention has passed at ``now`` (see the module invariants), in input
    order."""
    users: dict[str, list[JobRecord]] = {}
    for job in jobs:
        for ref in job.refs:
            users.setdefault(ref, []).append(job)
    expired = []
    for blob in blobs:
        owners = users.get(blob.ref, ())
        if any(job.finished_at is None for job in owners):
            continue
        finished = [job.finished_at for job in owners if job.finished_at is not None]
        last_use = max([blob.modified_at, *finished])
        if policy.expired(blob.kind, last_use, now):
            expired.append(blob)
    return expired

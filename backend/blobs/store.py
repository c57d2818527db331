"""Files passed between processes by reference: images, masks, prepared requests, latents, results.

A blob ref is ``"<kind>/<name>"``: ``kind`` is one of ``KINDS`` and ``name`` is generated here from
a job id or a content hash (never taken from a user), so a ref can never point outside the store.
``BlobStore`` is that naming over an ``ObjectStore`` (``backend.blobs.objects``): a local directory
or an S3-compatible object store (``backend.blobs.factory.open_blob_store`` picks it from
``paths.blob_url``); callers never see which. Writes are atomic: a reader sees a whole blob or
none. Writing the same ref twice with the same bytes is harmless, which keeps retried tasks
idempotent.

A blob's modification time is its last use: a write sets it, and reusing a stored blob for a new
job ``touch``es it. The janitor (``backend.janitor``) keeps a blob for its retention period after
its last use and after the last job that references it finished. Blobs named after the job that
writes them use ``job_blob_name``, so the janitor can tell their job from the name.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from backend.blobs.objects import BlobError, LocalObjects, ObjectStore, StoredObject

KINDS = ("uploads", "templates", "masks", "prepared", "latents", "results", "thumbnails")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# kind -> name of the blob the job itself writes (pre: prepared request and processed mask; worker:
# final latents; post: result and thumbnail)
JOB_BLOB_NAMES = {
    "prepared": "{job_id}.safetensors",
    "latents": "{job_id}.safetensors",
    "masks": "{job_id}-processed.png",
    "results": "{job_id}.png",
    "thumbnails": "{job_id}.webp",
}


def job_blob_name(kind: str, job_id: str) -> str:
    return JOB_BLOB_NAMES[kind].format(job_id=job_id)


def job_blob_refs(job_id: str) -> frozenset[str]:
    """The refs of every blob named after ``job_id`` (whether written yet or not)."""
    return frozenset(f"{kind}/{job_blob_name(kind, job_id)}" for kind in JOB_BLOB_NAMES)


class BlobStore:
    """Blobs by ref over ``objects`` (a directory path means a local directory store)."""

    def __init__(self, objects: ObjectStore | Path | str):
        self.objects = objects if isinstance(objects, ObjectStore) else LocalObjects(objects)

    def ref(self, kind: str, name: str) -> str:
        if kind not in KINDS:
            raise BlobError(f"blob kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
            raise BlobError(f"blob name {name!r} must be 1-128 letters, digits, '.', '_' or '-'")
        return f"{kind}/{name}"

    def checked(self, ref: str) -> str:
        """``ref`` validated (whatever a message says, it names a blob inside the store)."""
        kind, _, name = str(ref).partition("/")
        return self.ref(kind, name)

    def put(self, kind: str, name: str, data: bytes) -> str:
        ref = self.ref(kind, name)
        self.objects.put(ref, data)
        return ref

    def put_content(self, kind: str, data: bytes, suffix: str) -> str:
        """Store under the content hash: the same bytes always get the same ref."""
        return self.put(kind, hashlib.sha256(data).hexdigest()[:32] + suffix, data)

    def get(self, ref: str) -> bytes:
        return self.objects.get(self.checked(ref))

    def exists(self, ref: str) -> bool:
        return self.objects.exists(self.checked(ref))

    def delete(self, ref: str) -> None:
        self.objects.delete(self.checked(ref))

    def touch(self, ref: str) -> None:
        """Mark a stored blob as used now (a new job reuses it): its retention starts again.
        BlobMissing (a FileNotFoundError) when it is not stored."""
        self.objects.touch(self.checked(ref))

    @contextmanager
    def writing(self, kind: str, name: str) -> Iterator[tuple[str, Path]]:
        """(ref, local temporary file): what the block writes there is stored under ref when it
        exits cleanly (atomically), nothing when it raises."""
        ref = self.ref(kind, name)
        with self.objects.writing(ref) as path:
            yield ref, path

    def reading(self, ref: str) -> AbstractContextManager[Path]:
        """A local file holding the blob for the block (BlobMissing when it is not stored)."""
        return self.objects.reading(self.checked(ref))

    def local_path(self, ref: str) -> Path:
        """A local file holding the blob, to serve by path (``ObjectStore.local_path``)."""
        return self.objects.local_path(self.checked(ref))

    def files(self) -> Iterator[StoredObject]:
        """Every stored blob (key = its ref); writes in flight are skipped."""
        for kind in KINDS:
            yield from self.objects.listing(kind)

    def delete_if_unchanged(self, ref: str, modified_at: float) -> bool:
        """Delete the blob only if it was not written or touched since a listing saw
        ``modified_at``; whether it was deleted."""
        return self.objects.delete_if_unchanged(self.checked(ref), modified_at)

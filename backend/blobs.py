"""Files passed between processes by reference: images, masks, prepared requests, latents, results.

A blob ref is ``"<kind>/<name>"``: ``kind`` is one of ``KINDS`` and ``name`` is generated here from
a job id or a content hash (never taken from a user), so a ref can never point outside the store.
Writes are atomic (temp file + rename): a reader sees a whole file or none. Writing the same ref
twice with the same bytes is harmless, which keeps retried tasks idempotent.

A blob's modification time is its last use: a write sets it, and reusing a stored blob for a new
job ``touch``es it. The janitor (``backend.janitor``) keeps a blob for its retention period after
its last use and after the last job that references it finished. Blobs named after the job that
writes them use ``job_blob_name``, so the janitor can tell their job from the name.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from backend.atomic import write_atomic

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


class BlobError(ValueError):
    """A blob ref is malformed or names a file that does not exist."""


class BlobStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def ref(self, kind: str, name: str) -> str:
        if kind not in KINDS:
            raise BlobError(f"blob kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not _NAME.match(name) or ".." in name:
            raise BlobError(f"blob name {name!r} must be 1-128 letters, digits, '.', '_' or '-'")
        return f"{kind}/{name}"

    def path(self, ref: str) -> Path:
        """The file of ``ref`` (validated: inside the store whatever the ref says)."""
        kind, _, name = ref.partition("/")
        return self.root / self.ref(kind, name)

    def new_path(self, kind: str, name: str) -> tuple[str, Path]:
        ref = self.ref(kind, name)
        path = self.root / ref
        path.parent.mkdir(parents=True, exist_ok=True)
        return ref, path

    def put(self, kind: str, name: str, data: bytes) -> str:
        ref, path = self.new_path(kind, name)
        write_atomic(path, data)
        return ref

    def put_content(self, kind: str, data: bytes, suffix: str) -> str:
        """Store under the content hash: the same bytes always get the same ref."""
        return self.put(kind, hashlib.sha256(data).hexdigest()[:32] + suffix, data)

    def get(self, ref: str) -> bytes:
        path = self.path(ref)
        if not path.exists():
            raise BlobError(f"blob {ref} does not exist (expired or never written)")
        return path.read_bytes()

    def exists(self, ref: str) -> bool:
        return self.path(ref).exists()

    def delete(self, ref: str) -> None:
        self.path(ref).unlink(missing_ok=True)

    def touch(self, ref: str) -> None:
        """Mark a stored blob as used now (a new job reuses it): its retention starts again."""
        os.utime(self.path(ref))

    def files(self) -> Iterator[tuple[str, Path, os.stat_result]]:
        """(ref, path, stat) of every stored blob; temporary files of writes in flight are
        skipped."""
        for kind in KINDS:
            folder = self.root / kind
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder):
                if _NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                    try:
                        yield (
                            f"{kind}/{entry.name}",
                            Path(entry.path),
                            entry.stat(follow_symlinks=False),
                        )
                    except FileNotFoundError:  # deleted since the directory was listed
                        continue

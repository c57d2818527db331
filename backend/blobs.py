"""Files passed between processes by reference: images, masks, prepared requests, latents, results.

A blob ref is ``"<kind>/<name>"``: ``kind`` is one of ``KINDS`` and ``name`` is generated here from a
job id or a content hash (never taken from a user), so a ref can never point outside the store.
Writes are atomic (temp file + rename): a reader sees a whole file or none. Writing the same ref
twice with the same bytes is harmless, which keeps retried tasks idempotent.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

KINDS = ("uploads", "templates", "masks", "prepared", "latents", "results", "thumbnails")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same directory and a rename: a reader
    sees the whole file or none, and a failed write leaves no temp file behind."""
    handle, tmp = tempfile.mkstemp(prefix=".tmp.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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

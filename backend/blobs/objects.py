"""Where files that several processes read live: the object store interface and its local back end.

An ``ObjectStore`` holds whole objects under keys ``"<folder>/<name>"`` (every segment 1-128
letters, digits, '.', '_' or '-', never starting with '.'): bytes in and out, a local file to write
that is stored on exit, a local file to read, listing with sizes and modification times, ``touch``.
Two implementations: ``LocalObjects`` (a directory: one host, or a shared file system) and
``backend.blobs.s3.S3Objects`` (any S3-compatible object store: several hosts). Every caller goes
through this interface, so no role needs a directory shared with another.

Invariants, on both back ends:
* a write is atomic: a reader sees the whole object or none (local: temp file + rename; S3: a PUT,
  or a multipart upload, becomes visible whole when it completes), and a failed write stores
  nothing;
* writing a key twice with the same bytes is harmless (retried tasks stay idempotent), and deleting
  a missing key is a no-op;
* an object's modification time is its last write or ``touch``; ``delete_if_unchanged`` deletes
  only while it is still the time a listing saw (the janitor's guard against a blob reused since);
* reading a missing object raises ``BlobMissing`` (a ``FileNotFoundError`` and a ``BlobError``);
  a malformed key raises ``BlobError`` before anything is touched; a store that cannot answer
  raises ``BlobStoreUnavailable`` (an object store; a local disk raises its ``OSError``).
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from backend.atomic import atomic_path, file_lock, write_atomic

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class BlobError(ValueError):
    """A blob ref or object key is malformed or names an object that does not exist."""


class BlobMissing(BlobError, FileNotFoundError):
    """The object is not stored (expired, deleted, or never written)."""


class BlobStoreUnavailable(RuntimeError):
    """The store did not answer as it should (unreachable, refused credentials, no such bucket):
    the deployment's to fix, not the caller's; the request may be tried again."""


@dataclass(frozen=True)
class StoredObject:
    key: str  # "<folder>/<name>", relative to the store
    size_bytes: int
    modified_at: float  # seconds since the epoch (S3: whole seconds)


def check_key(key: str) -> str:
    """``key`` when every segment is a safe name (it never leaves the store); BlobError if not."""
    parts = key.split("/") if isinstance(key, str) else [""]
    if not all(_SEGMENT.match(part) and ".." not in part for part in parts):
        raise BlobError(
            f"object key {str(key)[:160]!r} must be '/'-separated names of 1-128 letters, digits, "
            "'.', '_' or '-'"
        )
    return key


class ObjectStore(ABC):
    """The interface (see the module invariants). Keys are checked with ``check_key``."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; BlobMissing when it is not stored."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; nothing happens when it is not stored."""

    @abstractmethod
    def touch(self, key: str) -> None:
        """Set its modification time to now (a new use); BlobMissing when it is not stored."""

    @abstractmethod
    def listing(self, folder: str) -> Iterator[StoredObject]:
        """The objects directly in ``folder`` (writes in flight are not listed)."""

    @abstractmethod
    def delete_if_unchanged(self, key: str, modified_at: float) -> bool:
        """Delete the object only if its modification time is still ``modified_at``; whether it
        was deleted (False too when it is gone already)."""

    @abstractmethod
    def writing(self, key: str) -> AbstractContextManager[Path]:
        """A local temporary file to write; stored under ``key`` when the block exits cleanly,
        discarded (nothing stored) when it raises."""

    @abstractmethod
    def reading(self, key: str) -> AbstractContextManager[Path]:
        """A local file holding the object for the block (BlobMissing when it is not stored)."""

    @abstractmethod
    def local_path(self, key: str) -> Path:
        """A local file holding the object that outlives the call (to serve or load by path;
        the object must not change under its key): the file itself for a directory, a copy in
        this host's download cache for an object store. BlobMissing when it is not stored."""

    @abstractmethod
    def lock(self) -> AbstractContextManager[None]:
        """An exclusive lock over this store, held by every process and host that uses it (the
        gallery's and the adapter registry's record/content bookkeeping)."""


class LocalObjects(ObjectStore):
    """Objects as files under ``root`` (``root/<folder>/<name>``)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalObjects({str(self.root)!r})"

    def _file(self, key: str) -> Path:
        return self.root / check_key(key)

    def _existing(self, key: str) -> Path:
        path = self._file(key)
        if not path.is_file():
            raise BlobMissing(f"blob {key} does not exist (expired or never written)")
        return path

    def put(self, key: str, data: bytes) -> None:
        write_atomic(self._file(key), data)

    def get(self, key: str) -> bytes:
        try:
            return self._file(key).read_bytes()
        except FileNotFoundError:
            raise BlobMissing(f"blob {key} does not exist (expired or never written)") from None

    def exists(self, key: str) -> bool:
        return self._file(key).exists()

    def delete(self, key: str) -> None:
        self._file(key).unlink(missing_ok=True)

    def touch(self, key: str) -> None:
        try:
            os.utime(self._file(key))
        except FileNotFoundError:
            raise BlobMissing(f"blob {key} does not exist (expired or never written)") from None

    def listing(self, folder: str) -> Iterator[StoredObject]:
        directory = self._file(folder)
        if not directory.is_dir():
            return
        for entry in os.scandir(directory):
            # temporary files of writes in flight start with '.', which no key does
            if _SEGMENT.match(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # deleted since the directory was listed
                    continue
                yield StoredObject(f"{folder}/{entry.name}", stat.st_size, stat.st_mtime)

    def delete_if_unchanged(self, key: str, modified_at: float) -> bool:
        path = self._file(key)
        try:
            if path.stat().st_mtime != modified_at:
                return False
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    @contextmanager
    def writing(self, key: str) -> Iterator[Path]:
        with atomic_path(self._file(key)) as tmp:
            yield tmp

    @contextmanager
    def reading(self, key: str) -> Iterator[Path]:
        yield self._existing(key)

    def local_path(self, key: str) -> Path:
        return self._existing(key)

    def lock(self) -> AbstractContextManager[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        return file_lock(self.root / ".lock")

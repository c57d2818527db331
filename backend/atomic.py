"""Atomic file writes: the one helper every writer of a file others may read goes through.

Invariant: a reader sees the whole new file or the old one (or none), never a partial file; a
failed write leaves no temporary file behind. The temporary file lives in the target's directory,
so the final rename never crosses a file system.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yields a temporary path to write ``path``'s new content to; on a clean exit it replaces
    ``path`` in one rename, on an exception it is deleted. Parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def file_lock(path: Path | str) -> Iterator[None]:
    """Hold an exclusive inter-process lock (``flock``) on ``path`` (created when missing) for the
    block: stores that keep records and shared content files do their bookkeeping under one."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomic(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see the module invariant)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)

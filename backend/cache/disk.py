"""What the tiered cache finds in its directory at start-up: entries, partial recordings, room.

A partial recording is the hidden directory ``.<entry>.<pid>.<random>`` a ``CacheWriter`` writes
before renaming it into place (``backend.engine.cache_store``). A worker killed mid-recording
leaves it behind; nothing else would ever remove it, and it holds disk space the budget does not
count. Workers of one host may share the directory, so a partial is removed only when its owner
is gone (``partial_is_stale``): no process has its pid, or the process that has it started after
the partial was last written (the pid was reused).

Invariants: a live writer's partial is never removed (it writes into it at least once per step, so
its mtime is at or after its owner's start); a partial of an older build (no pid in its name) is
removed, as no running build writes one.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil
from safetensors import SafetensorError

from backend.engine.cache_store import (
    MANIFEST,
    CacheCorruptError,
    CacheError,
    TemplateCache,
    partial_owner,
)

log = logging.getLogger(__name__)

UNUSABLE = (CacheError, OSError, SafetensorError)  # reading an entry failed: delete it, recompute

# slack between a process's start time (psutil, 10 ms resolution) and file times
START_SLACK_S = 1.0


@dataclass(frozen=True)
class FoundEntry:
    """A complete entry found on disk: its manifest mtime (recency), id and size."""

    mtime_ns: int
    entry_id: str
    size_bytes: int


@dataclass
class Scan:
    """What start-up found: entries to register (oldest first), and what it removed."""

    entries: list[FoundEntry]
    corrupt: int = 0
    partials_removed: int = 0
    partial_bytes_removed: int = 0

    @property
    def held_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries)


def partial_is_stale(
    owner_pid: int | None, owner_started_at: float | None, modified_at: float
) -> bool:
    """Whether a partial recording may be removed. ``owner_pid``: from its name (None: an older
    build's); ``owner_started_at``: when the process now holding that pid started (None: no such
    process); ``modified_at``: the partial's mtime."""
    if owner_pid is None or owner_started_at is None:
        return True
    return owner_started_at > modified_at + START_SLACK_S


def _started_at(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None  # a zombie writes nothing more: its partial is as good as abandoned


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _is_partial(path: Path) -> bool:
    """A writer's hidden directory (``.<32-hex entry id>.``...), of this build or an older one."""
    parts = path.name.split(".")
    return len(parts) >= 3 and parts[0] == "" and len(parts[1]) == 32 and path.is_dir()


def remove_stale_partials(root: Path) -> tuple[int, int]:
    """Remove the partial recordings under ``root`` whose owner is gone; (count, bytes) removed."""
    count = size = 0
    for path in root.iterdir():
        if not _is_partial(path):
            continue
        owner = partial_owner(path.name)
        try:
            modified_at = path.stat().st_mtime
            stale = partial_is_stale(
                owner, _started_at(owner) if owner is not None else None, modified_at
            )
            if stale:
                held = _tree_bytes(path)
        except FileNotFoundError:
            continue  # its owner committed or aborted it meanwhile
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            count, size = count + 1, size + held
    return count, size


def scan(root: Path) -> Scan:
    """Remove stale partials, then list the complete entries (oldest first). An entry with a file
    missing is deleted (and counted corrupt): nothing could ever read it."""
    removed, removed_bytes = remove_stale_partials(root)
    found, corrupt = [], 0
    for path in root.iterdir():
        if path.name.startswith(".") or not (path / MANIFEST).is_file():
            continue  # a live writer's partial directory, or not an entry at all
        try:
            cache = TemplateCache.open(path)
        except CacheCorruptError as exc:
            log.warning("cache entry unusable, deleted path=%s error=%s", path, exc)
            shutil.rmtree(path, ignore_errors=True)
            corrupt += 1
            continue
        except UNUSABLE as exc:  # e.g. another format version: not ours to delete
            log.warning("cache entry ignored path=%s error=%s", path, exc)
            continue
        if cache.key.digest() == path.name:
            mtime_ns = (path / MANIFEST).stat().st_mtime_ns
            found.append(FoundEntry(mtime_ns, path.name, cache.bytes_total))
    found.sort(key=lambda e: (e.mtime_ns, e.entry_id))
    return Scan(found, corrupt, removed, removed_bytes)


def free_bytes(root: Path) -> int:
    """Bytes an unprivileged writer may still use on ``root``'s file system."""
    return shutil.disk_usage(root).free

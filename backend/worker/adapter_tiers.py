"""Moves LoRA adapters between a worker's tiers and joins them to rows without stalling a batch.

Disk -> host loads run on a background thread as soon as a job is queued (``prefetch``); host ->
device copies run when a row asks, on a side CUDA stream where there is one (the copy is resident
once its event completed, so the compute stream never waits on it), synchronously on the CPU.
``RowAdapters`` is what the worker loop calls: ``admit`` a row, ``before_step`` of its batch (rows
take adapters that arrived; a row at its deadline blocks on what it still lacks), ``leave``.

Invariants: the bookkeeping (``AdapterBook``) is only touched under ``_lock``; an adapter is in
``ResidentAdapters`` exactly while the book has it on the device; a running row's adapters are
pinned on the device until the row leaves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from backend.cache import Tier
from backend.cache.key import CacheKey, pinned_key
from backend.engine.editor import EditState
from backend.engine.lora import LoraAdapter, ResidentAdapters
from backend.protocol import AdapterUse, PreparedJob
from backend.worker.adapter_book import AdapterBook, RowJoins, join_deadline

log = logging.getLogger(__name__)

# sha256 -> the adapter read from its normalized file on the host (CPU tensors)
AdapterLoader = Callable[[str], LoraAdapter]


class AdapterTiers:
    def __init__(self, resident: ResidentAdapters, book: AdapterBook, load: AdapterLoader):
        self.resident, self.book, self._load = resident, book, load
        self._host: dict[str, LoraAdapter] = {}
        self._copies: dict[str, tuple[LoraAdapter, torch.cuda.Event]] = {}
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-load")
        target = next(iter(resident.targets.values())).weight
        self.device, self.dtype = target.device, target.dtype
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def prefetch(self, sha: str) -> None:
        """Start loading ``sha`` from disk into host RAM unless it is on its way or there."""
        with self._lock:
            self._prefetch_locked(sha)

    def _prefetch_locked(self, sha: str) -> None:
        if self.book.start_load(sha):
            self._futures[sha] = self._pool.submit(self._load_to_host, sha)

    def _load_to_host(self, sha: str) -> None:
        try:
            adapter = self._load(sha)
        except Exception:
            with self._lock:
                self.book.load_failed(sha)
            raise
        nbytes = adapter.nbytes
        with self._lock:
            self._host[sha] = adapter
            for victim in self.book.loaded(sha, nbytes):
                self._host.pop(victim, None)

    def take(self, shas: list[str]) -> list[str]:
        """Those of ``shas`` on the device now, each pinned there (the caller joins them to a
        row and unpins them when it leaves); starts host -> device copies for those on the host
        and disk loads for the rest. Never waits."""
        return [sha for sha in shas if self._advance(sha)]

    def _advance(self, sha: str) -> bool:
        """One move of ``sha`` towards the device; True (and pinned) once it is there."""
        with self._lock:
            if sha not in self.resident:
                copy = self._copies.get(sha)
                if copy is None or not copy[1].query():
                    adapter = None if copy is not None else self._host.get(sha)
                    if adapter is None and copy is None:
                        self._prefetch_locked(sha)
                        return False
                    if adapter is None:
                        return False
                    return self._copy_to_device(sha, adapter)
                del self._copies[sha]
                self._make_resident(sha, copy[0])
            self.book.pin(sha)
            return True

    def _copy_to_device(self, sha: str, adapter: LoraAdapter) -> bool:
        """Under the lock: start (CUDA) or make (CPU) the host -> device copy; True (pinned)
        when it is resident already."""
        if self._stream is None:
            self._make_resident(sha, adapter.to(self.device, self.dtype))
            self.book.pin(sha)
            return True
        with torch.cuda.stream(self._stream):
            copy = adapter.to(self.device, self.dtype, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._copies[sha] = (copy, event)
        return False

    def _make_resident(self, sha: str, adapter: LoraAdapter) -> None:
        """Under the lock: the copy is on the device; evict what the book says."""
        self.resident.put(adapter)
        for victim in self.book.on_device(sha, adapter.nbytes):
            self.resident.drop(victim)

    def wait(self, sha: str) -> None:
        """Block until ``sha`` is on the device, and pin it (a row at its deadline). Raises
        what loading it raised (after one fresh try)."""
        while not self._advance(sha):
            copy = self._copies.get(sha)
            if copy is not None:
                copy[1].synchronize()
                continue
            self.wait_on_host(sha)

    def wait_on_host(self, sha: str, timeout: float | None = None) -> None:
        """Block until the disk -> host load of ``sha`` (started by ``prefetch`` or ``take``)
        has ended, at most ``timeout`` seconds; raises what loading it raised. Returns at once
        when no load of it was ever started."""
        future = self._futures.get(sha)
        if future is not None:
            future.result(timeout)

    def unpin(self, shas) -> None:
        with self._lock:
            for sha in shas:
                self.book.unpin(sha)

    def snapshot(self) -> dict:
        with self._lock:
            return self.book.snapshot()

    def resident_shas(self) -> tuple[list[str], list[str]]:
        """(on the device, on the host) for the heartbeat."""
        with self._lock:
            return list(self.book.device.sizes), list(self.book.host.sizes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RowAdapters:
    """The worker loop's side of adapters: each row's wanted adapters, their joins and pins."""

    def __init__(self, tiers: AdapterTiers, join_by: float, prefetch: bool = True):
        # prefetch: start reading a job's adapters when it is queued (False: only when its row
        # asks, as a server without asynchronous loading does)
        self.tiers, self.join_by, self.prefetch = tiers, join_by, prefetch
        self._rows: dict[str, RowJoins] = {}
        self._ids: dict[str, dict[str, str]] = {}  # job -> sha -> adapter id (for records)

    def queued(self, uses: list[AdapterUse]) -> None:
        if not self.prefetch:
            return
        for use in uses:
            self.tiers.prefetch(use.sha256)

    def cache_key(self, message: PreparedJob, key: CacheKey | None, caches) -> CacheKey | None:
        """The template cache a queued job reads: for an edit with adapters, the cache pinned to
        exactly its adapter set when one of this worker's tiers (device, RAM, disk) holds one,
        else ``key`` (the base cache; a recording's key is already the one it records)."""
        if key is None or caches is None or message.prepare or not message.adapters:
            return key
        pinned = pinned_key(key, [(use.sha256, use.scale) for use in message.adapters])
        digest = pinned.digest()
        held = any(digest in caches.resident(tier) for tier in (Tier.DEVICE, Tier.RAM, Tier.DISK))
        return pinned if held else key

    def admit(self, job_id: str, uses: list[AdapterUse], num_steps: int, records: bool) -> None:
        """``records``: the row records a cache pinned to its adapters, so it applies them from
        its first step (it waits for them there)."""
        if not uses:
            return
        wanted: dict[str, float] = {}
        for use in uses:
            wanted[use.sha256] = wanted.get(use.sha256, 0.0) + use.scale
            self.tiers.book.asked(use.sha256)
        join_by = 0.0 if records else self.join_by
        self._rows[job_id] = RowJoins(wanted, join_deadline(num_steps, join_by))
        self._ids[job_id] = {use.sha256: use.adapter_id for use in uses}
        self.tiers.book.counters.rows_with_adapters += 1

    def before_step(self, job_ids: list[str], states: list[EditState]) -> dict[str, str]:
        """Rows take the adapters that are on the device; a row at its deadline waits for the
        rest (counted once per row as blocked). Returns job id -> why, for rows whose adapters
        could not be loaded (they must leave)."""
        failed = {}
        for job_id, state in zip(job_ids, states):
            row = self._rows.get(job_id)
            if row is None:
                continue
            # a row restarted from step 0 (a broken cache) has a fresh state: set it every step
            state.adapters = row.active()
            if not row.missing():
                continue
            ready, waits = row.plan(state.step, self.tiers.take(row.missing()))
            row.join(ready, state.step)
            if waits:
                self.tiers.book.counters.rows_blocked += 1
                try:
                    for sha in waits:
                        self.tiers.wait(sha)
                        row.join([sha], state.step)
                except Exception as exc:
                    log.warning("adapters of %s could not be loaded: %s", job_id, exc)
                    failed[job_id] = f"adapter {self._ids[job_id][sha]} could not be loaded: {exc}"
            state.adapters = row.active()
        return failed

    def leave(self, job_id: str) -> dict[str, int]:
        """The row is gone: unpin its adapters; adapter id -> the step it joined at."""
        row = self._rows.pop(job_id, None)
        ids = self._ids.pop(job_id, {})
        if row is None:
            return {}
        self.tiers.unpin(row.joined)
        return {ids[sha]: step for sha, step in row.joined.items()}


def worker_adapters(settings, engine) -> RowAdapters:
    """An engine worker's adapter tiers over the adapter registry, as ``settings`` size them."""
    from backend.adapters.store import AdapterStore
    from backend.blobs.factory import open_objects

    tiers = settings.adapters
    store = AdapterStore(open_objects(settings, "adapters"))
    book = AdapterBook(tiers.device_mb << 20, tiers.host_mb << 20, tiers.policy)
    return RowAdapters(
        AdapterTiers(engine.adapters, book, store_loader(store.content_of)), tiers.join_by
    )


def store_loader(content_path: Callable[[str], Path]) -> AdapterLoader:
    """An ``AdapterLoader`` reading normalized files where ``content_path(sha)`` says."""
    from backend.adapters.files import load_normalized

    def load(sha: str) -> LoraAdapter:
        # the engine keeps adapters by content, so rows naming two records of one file share it
        return load_normalized(content_path(sha), adapter_id=sha)

    return load

"""The tiered activation cache: template caches in device memory above host RAM above the on-disk
cache entries.

Design (spill semantics): recordings are written through to disk. ``CacheWriter`` already builds
an entry as a directory, so ``commit`` publishes it there, registers it with the manager, then
loads it into RAM in the background. RAM therefore normally holds copies of disk entries and a
RAM eviction only drops the copy. A RAM-only entry arises when the disk tier deletes an entry
that is also in RAM (disk space is freed, the data stays usable); evicting that entry from RAM
later spills it back with ``MemoryTemplateCache.save``, through the same ``CacheWriter``: the
format has one writer.

Invariants:
- one lock around every ``CacheManager`` call and the eviction I/O it implies (drops, deletes,
  rare spills), so the manager's view, ``self._ram`` and the directories agree outside the lock;
- disk -> RAM loads (the slow part) run outside the lock; meanwhile their RAM is reserved and the
  entry counts as busy, so nothing evicts or deletes it;
- a handle from ``acquire`` stays valid until ``release``: pinned entries are never evicted;
- an unusable entry (missing or corrupt file) is forgotten and deleted, and callers see a miss;
- workers sharing one directory see each other's recordings: a key this manager does not know is
  looked up on disk (``_discover``) before it counts as a miss, and a commit of a key another
  worker has published meanwhile is dropped, leaving theirs in place;
- they also share the disk tier's budget and recency: every acquire stamps the entry's manifest
  mtime, and before a commit makes room on disk the manager folds in the directory as it is
  (``_sync_with_directory``: entries others published are counted, entries others deleted are
  forgotten, entries others used more recently than it knew rank as just used), so no worker
  deletes a template another uses all the time, and the directory stays within one budget.

- a recording reserves an upper bound of its size before its first byte (``WriteBudget``), or is
  refused; a write that still fails ends that recording only (docs/design/cache-disk.md).

Device tier (on while its budget is above 0): ``self._device`` holds copies of entries on the
compute device (``MemoryTemplateCache.to_device``), which ``acquire`` returns before any other, so
a step reads them without touching host memory. RAM -> device copies run on their own thread,
outside the lock, with their device memory reserved and the entry busy: a hit in RAM promotes the
entry for the next rows, and a job's prefetch (``prefetch``, ``ready``) promotes its entry once it
is in RAM. Demotions (device evictions) run under the lock, as RAM evictions do: a copy back to
host memory when the manager plans one. ``release_device_bytes`` gives device memory back under
pressure (a worker meeting CUDA out-of-memory).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from backend.cache.budgets import choose_disk_budget
from backend.cache.disk import UNUSABLE, free_bytes, scan
from backend.cache.manager import (
    CacheManager,
    CacheMetrics,
    DeleteFromDisk,
    DemoteToRam,
    DropFromDevice,
    DropFromRam,
    Eviction,
    Residency,
    SpillToDisk,
    Tier,
)
from backend.cache.memory_entry import MemoryTemplateCache
from backend.cache.policies import POLICIES
from backend.engine.cache_store import (
    DISK_ERRORS,
    MANIFEST,
    CacheKey,
    CacheMismatchError,
    CacheWriter,
    TemplateCache,
    WriteBudget,
)

log = logging.getLogger(__name__)


def _mtime_ns(path: Path) -> int:
    """``path``'s modification time in ns, 0 when it does not exist."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


@dataclass
class _Load:
    """A reserved disk -> RAM load; whoever claims it first (prefetch thread or acquire) runs it.
    ``for_queued_job``: a prefetch, whose entry is then promoted for that job."""

    done: Future = field(default_factory=Future)
    claimed: bool = False
    for_queued_job: bool = False


class TieredActivationCache:
    """Template caches on the compute ``device`` (``device_budget_bytes``; 0: no device tier)
    above host RAM (``ram_budget_bytes``) above disk entries under ``root``
    (``disk_budget_bytes``; None: ``disk_free_share`` of the room found at start-up, see
    ``choose_disk_budget``); eviction order from ``POLICIES[policy]``. Thread-safe."""

    def __init__(
        self,
        root: Path,
        ram_budget_bytes: int,
        disk_budget_bytes: int | None = None,
        policy: str = "lru",
        pin_memory: bool = False,
        prefetch_threads: int = 1,
        disk_free_share: float = 0.5,
        device_budget_bytes: int = 0,
        device: torch.device | str = "cpu",
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}: choose one of {sorted(POLICIES)}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # the worker sets it on CUDA: host -> device copies can then run async
        self.pin_memory = pin_memory
        found = scan(self.root)  # partials of gone processes removed first: their room counts
        budget = choose_disk_budget(
            disk_budget_bytes, disk_free_share, free_bytes(self.root), found.held_bytes
        )
        self.device = torch.device(device)
        self._manager = CacheManager(
            ram_budget_bytes, budget.budget_bytes, POLICIES[policy], device_budget_bytes
        )
        metrics = self._manager.metrics
        metrics.corrupt_entries = found.corrupt
        metrics.partials_removed = found.partials_removed
        metrics.partial_bytes_removed = found.partial_bytes_removed
        log.info(
            "cache disk budget root=%s budget_bytes=%d reason=%s partials_removed=%d "
            "partial_bytes_removed=%d",
            self.root,
            budget.budget_bytes,
            budget.reason,
            found.partials_removed,
            found.partial_bytes_removed,
        )
        self._lock = threading.Lock()
        # one commit at a time: two of one key must not interleave
        self._commit_lock = threading.Lock()
        self._device: dict[str, MemoryTemplateCache] = {}  # copies on ``self.device``
        self._ram: dict[str, MemoryTemplateCache] = {}
        self._loads: dict[str, _Load] = {}
        self._promotions: dict[str, Future] = {}
        self._seen_ns: dict[str, int] = {}  # entry id -> last manifest mtime this worker set or saw
        self._recordings: dict[str, CacheWriter] = {}  # entry id -> this process's live recording
        self._executor = ThreadPoolExecutor(
            max_workers=prefetch_threads, thread_name_prefix="cache-prefetch"
        )
        # RAM -> device copies: not queued behind disk reads
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-device-copy")
        self._closed = False
        with self._lock:  # oldest first, so that recency policies rank them by age
            for entry in found.entries:
                self._seen_ns[entry.entry_id] = entry.mtime_ns
                self._execute(self._manager.register_disk(entry.entry_id, entry.size_bytes))
            log.info(
                "cache opened root=%s entries=%d disk_bytes=%d",
                self.root,
                len(self._manager.resident(Tier.DISK)),
                self._manager.used_bytes[Tier.DISK],
            )

    def _discover(self, entry_id: str) -> None:
        """Under the lock: an entry this manager does not know but that is complete on disk (another
        worker sharing the directory recorded it since start-up) is registered, as at start-up, so
        this worker reads it instead of recording the template again. One ``stat`` per miss."""
        if self._manager.residency(entry_id) is not Residency.MISS:
            return
        path = self.root / entry_id
        if not (path / MANIFEST).is_file():
            return
        try:
            cache = TemplateCache.open(path)
        except UNUSABLE:
            return  # half-written or damaged: not ours to delete; a miss
        if cache.key.digest() == entry_id:
            self._seen_ns[entry_id] = _mtime_ns(path / MANIFEST)
            evictions = self._manager.register_disk(entry_id, cache.bytes_total)
            self._execute(
                tuple(
                    e
                    for e in evictions
                    if not (isinstance(e, DeleteFromDisk) and e.entry_id == entry_id)
                )
            )

    def _sync_with_directory(self) -> None:
        """Under the lock: fold in what other workers sharing ``root`` did (module docstring). A
        directory scan and a ``stat`` per entry: run before a commit makes room on disk, not per
        step."""
        try:
            paths = list(self.root.iterdir())
        except OSError as exc:  # the directory is gone or unreadable: nothing to fold in now
            log.warning(
                "cache directory %s unreadable (%s): recordings fail meanwhile", self.root, exc
            )
            return
        listed = {}
        for path in paths:
            if not path.name.startswith("."):
                mtime_ns = _mtime_ns(path / MANIFEST)
                if mtime_ns:
                    listed[path.name] = mtime_ns
        for entry in self._manager.entries():
            if entry.on_disk and entry.entry_id not in listed:
                self._manager.disk_gone(entry.entry_id)
        used_elsewhere = sorted(
            (mtime_ns, entry_id)
            for entry_id, mtime_ns in listed.items()
            if mtime_ns > self._seen_ns.get(entry_id, 0)
        )
        # oldest first: the policy's order follows their times
        for mtime_ns, entry_id in used_elsewhere:
            if self._manager.residency(entry_id) is Residency.MISS:
                self._discover(entry_id)  # published by another worker: counted against the budget
            else:
                self._manager.touch(entry_id)
            self._seen_ns[entry_id] = mtime_ns

    def _stamp_use(self, entry_id: str) -> None:
        """Under the lock: tell workers sharing ``root`` that this entry was just used."""
        now_ns = time.time_ns()
        try:
            os.utime(self.root / entry_id / MANIFEST, ns=(now_ns, now_ns))
        except OSError:
            return  # deleted meanwhile: the read meets it
        self._seen_ns[entry_id] = now_ns

    # ----- reading --------------------------------------------------------------------------------
    def acquire(self, key: CacheKey) -> MemoryTemplateCache | TemplateCache | None:
        """A pinned handle for ``key`` (``release`` it when done): its device copy when it has one,
        else from RAM whenever the entry fits there (a hit in RAM starts its promotion to the
        device), or None on a miss or an unusable entry. Raises only ``CacheMismatchError``."""
        entry_id = key.digest()
        with self._lock:
            self._discover(entry_id)
            residency = self._manager.lookup(entry_id, now=time.monotonic())
            if residency is Residency.MISS:
                return None
            self._stamp_use(entry_id)
            self._manager.pin(entry_id)
            handle = self._device.get(entry_id)
            if handle is None:
                handle = self._ram.get(entry_id)
            if residency is Residency.RAM:
                self._promote_locked(entry_id, for_queued_job=False)
            load, run_here = self._pending_load(entry_id, residency)
        if handle is None:
            handle = self._finish_load(entry_id, load, run_here)
        if handle is None:
            self.release(key)  # a no-op when the entry was forgotten
            return None
        if handle.key != key:
            self.release(key)
            raise CacheMismatchError(
                "template cache was recorded for other inputs: "
                + "; ".join(key.mismatches(handle.key))
            )
        return handle

    def _pending_load(self, entry_id: str, residency: Residency) -> tuple[_Load | None, bool]:
        """Under the lock: the load to run here or wait for (reserved now when on disk only), and
        whether this thread runs it."""
        if residency in (Residency.DEVICE, Residency.RAM):
            return None, False
        load = (
            self._loads.get(entry_id)
            if residency is Residency.LOADING
            else self._reserve_load(entry_id)
        )
        if load is None or load.claimed:
            return load, False
        load.claimed = True  # run it in this thread rather than queue behind other prefetches
        return load, True

    def _finish_load(
        self, entry_id: str, load: _Load | None, run_here: bool
    ) -> MemoryTemplateCache | TemplateCache | None:
        if load is None:
            return self._open_disk(entry_id)
        if run_here:
            return self._run_load(entry_id, load)
        return load.done.result()

    def release(self, key: CacheKey) -> None:
        with self._lock:
            self._manager.unpin(key.digest())

    def invalidate(self, key: CacheKey, error: Exception) -> None:
        """A reader of an acquired disk handle found ``key``'s entry unusable (a file missing or
        failing its checksum mid-edit): forget it in both tiers (pins included, so a later
        ``release`` is a no-op) and delete its directory, so the next edit records it again."""
        with self._lock:
            self._discard(key.digest(), error)

    def prefetch(self, key: CacheKey) -> None:
        """Start loading ``key`` from disk into RAM in the background, then copying it to the
        device (or copying it at once when it is in RAM already); nothing where it is, or when the
        tier is taken by entries in use or prefetched for jobs queued earlier (their rows come
        first; ``ready`` starts the read when this row's turn comes)."""
        with self._lock:
            self._prefetch_locked(key.digest(), speculative=True)

    def _prefetch_locked(self, entry_id: str, speculative: bool) -> None:
        """Under the lock: start the disk -> RAM load the manager plans for an entry on disk only
        (``CacheManager.plan_prefetch``: a ``speculative`` one never evicts entries prefetched for
        queued rows), or the RAM -> device copy of an entry in RAM."""
        self._discover(entry_id)
        if self._closed:
            return
        plan = self._manager.plan_prefetch(entry_id, time.monotonic(), speculative)
        if plan is not None:
            self._start_load(entry_id, plan.evictions, for_queued_job=True)
        elif self._manager.residency(entry_id) is Residency.RAM:
            self._promote_locked(entry_id, for_queued_job=True)

    def ready(self, key: CacheKey) -> bool:
        """Whether a row of ``key`` may join the batch now, ``acquire(key)`` returning at once
        (``CacheManager.acquirable_now``). An entry on disk only starts its load here (if none
        runs: e.g. evicted from RAM since it was prefetched) and reads False until the load lands,
        or, when RAM is full of entries in use, until a running row releases one: the worker keeps
        such a row queued (prefetch-gated admission) instead of stalling its running batch on the
        read, or on file-by-file disk reads in every step."""
        entry_id = key.digest()
        with self._lock:
            self._prefetch_locked(entry_id, speculative=False)
            return self._manager.acquirable_now(entry_id)

    def _reserve_load(
        self, entry_id: str, spare_prefetched: bool = False, background: bool = False
    ) -> _Load | None:
        """Under the lock: reserve RAM and make room; None when the entry cannot fit in RAM now."""
        plan = self._manager.prepare_load(entry_id, spare_prefetched=spare_prefetched)
        if plan is None or not plan.ok:
            return None
        return self._start_load(entry_id, plan.evictions, background)

    def _start_load(
        self,
        entry_id: str,
        evictions: tuple[Eviction, ...],
        background: bool = True,
        for_queued_job: bool = False,
    ) -> _Load:
        """Under the lock: execute a reserved load's evictions and register the load; run it on the
        prefetch threads when ``background`` (else the caller claims it)."""
        self._execute(evictions)
        load = self._loads[entry_id] = _Load(for_queued_job=for_queued_job)
        if background:
            self._executor.submit(self._claim_and_run, entry_id, load)
        return load

    def _claim_and_run(self, entry_id: str, load: _Load) -> None:
        with self._lock:
            if load.claimed:
                return  # an acquire got there first
            load.claimed = True
        self._run_load(entry_id, load)

    def _run_load(self, entry_id: str, load: _Load) -> MemoryTemplateCache | None:
        """Outside the lock: read the entry, then publish it (or discard it) under the lock."""
        started = time.perf_counter()
        handle, error = None, None
        try:
            handle = MemoryTemplateCache.load(self.root / entry_id, self.pin_memory)
        except UNUSABLE as exc:
            error = exc
        except Exception:  # e.g. out of memory: the entry itself may be fine, keep it on disk
            log.exception("cache load failed entry=%s", entry_id)
        with self._lock:
            self._loads.pop(entry_id, None)
            self._manager.complete_load(entry_id, ok=handle is not None)
            if error is not None:
                self._discard(entry_id, error)
            elif self._manager.residency(entry_id) is Residency.RAM:
                self._ram[entry_id] = handle
                log.debug(
                    "cache load entry=%s bytes=%d seconds=%.3f",
                    entry_id,
                    handle.bytes_total,
                    time.perf_counter() - started,
                )
                self._promote_locked(entry_id, load.for_queued_job)
            else:
                handle = None  # forgotten while loading
        load.done.set_result(handle)
        return handle

    def _open_disk(self, entry_id: str) -> TemplateCache | None:
        """The entry does not fit in RAM: read it lazily from disk instead."""
        try:
            return TemplateCache.open(self.root / entry_id)
        except UNUSABLE as exc:
            with self._lock:
                self._discard(entry_id, exc)
            return None

    # ----- the device tier ----------------------------------------------------------------------
    def _promote_locked(self, entry_id: str, for_queued_job: bool) -> None:
        """Under the lock: start the RAM -> device copy the manager plans (none while the tier is
        off, full of entries in use or promoted for queued jobs, or the entry is not in RAM)."""
        if self._closed:
            return
        plan = self._manager.plan_promotion(entry_id, for_queued_job)
        if plan is None:
            return
        self._execute(plan.evictions)
        source = self._ram[entry_id]
        self._promotions[entry_id] = self._copier.submit(self._run_promotion, entry_id, source)

    def _run_promotion(self, entry_id: str, source: MemoryTemplateCache) -> None:
        """Outside the lock: copy the entry to the device, then publish it under the lock (or
        return its reservation: out of device memory, or forgotten meanwhile)."""
        on_device = None
        try:
            on_device = source.to_device(self.device)
        except Exception:  # e.g. out of device memory: the entry stays readable from RAM
            log.exception("cache promotion to %s failed entry=%s", self.device, entry_id)
        with self._lock:
            self._promotions.pop(entry_id, None)
            self._manager.complete_promotion(entry_id, ok=on_device is not None)
            if on_device is not None and self._manager.residency(entry_id) is Residency.DEVICE:
                self._device[entry_id] = on_device

    def release_device_bytes(self, nbytes: int) -> int:
        """Give back at least ``nbytes`` of device memory (less when the device tier's unpinned
        entries hold less), demoting entries by the policy; returns the bytes released. The
        tier's budget shrinks by as much, so later promotions leave that memory to the caller (a
        worker that met CUDA out-of-memory; PyTorch's allocator reuses the freed blocks when it
        retries)."""
        with self._lock:
            release = self._manager.release_device(nbytes)
            self._execute(release.evictions)
            budget = self._manager.budget_bytes[Tier.DEVICE]
        log.warning(
            "cache device tier gave back bytes=%d asked=%d budget_bytes=%d",
            release.released_bytes,
            nbytes,
            budget,
        )
        return release.released_bytes

    # ----- recording ------------------------------------------------------------------------------
    def writer(
        self,
        key: CacheKey,
        num_units: int,
        halves: int,
        dtype: torch.dtype,
        num_steps: int,
        latent_bytes: int,
    ) -> CacheWriter | None:
        """A writer for a new recording of ``key``: ``num_steps`` steps, then a trajectory of
        ``num_steps + 1`` latents of ``latent_bytes`` (they bound its size, reserved before its
        first byte). None when this process records ``key`` already, or even its partial
        directory fails (the row runs without recording)."""
        entry_id = key.digest()
        budget = WriteBudget(
            num_steps,
            latent_bytes,
            partial(self._reserve_recording, entry_id),
            partial(self._end_recording, entry_id),
        )
        with self._lock:
            if self._closed or entry_id in self._recordings:
                return None
            try:
                writer = CacheWriter(self.root, key, num_units, halves, dtype, budget)
            except OSError as exc:
                log.warning("cache recording not started entry=%s error=%s", entry_id, exc)
                return None
            self._recordings[entry_id] = writer
        return writer

    def _reserve_recording(self, entry_id: str, size_bytes: int) -> bool:
        """A recording's first write asks for ``size_bytes`` on disk: evict by the policy to make
        room, or refuse (counted in ``records_skipped``) when it cannot fit, or another worker has
        published the entry meanwhile."""
        with self._lock:
            self._sync_with_directory()  # budget and recency over what every worker did
            self._discover(entry_id)
            if self._closed or self._manager.known(entry_id):
                return False
            plan = self._manager.prepare_store(entry_id, size_bytes, Tier.DISK)
            if not plan.ok:
                self._manager.metrics.records_skipped += 1
                log.info(
                    "cache recording skipped entry=%s reason=%s: the row runs without the cache",
                    entry_id,
                    plan.reason,
                )
                return False
            self._execute(plan.evictions)
            return True

    def _end_recording(self, entry_id: str, error: Exception | None) -> None:
        """A recording ended without a commit (its writer removed its partial): return its
        reservation; a disk error is logged and counted here, once."""
        with self._lock:
            self._recordings.pop(entry_id, None)
            self._manager.abandon_store(entry_id)
            if isinstance(error, DISK_ERRORS):
                self._manager.metrics.record_failures += 1
                log.warning(
                    "cache recording failed entry=%s error=%s: the row continues without the cache",
                    entry_id,
                    error,
                )

    def commit(self, writer: CacheWriter) -> TemplateCache | None:
        """Publish a recording from ``writer`` on disk, then load it into RAM in the background.

        Returns the (unpinned) disk handle, or None when the recording failed, the disk tier
        cannot take it, or another worker published the key meanwhile (the writer is aborted).
        Never raises.
        """
        entry_id = writer.key.digest()
        with self._commit_lock:
            with self._lock:
                self._sync_with_directory()  # budget and recency over what every worker did
                theirs = (self.root / entry_id / MANIFEST).is_file()
                reserved = self._manager.storing(entry_id)  # the recording got its room
            if theirs or writer.failed is not None or not reserved:
                writer.abort()  # returns our reservation...
                with self._lock:
                    self._discover(entry_id)  # ...so that theirs is registered: we read it
                return None
            try:
                disk = writer.commit()
            except UNUSABLE as exc:
                writer.failed = exc  # logged and counted once, by ``_end_recording``
                writer.abort()
                shutil.rmtree(self.root / entry_id, ignore_errors=True)  # unregistered: ours
                return None
            with self._lock:
                self._recordings.pop(entry_id, None)
                plan = self._manager.settle_store(entry_id, disk.bytes_total)
                if not plan.ok:
                    shutil.rmtree(disk.path, ignore_errors=True)
                    log.warning("cache entry not kept entry=%s reason=%s", entry_id, plan.reason)
                    return None
                self._execute(plan.evictions)
                self._manager.complete_store(entry_id, ok=True)
                # our own write, not a use elsewhere
                self._seen_ns[entry_id] = _mtime_ns(disk.path / MANIFEST)
                if not self._closed:  # likely edited again: loaded speculatively
                    self._reserve_load(entry_id, spare_prefetched=True, background=True)
        return disk

    # ----- executing the manager's decisions (under the lock) -------------------------------------
    def _execute(self, evictions: tuple[Eviction, ...]) -> None:
        for action in evictions:
            if isinstance(action, DeleteFromDisk):
                shutil.rmtree(self.root / action.entry_id, ignore_errors=True)
            elif isinstance(action, DropFromRam):
                self._ram.pop(action.entry_id)
            elif isinstance(action, DropFromDevice):
                self._device.pop(action.entry_id)
            elif isinstance(action, DemoteToRam):
                self._demote(action.entry_id)
            elif isinstance(action, SpillToDisk):
                self._spill(action.entry_id)

    def _demote(self, entry_id: str) -> None:
        """Copy a device entry back to host memory (its RAM copy was dropped meanwhile)."""
        on_device = self._device.pop(entry_id)
        try:
            self._ram[entry_id] = on_device.to_host(self.pin_memory)
        except Exception as exc:  # e.g. out of pinned host memory: the copy is lost
            log.warning("cache demotion failed entry=%s error=%s: entry dropped", entry_id, exc)
            self._manager.forget(entry_id)

    def _spill(self, entry_id: str) -> None:
        handle = self._ram.pop(entry_id)
        try:
            handle.save(self.root)
            self._seen_ns[entry_id] = _mtime_ns(self.root / entry_id / MANIFEST)
        except OSError as exc:
            log.warning("cache spill failed entry=%s error=%s: entry dropped", entry_id, exc)
            self._manager.forget(entry_id)
            self._manager.metrics.store_failures += 1

    def _discard(self, entry_id: str, exc: Exception) -> None:
        if not (self.root / entry_id).exists():  # another worker sharing the directory deleted it
            log.info("cache entry gone from disk entry=%s: deleted by another worker", entry_id)
            self._manager.forget(entry_id)
            self._ram.pop(entry_id, None)
            self._device.pop(entry_id, None)
            return
        log.warning("cache entry unusable, deleted entry=%s error=%s", entry_id, exc)
        self._manager.forget(entry_id, corrupt=True)
        self._ram.pop(entry_id, None)
        self._device.pop(entry_id, None)
        shutil.rmtree(self.root / entry_id, ignore_errors=True)

    # ----- introspection --------------------------------------------------------------------------
    @property
    def metrics(self) -> CacheMetrics:
        """A consistent copy of the counters (``metrics.snapshot()`` for logs)."""
        with self._lock:
            return copy.deepcopy(self._manager.metrics)

    def resident(self, tier: Tier) -> list[str]:
        """Entry ids (key digests) readable from ``tier``."""
        with self._lock:
            return self._manager.resident(tier)

    def wait_for_loads(self, timeout_s: float | None = None) -> None:
        """Block until the loads in flight now (prefetches, promotions) have finished, the device
        copies they start included."""
        with self._lock:
            pending = [load.done for load in self._loads.values()]
        for done in pending:
            done.result(timeout=timeout_s)
        with self._lock:
            promotions = list(self._promotions.values())
        for promotion in promotions:
            promotion.result(timeout=timeout_s)

    def close(self) -> None:
        """Finish in-flight loads, stop the prefetch threads and abort the recordings still open
        (a stopping worker leaves no partial behind)."""
        with self._lock:
            self._closed = True
            open_recordings = list(self._recordings.values())
        for writer in open_recordings:
            writer.abort()
        self._executor.shutdown(wait=True)
        self._copier.shutdown(wait=True)

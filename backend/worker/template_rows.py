"""The engine worker's rows and their template caches: acquiring (pinning) a row's entry, recording
a template on a row's way, and starting rows over when an entry turns out broken. A mixin of
``backend.worker.loop.EngineWorker`` (split out to keep each module small); it reads the worker's
``engine``, ``caches``, ``admission``, ``jobs``, ``scheduler``, ``stats`` and calls its ``_emit``
and ``_release``.

Invariants (the worker's): a row holds at most one acquired entry (``_Job.cache_key`` set while it
does) and releases it when it leaves; one template is recorded by at most one row of a worker at a
time (``AdmissionRules``); a row reading a broken entry starts over densely at step 0.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from backend.engine.cache_store import CacheCorruptError, CacheError, CacheKey
from backend.worker.admission import Candidate

if TYPE_CHECKING:
    from backend.worker.loop import EngineWorker, _Job

log = logging.getLogger(__name__)


class TemplateCaches(Protocol):
    """The tiered activation cache as the worker uses it (``backend.cache``'s tiered cache)."""

    def acquire(self, key: CacheKey): ...

    def release(self, key: CacheKey) -> None: ...

    def invalidate(self, key: CacheKey, error: Exception) -> None: ...

    def prefetch(self, key: CacheKey) -> None: ...

    def ready(self, key: CacheKey) -> bool: ...

    def writer(
        self,
        key: CacheKey,
        num_units: int,
        halves: int,
        dtype: torch.dtype,
        num_steps: int,
        latent_bytes: int,
    ): ...

    def commit(self, writer): ...


class TemplateRows:
    """The template-cache side of ``EngineWorker`` (module docstring)."""

    def _candidate(self, job: _Job) -> Candidate:
        key = job.prepared.cache_key
        reads_cache = self.caches is not None and key is not None and job.params.use_cache
        return Candidate(
            job.message.job_id,
            key.digest() if reads_cache else "",
            # a template cache is the base model's: a row with adapters never records one
            records_on_miss=job.message.prepare
            or (job.params.record_on_first_edit and not job.message.adapters),
            prepare=job.message.prepare,
        )

    def _acquire_early(self, job: _Job) -> tuple:
        """(handle, error) of the row's cache, acquired (pinned) as soon as the row is found ready:
        a read started for a row behind it in the same schedule must not evict it. An error is
        raised later by ``_admit``, where admission failures are handled."""
        try:
            return self._acquire(job), None
        except Exception as exc:
            return None, exc

    def _take_cache(self, job: _Job):
        """The row's cache handle: the one ``_ready`` acquired, else acquired now."""
        if job.early_cache is None:
            return self._acquire(job)
        (cache, error), job.early_cache = job.early_cache, None
        if error is not None:
            raise error
        return cache

    def _drop_broken_cache(self, job: _Job, exc: CacheCorruptError) -> None:
        log.warning(
            "template cache %s of %s is unusable (%s): the row computes densely and the cache is "
            "recorded again",
            job.cache_key.digest(),
            job.message.job_id,
            exc,
        )
        self.caches.invalidate(job.cache_key, exc)
        self._release(job)
        self.stats.cache_fallbacks += 1

    def _acquire(self, job: _Job):
        key = job.prepared.cache_key
        if self.caches is None or key is None or not job.params.use_cache:
            return None
        cache = self.caches.acquire(key)
        if cache is None:
            return None
        job.cache_key = key
        if cache.num_units != self.engine.num_units:
            log.warning(
                "cache %s has %d units, model has %d: computing densely",
                key.digest(),
                cache.num_units,
                self.engine.num_units,
            )
            self._release(job)
            return None
        return cache

    def _should_record(self, job: _Job, forced: bool = False) -> bool:
        """Record this row's template cache on its way (``AdmissionRules.should_record``)."""
        return self.admission.should_record(self._candidate(job), forced)

    def _start_recording(self, job: _Job) -> None:
        key, state = job.prepared.cache_key, job.state
        state.writer = self.caches.writer(
            key,
            self.engine.num_units,
            state.req.halves,
            self.engine.adapter.dtype,
            num_steps=len(state.req.timesteps),
            latent_bytes=state.latents.numel() * state.latents.element_size(),
        )
        if state.writer is not None:
            self.admission.start_recording(key.digest())

    def _drop_ended_recordings(self, job_ids: list[str]) -> None:
        """Rows whose recording ended early (no room on the cache disk, or a write failed: the
        writer already removed its partial and the cache logged it) go on as plain dense rows: the
        same computation, nothing recorded, so they stop stepping apart from rows reading caches.
        """
        for job_id in job_ids:
            job = self.jobs[job_id]
            if job.state.writer is not None and job.state.writer.failed is not None:
                job.state.writer = None
                self.admission.end_recording(job.prepared.cache_key.digest())

    def _restart_rows_on_broken_cache(self, job_ids: list[str], exc: Exception) -> bool:
        """The rows reading the entry ``exc`` names start over densely at step 0 (see the module
        docstring); False when ``exc`` is not a broken cache entry one of these rows reads."""
        entry = getattr(exc, "entry_path", None) if isinstance(exc, CacheCorruptError) else None
        broken = [
            j
            for j in job_ids
            if entry is not None
            and self.jobs[j].state.cache is not None
            and Path(self.jobs[j].state.cache.path) == Path(entry)
        ]
        for job_id in broken:
            job = self.jobs[job_id]
            self._drop_broken_cache(job, exc)
            job.state = self.engine.admit(job.prepared, None)
            if self._should_record(job):
                self._start_recording(job)
            self.scheduler.restart(job_id)
            self._emit(
                job_id,
                "running",
                step=0,
                num_steps=job.message.num_steps,
                message="template cache unusable: recomputing without it from step 0",
            )
        return bool(broken)

    def _commit_recording(self, job: _Job) -> bool:
        """Publish the row's recording; False when it was not kept (the cache says why)."""
        state = job.state
        self.admission.end_recording(job.prepared.cache_key.digest())
        try:
            state.writer.write_trajectory(
                {"latents": torch.cat(state.recorded_latents + [state.latents])}
            )
            return self.caches.commit(state.writer) is not None
        except (OSError, CacheError) as exc:  # the edit itself is fine; only the cache is lost
            log.warning("recording the cache of %s failed: %s", job.message.job_id, exc)
            state.writer.abort()
            return False


class JobCacheGate:
    """The worker's tiered cache as ``AdmissionRules`` asks it, per waiting job."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker

    def ready(self, row: Candidate) -> bool:
        return self.worker.caches.ready(self.worker.jobs[row.job_id].prepared.cache_key)

    def acquire(self, row: Candidate) -> bool:
        job = self.worker.jobs[row.job_id]
        cache, error = job.early_cache = self.worker._acquire_early(job)
        return cache is None and error is None

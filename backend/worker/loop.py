"""The engine worker: admit new requests -> run ONE denoising step for the running batch -> retire.

The loop is the thin shell around the pure ``BatchScheduler``: it turns prepared requests (files
written by pre-processing) into engine states, runs the scheduler's groups through
``MaskAwareEngine.step`` and hands final latents to post-processing by reference. It never
decodes or encodes an image, except in ``inline`` mode, whose whole point is to measure what doing
so inside the loop costs. Live previews (``backend.engine.previews``: latents mapped linearly to
colours, no VAE) ride the step events, within their time budget.

Invariants: every job that reaches the inbox ends with exactly one terminal event from this worker
(denoised -> handed on, failed, or cancelled) and is acked then; a cache entry acquired for a row is
released when the row leaves; one template is recorded by at most one row at a time.

Prefetch-gated admission (FlashPS's bubble-free serving): which waiting row joins the batch is
decided by ``backend.worker.admission.AdmissionRules`` (the route simulation's workers apply the
same rules), over the tiered cache: a row joins only when acquiring its cache will not wait, and
waits for a recording of its template by this worker to be committed. A row found ready acquires
(pins) its entry at once (``_Job.early_cache``). With nothing else to run the loop polls its inbox
every ``HELD_POLL_S`` while the reads land.

A broken template cache never fails a job: an entry found missing or corrupt when acquired reads as
a miss (``TieredActivationCache``); one whose file turns out missing or corrupt when the row is
admitted or at a later step (a disk handle verifies each file on first read) is dropped from both
tiers, and every row reading it starts over at step 0 computing densely (a row cannot switch
mid-trajectory: its unmasked latents followed the template's), recording the entry again on its
way. Rows of the same forward that read other caches just step at the next iteration (a failed
forward changed no state).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from backend.blobs import BlobStore, job_blob_name
from backend.engine.cache_store import CacheCorruptError, CacheError, CacheKey
from backend.engine.editor import EditParams, EditState, MaskAwareEngine
from backend.engine.prepared import PreparedRequest
from backend.engine.previews import JobPreview, Previews
from backend.protocol import CancelJob, DenoisedJob, EditJob, JobEvent, PreparedJob
from backend.worker.adapter_tiers import RowAdapters
from backend.worker.admission import AdmissionRules, Candidate
from backend.worker.batching import BatchScheduler, Row
from backend.worker.channels import Inbox, JobSink
from backend.worker.stats import WorkerStats

log = logging.getLogger(__name__)

HELD_POLL_S = 0.005  # inbox poll while every waiting row waits for its cache and nothing runs
NOT_RECORDED = (
    "cache not recorded (no room on the cache disk, or a write failed): edits of this template "
    "compute without it"
)


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


class InlineStages(Protocol):
    """Pre/post-processing run inside the loop (``inline`` mode only)."""

    def preprocess(self, job: EditJob) -> PreparedJob: ...

    def postprocess(self, job: DenoisedJob) -> None: ...


@dataclass
class _Job:
    message: PreparedJob
    prepared: PreparedRequest
    params: EditParams
    received_at: float
    state: EditState | None = None
    cache_key: CacheKey | None = None  # set while the row holds an acquired cache entry
    # (handle, error) acquired when found ready, until ``_admit`` takes it
    early_cache: tuple | None = None
    timings: dict[str, float] = field(default_factory=dict)
    preview: JobPreview | None = None  # set at admission when the worker makes previews


class EngineWorker:
    def __init__(
        self,
        engine: MaskAwareEngine,
        blobs: BlobStore,
        inbox: Inbox,
        sink: JobSink,
        *,
        worker_id: str = "worker-0",
        mode: str = "continuous",
        max_batch: int = 8,
        caches: TemplateCaches | None = None,
        stages: InlineStages | None = None,
        previews: Previews | None = None,
        adapters: RowAdapters | None = None,
    ):
        if mode == "inline" and stages is None:
            raise ValueError("inline batching runs pre/post-processing in the loop: pass `stages`")
        self.engine, self.blobs, self.inbox, self.sink = engine, blobs, inbox, sink
        self.worker_id, self.mode, self.caches, self.stages = worker_id, mode, caches, stages
        self.previews = previews  # live previews on running events (None: off)
        self.adapters = adapters  # LoRA tiers and late joins (None: jobs with adapters fail)
        self.scheduler = BatchScheduler(max_batch, mode)
        self.jobs: dict[str, _Job] = {}
        self.stats = WorkerStats()
        self.admission = AdmissionRules()  # which waiting row may join; templates recorded
        self._gate = _JobCacheGate(self)
        self._held = False  # the last schedule held rows back and nothing ran
        self._cancel_before_arrival: set[str] = set()

    # ----- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event, idle_poll_s: float = 0.05) -> None:
        while not stop.is_set():
            self.iterate(idle_poll_s)

    def iterate(self, idle_poll_s: float = 0.0) -> bool:
        """One iteration; blocks up to ``idle_poll_s`` for work only when nothing runs. True if a
        step ran."""
        for message in self.inbox.poll(self._inbox_wait_s(idle_poll_s)):
            self._receive(message)
        started = time.perf_counter()
        self.admission.start_schedule()
        out = self.scheduler.schedule(time.time(), self._ready)
        self._held = bool(out.held) and not self.scheduler.running
        self.stats.record_held(len(out.held))
        for job_id in out.cancelled:
            self._finish(job_id, "cancelled", "cancelled by the user")
        job_work_started = time.perf_counter()
        for job_id in out.admitted:
            self._admit(job_id)
        job_work_s = time.perf_counter() - job_work_started
        stepped, forward_s = [], 0.0
        for group in out.groups:
            # admitted ok
            group = [j for j in group if j in self.jobs and self.jobs[j].state is not None]
            # a row recording its template's cache runs apart from rows reading caches: cached units
            # skip the K/V the recording needs (see MaskAwareEngine.step)
            recording = [j for j in group if self.jobs[j].state.writer is not None]
            for part in (recording, [j for j in group if j not in recording]):
                if part:
                    ran, seconds = self._step_group(part)
                    stepped += ran
                    forward_s += seconds
        retiring = self.scheduler.update_from_output(stepped)
        job_work_started = time.perf_counter()
        for row in retiring:
            self._retire(row)
        job_work_s += time.perf_counter() - job_work_started
        if stepped:
            self.stats.record_step(
                len(stepped), time.perf_counter() - started, forward_s, job_work_s
            )
        return bool(stepped)

    def _inbox_wait_s(self, idle_poll_s: float) -> float:
        """How long to block on the inbox: the whole poll when there is no work; a short poll when
        every waiting row is held on its cache and nothing runs (so a landed read is seen soon);
        none while a batch runs."""
        if self.scheduler.idle:
            return idle_poll_s
        return min(idle_poll_s, HELD_POLL_S) if self._held else 0.0

    # ----- arrivals -----------------------------------------------------------------------------
    def _receive(self, message) -> None:
        if isinstance(message, CancelJob):
            if not self.scheduler.cancel(message.job_id):
                self._cancel_before_arrival.add(message.job_id)
            return
        if message.job_id in self.jobs:  # delivered twice: its entries are acked when it leaves
            log.warning("job %s is scheduled here already: duplicate dropped", message.job_id)
            return
        if isinstance(message, EditJob):
            message = self._inline_preprocess(message)
            if message is None:
                return
        if message.job_id in self._cancel_before_arrival:
            self._cancel_before_arrival.discard(message.job_id)
            self._emit(message.job_id, "cancelled", message="cancelled before it started")
            self.inbox.ack(message.job_id)
            return
        self._enqueue(message)

    def _inline_preprocess(self, job: EditJob) -> PreparedJob | None:
        try:
            return self.stages.preprocess(job)
        except Exception as exc:  # a bad request must not take the loop down
            log.warning("inline pre-processing of %s failed: %s", job.job_id, exc)
            self._emit(job.job_id, "failed", message=str(exc))
            self.inbox.ack(job.job_id)
            return None

    def _enqueue(self, message: PreparedJob) -> None:
        try:
            prepared = PreparedRequest.load(
                self.blobs.path(message.prepared_ref), self.engine.adapter.device
            )
            params = EditParams.from_dict(prepared.params)
        except Exception as exc:
            self._emit(message.job_id, "failed", message=f"prepared request unreadable: {exc}")
            self.inbox.ack(message.job_id)
            return
        job = _Job(message, prepared, params, received_at=time.time())
        self.jobs[message.job_id] = job
        if self.adapters is not None:
            self.adapters.queued(message.adapters)  # disk -> RAM while the job waits
            prepared.cache_key = self.adapters.cache_key(message, prepared.cache_key, self.caches)
        self.scheduler.add(
            Row(
                message.job_id,
                message.num_steps,
                self._group_key(job),
                message.mask_ratio,
                job.received_at,
                template=prepared.cache_key.digest() if prepared.cache_key else "",
                adapters=tuple(use.sha256 for use in message.adapters),
            )
        )
        if self.caches is not None and params.use_cache and prepared.cache_key is not None:
            self.caches.prefetch(prepared.cache_key)  # disk -> RAM while the job waits for a slot
        self._emit(message.job_id, "waiting", num_steps=message.num_steps)

    def _group_key(self, job: _Job) -> str:
        """Rows of equal keys share one forward pass: the same cache mode and resolution."""
        return f"{job.params.mode}:{job.params.size[0]}x{job.params.size[1]}"

    # ----- admission ------------------------------------------------------------------------------
    def _ready(self, row: Row) -> bool:
        """May ``row`` join the batch now without stalling it (``AdmissionRules.admit``)?"""
        job = self.jobs.get(row.job_id)
        return job is None or self.admission.admit(self._candidate(job), self._gate)

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

    def _admit(self, job_id: str) -> None:
        job = self.jobs[job_id]
        job.timings["wait_s"] = time.time() - job.received_at
        try:
            cache = self._take_cache(job)
            if job.message.prepare and (
                cache is not None or not self._should_record(job, forced=True)
            ):
                self._finish_prepare(
                    job_id, "already prepared" if cache is not None else "being recorded"
                )
                return
            job.state = self._admit_state(job, cache)
            self._admit_adapters(job)
            if job.state.cache is None and self._should_record(job, forced=job.message.prepare):
                self._start_recording(job)
        except Exception as exc:
            log.exception("admitting %s failed", job_id)
            self.scheduler.drop(job_id)
            self._finish(job_id, "failed", f"could not start: {exc}")
            return
        job.timings["admitted_at"] = time.time()
        job.preview = self._start_preview(job)
        self._emit(job_id, "running", step=0, num_steps=job.message.num_steps)

    def _admit_state(self, job: _Job, cache) -> EditState:
        """The row's engine state; densely when reading the cache's trajectory finds the entry
        broken."""
        try:
            return self.engine.admit(job.prepared, cache, record=job.message.prepare)
        except CacheCorruptError as exc:
            if cache is None:
                raise
            self._drop_broken_cache(job, exc)
            return self.engine.admit(job.prepared, None, record=job.message.prepare)

    def _admit_adapters(self, job: _Job) -> None:
        """The row's adapters join at its first step on which they are on the device."""
        if not job.message.adapters:
            return
        if self.adapters is None:
            raise ValueError("this worker serves no LoRA adapters")
        message = job.message
        self.adapters.admit(message.job_id, message.adapters, message.num_steps, message.prepare)

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

    # ----- steps ----------------------------------------------------------------------------
    def _step_group(self, job_ids: list[str]) -> tuple[list[str], float]:
        if self.adapters is not None:
            failed = self.adapters.before_step(job_ids, [self.jobs[j].state for j in job_ids])
            for job_id, reason in failed.items():
                self.scheduler.drop(job_id)
                self._finish(job_id, "failed", reason)
            job_ids = [j for j in job_ids if j not in failed]
            if not job_ids:
                return [], 0.0
        states = [self.jobs[j].state for j in job_ids]
        mode = self.jobs[job_ids[0]].params.mode
        before = [s.latents for s in states]  # the previews' clean estimates need both sides
        try:
            forward_s = self.engine.step(states, mode)
        except Exception as exc:  # one bad batch fails its rows, not the worker
            if self._restart_rows_on_broken_cache(job_ids, exc):
                return [], 0.0
            log.exception("step failed for %s", job_ids)
            for job_id in job_ids:
                self.scheduler.drop(job_id)
                self._finish(job_id, "failed", f"denoising failed: {exc}")
            return [], 0.0
        self._drop_ended_recordings(job_ids)
        previews = self._previews(job_ids, states, before, forward_s)
        now = time.time()
        self.sink.step_events(
            [
                JobEvent(
                    job_id=job_id,
                    status="running",
                    at=now,
                    worker_id=self.worker_id,
                    step=state.step,
                    num_steps=len(state.req.timesteps),
                    preview=previews.get(job_id, ""),
                )
                for job_id, state in zip(job_ids, states)
            ]
        )
        return job_ids, forward_s

    # ----- previews ------------------------------------------------------------------------------
    def _start_preview(self, job: _Job) -> JobPreview | None:
        if self.previews is None or job.message.prepare:  # a recording has no image to show
            return None
        try:
            return self.previews.start(self.engine, job.prepared)
        except Exception:  # a preview is never worth failing a job for
            log.exception("no previews for %s", job.message.job_id)
            return None

    def _previews(
        self,
        job_ids: list[str],
        states: list[EditState],
        before: list[torch.Tensor],
        forward_s: float,
    ) -> dict[str, str]:
        """Job id -> the preview of the step just taken, for the rows whose preview is due
        (``Previews.due``: their step, and the time budget), the longest-waiting rows first."""
        if self.previews is None:
            return {}
        rows = [
            (self.jobs[job_id].preview, job_id, state, latents)
            for job_id, state, latents in zip(job_ids, states, before)
        ]
        made, broken = self.previews.frames(rows, forward_s)
        for job_id in broken:
            self.jobs[job_id].preview = None
        return made

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

    # ----- leaving --------------------------------------------------------------------------
    def _retire(self, row: Row) -> None:
        job = self.jobs[row.job_id]
        state = job.state
        recorded = state.writer is not None and self._commit_recording(job)
        if job.message.prepare:  # a recording has no image: it is done once the cache is committed
            job.timings["denoise_s"] = time.time() - job.timings.pop("admitted_at")
            message = "cache recorded" if recorded else NOT_RECORDED
            self._finish_prepare(row.job_id, message, job.timings)
            return
        self._hand_on(job, state.latents, used_cache=state.cache is not None)

    def _hand_on(self, job: _Job, latents: torch.Tensor, used_cache: bool) -> None:
        """The row's final latents (one row) to a file, the job to post-processing by reference
        (in the loop itself with ``inline`` batching); the job leaves this worker."""
        job_id = job.message.job_id
        latents_ref, path = self.blobs.new_path("latents", job_blob_name("latents", job_id))
        save_file({"latents": latents.detach().to("cpu").contiguous()}, str(path))
        job.timings["denoise_s"] = time.time() - job.timings.pop("admitted_at")
        timings = {**job.message.timings, **job.timings}
        denoised = DenoisedJob(
            job_id=job_id,
            model_id=job.message.model_id,
            latents_ref=latents_ref,
            prepared_ref=job.message.prepared_ref,
            template_ref=job.message.template_ref,
            used_cache=used_cache,
            paste=job.message.paste,
            submitted_at=job.message.submitted_at,
            timings=timings,
            adapter_steps=self._release(job),
        )
        del self.jobs[job_id]
        self.stats.record_job("denoised")
        if self.mode == "inline":
            self.stages.postprocess(denoised)
        else:
            self.sink.denoised(denoised)
        self.inbox.ack(job_id)

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

    def _finish_prepare(self, job_id: str, message: str, timings: dict | None = None) -> None:
        job = self.jobs.pop(job_id, None)
        if job is not None:
            self._release(job)
            timings = {**job.message.timings, **(timings or job.timings)}
        self.scheduler.drop(job_id)
        self.stats.record_job("prepared")
        self._emit(job_id, "done", message=message, timings=timings or {})
        self.inbox.ack(job_id)

    def _release(self, job: _Job) -> dict[str, int]:
        """Unpin the row's cache and adapters; adapter id -> the step it joined at."""
        if job.cache_key is not None:
            self.caches.release(job.cache_key)
            job.cache_key = None
        return {} if self.adapters is None else self.adapters.leave(job.message.job_id)

    def _finish(self, job_id: str, status: str, message: str) -> None:
        """A job leaves without a result (cancelled or failed)."""
        job = self.jobs.pop(job_id, None)
        if job is not None:
            if job.state is not None and job.state.writer is not None:
                job.state.writer.abort()
                self.admission.end_recording(job.prepared.cache_key.digest())
            self._release(job)
        self._emit(job_id, status, message=message)
        self.inbox.ack(job_id)

    def _emit(self, job_id: str, status: str, **fields) -> None:
        if status in ("cancelled", "failed"):
            self.stats.record_job(status)
        self.sink.event(
            JobEvent(
                job_id=job_id, status=status, at=time.time(), worker_id=self.worker_id, **fields
            )
        )


class _JobCacheGate:
    """The worker's tiered cache as ``AdmissionRules`` asks it, per waiting job."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker

    def ready(self, row: Candidate) -> bool:
        return self.worker.caches.ready(self.worker.jobs[row.job_id].prepared.cache_key)

    def acquire(self, row: Candidate) -> bool:
        job = self.worker.jobs[row.job_id]
        cache, error = job.early_cache = self.worker._acquire_early(job)
        return cache is None and error is None

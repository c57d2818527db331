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

Deadlines (``DeadlinePlan``, docs/design/deadlines.md): the scheduler orders rows by their jobs'
service levels and may park a running row at a step boundary for a tighter one. A parked row
keeps its engine state and its pins (cache entry, adapters), so it is ready again at once and
resumes from the same step with the same latents; a row recording its template is never parked.
Measured iterations calibrate the plan's ``StepClock``; the scheduler's forecast rides the step
events (predicted finish) and reaches waiting rows when it moves (``ForecastNotes``). A row is
planned against its job's deadline less the finish tail (``FinishTail``: hand-off to done, as
the job records show it), and its predicted finish includes that tail. The template-cache half
of the worker (acquire, record, start over on a broken entry) is
``backend.worker.template_rows.TemplateRows``.

A broken template cache never fails a job: an entry found missing or corrupt when acquired reads as
a miss (``TieredActivationCache``); one whose file turns out missing or corrupt when the row is
admitted or at a later step (a disk handle verifies each file on first read) is dropped from both
tiers, and every row reading it starts over at step 0 computing densely (a row cannot switch
mid-trajectory: its unmasked latents followed the template's), recording the entry again on its
way. Rows of the same forward that read other caches just step at the next iteration (a failed
forward changed no state).

Running out of device memory in a step never takes the worker down
(``backend.worker.out_of_memory``, ``backend.worker.oom_rows.OutOfMemoryRows``): memory is given
back, the forward's rows are retried in halves so that those that fit still advance, a row that
does not fit even alone fails with the reason (its recording aborted), and the shape's batch is
capped until steps without running out of memory raise the cap again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from safetensors.torch import save_file

from backend.blobs import BlobStore, job_blob_name
from backend.costmodel.slack import last_step_by
from backend.engine.cache_store import CacheCorruptError, CacheKey
from backend.engine.editor import EditParams, EditState, MaskAwareEngine
from backend.engine.prepared import PreparedRequest
from backend.engine.previews import JobPreview, Previews
from backend.protocol import CancelJob, DenoisedJob, EditJob, JobEvent, PreparedJob
from backend.worker.adapter_tiers import RowAdapters
from backend.worker.admission import AdmissionRules
from backend.worker.batch_rows import Row
from backend.worker.batching import BatchScheduler
from backend.worker.channels import Inbox, JobSink
from backend.worker.deadlines import DeadlinePlan
from backend.worker.finish_tail import FinishTail
from backend.worker.forecasts import ForecastNotes
from backend.worker.oom_rows import OutOfMemoryRows, step_progress
from backend.worker.out_of_memory import BatchCaps, MemoryReleasers, StepOutcome
from backend.worker.stats import WorkerStats
from backend.worker.step_clock import JoinRule, StepClock
from backend.worker.template_rows import JobCacheGate, TemplateCaches, TemplateRows

log = logging.getLogger(__name__)

HELD_POLL_S = 0.005  # inbox poll while every waiting row waits for its cache and nothing runs
NOT_RECORDED = (
    "cache not recorded (no room on the cache disk, or a write failed): edits of this template "
    "compute without it"
)


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


class EngineWorker(TemplateRows, OutOfMemoryRows):
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
        plan: DeadlinePlan | None = None,
        clock: StepClock | None = None,
        join_rule: JoinRule | None = None,
        forecast_refresh_s: float = 0.0,
        finish_tail: FinishTail | None = None,
    ):
        if mode == "inline" and stages is None:
            raise ValueError("inline batching runs pre/post-processing in the loop: pass `stages`")
        self.engine, self.blobs, self.inbox, self.sink = engine, blobs, inbox, sink
        self.worker_id, self.mode, self.caches, self.stages = worker_id, mode, caches, stages
        self.previews = previews  # live previews on running events (None: off)
        self.adapters = adapters  # LoRA tiers and late joins (None: jobs with adapters fail)
        # fifo without a plan; with one, rows are ordered (and parked) by their deadlines
        # rows join a running batch only when it pays (None: while slots are free)
        # shapes whose forwards ran out of device memory run fewer rows (module docstring)
        self.batch_caps = BatchCaps(max_batch)
        self.scheduler = BatchScheduler(max_batch, mode, plan, join_rule, self.batch_caps)
        # asked, in order, to give device memory back when a step runs out of it
        self.memory = MemoryReleasers()
        self.clock = clock  # measured steps calibrate the plan's step time (None: nothing learns)
        # users are told the expected finish: the clock's prediction, not the plan's margin
        forecast_time = clock if clock is not None else (plan.step_time if plan else None)
        self.forecasts = ForecastNotes(self.scheduler, forecast_time, refresh_s=forecast_refresh_s)
        # how long its jobs take after the hand-off, rows planned to end that much earlier (the
        # service reads the tails from the job records; None: planned against the deadlines)
        self.finish_tail = finish_tail
        self.jobs: dict[str, _Job] = {}
        self.stats = WorkerStats(caps=self.batch_caps, graphs=getattr(engine, "graphs", None))
        self.admission = AdmissionRules()  # which waiting row may join; templates recorded
        self._gate = JobCacheGate(self)
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
        self.stats.record_deferred(len(out.deferred))
        self.stats.record_not_paying(len(out.not_paying))
        self.stats.record_parking(len(out.parked), len(out.resumed))
        for job_id in out.cancelled:
            self._finish(job_id, "cancelled", "cancelled by the user")
        job_work_started = time.perf_counter()
        for job_id in out.parked:
            self._park(job_id)
        for job_id in out.admitted:
            self._admit(job_id)
        self._tell_forecasts()
        job_work_s = time.perf_counter() - job_work_started
        stepped, forward_s = [], 0.0
        for group in out.groups:
            # admitted ok
            group = [j for j in group if j in self.jobs and self.jobs[j].state is not None]
            if not group:
                continue
            shape, outcome = self.scheduler.running[group[0]].group_key, StepOutcome()
            # a row recording its template's cache runs apart from rows reading caches: cached units
            # skip the K/V the recording needs (see MaskAwareEngine.step)
            recording = [j for j in group if self.jobs[j].state.writer is not None]
            for part in (recording, [j for j in group if j not in recording]):
                if part:
                    ran, seconds = self._step_group(shape, part, outcome)
                    stepped += ran
                    forward_s += seconds
            self.batch_caps.after_step(shape, outcome)
        stepped_rows = [self.scheduler.running[j] for j in stepped if j in self.scheduler.running]
        retiring = self.scheduler.update_from_output(stepped)
        job_work_started = time.perf_counter()
        for row in retiring:
            self._retire(row)
        job_work_s += time.perf_counter() - job_work_started
        if stepped:
            iteration_s = time.perf_counter() - started
            self.stats.record_step(len(stepped), iteration_s, forward_s, job_work_s)
            if self.clock is not None:
                self.clock.observe(stepped_rows, iteration_s)
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
            with self.blobs.reading(message.prepared_ref) as path:
                prepared = PreparedRequest.load(path, self.engine.adapter.device)
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
                deadline=last_step_by(message.service.deadline, self.finish_reserve_s()),
                priority=message.service.priority,
                service_class=message.service.service_class,
            )
        )
        if self.caches is not None and params.use_cache and prepared.cache_key is not None:
            self.caches.prefetch(prepared.cache_key)  # disk -> RAM while the job waits for a slot
        self._emit(message.job_id, "waiting", num_steps=message.num_steps)

    def finish_reserve_s(self) -> float:
        """Seconds a row's last step is planned before its job's deadline: the finish tail
        measured so far (``FinishTail``; 0 without one)."""
        return 0.0 if self.finish_tail is None else self.finish_tail.reserve_s()

    def _predicted_finish(self, last_step_at: float) -> float:
        """When the job is predicted to be done, its last step predicted at ``last_step_at`` (0:
        no forecast)."""
        return last_step_at + self.finish_reserve_s() if last_step_at else 0.0

    def _group_key(self, job: _Job) -> str:
        """Rows of equal keys share one forward pass: the same cache mode and resolution."""
        return f"{job.params.mode}:{job.params.size[0]}x{job.params.size[1]}"

    # ----- admission ------------------------------------------------------------------------------
    def _ready(self, row: Row) -> bool:
        """May ``row`` join the batch now without stalling it (``AdmissionRules.admit``)?"""
        job = self.jobs.get(row.job_id)
        if job is None or job.state is not None:
            return True  # gone, or parked: a parked row kept its cache and adapters pinned
        return self.admission.admit(self._candidate(job), self._gate)

    def _admit(self, job_id: str) -> None:
        job = self.jobs[job_id]
        if job.state is not None:  # a parked row resumes from the step it left at
            self._emit(
                job_id,
                "running",
                step=job.state.step,
                num_steps=job.message.num_steps,
                message=f"resumed at step {job.state.step}",
            )
            return
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
        # a recording (or a prepare job) never leaves the batch mid-way: rows of its template wait
        self.scheduler.running[job_id].parkable = (
            job.state.writer is None and not job.message.prepare
        )
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

    # ----- deadlines ------------------------------------------------------------------------
    def _park(self, job_id: str) -> None:
        """The row left the batch at this step boundary for a tighter one: it keeps its state
        (latents, scheduler position, generator) and its pins, and resumes from this step."""
        step = self.jobs[job_id].state.step
        self._emit(
            job_id,
            "running",
            step=step,
            num_steps=self.jobs[job_id].message.num_steps,
            message=f"parked at step {step}: jobs with tighter deadlines run first",
        )

    def _tell_forecasts(self) -> None:
        """This iteration's forecast; a waiting row whose forecast moved hears of it."""
        now = time.time()
        self.forecasts.update(now)
        for job_id, forecast in self.forecasts.due(now):
            job = self.jobs.get(job_id)
            if job is None:
                continue
            self._emit(
                job_id,
                "waiting",
                step=job.state.step if job.state is not None else 0,
                num_steps=job.message.num_steps,
                queue_position=forecast.position,
                predicted_start=forecast.start,
                predicted_finish=self._predicted_finish(forecast.finish),
            )

    # ----- steps ----------------------------------------------------------------------------
    def _step_group(
        self, shape: str, job_ids: list[str], outcome: StepOutcome
    ) -> tuple[list[str], float]:
        """One step of rows of ``shape`` that share forwards, in forwards of at most the shape's
        batch cap (``BatchCaps``); ``outcome`` gathers how the forwards went."""
        if self.adapters is not None:
            failed = self.adapters.before_step(job_ids, [self.jobs[j].state for j in job_ids])
            for job_id, reason in failed.items():
                self.scheduler.drop(job_id)
                self._finish(job_id, "failed", reason)
            job_ids = [j for j in job_ids if j not in failed]
        stepped, forward_s = [], 0.0
        for rows in self.batch_caps.split(shape, job_ids):
            ran, seconds = self._forward(rows, outcome)
            stepped += ran
            forward_s += seconds
        return stepped, forward_s

    def _forward(
        self, job_ids: list[str], outcome: StepOutcome, retried_alone: bool = False
    ) -> tuple[list[str], float]:
        """One forward of ``job_ids``; the rows that stepped and the forward's seconds. Running
        out of device memory retries the rows in halves (``_after_oom``)."""
        states = [self.jobs[j].state for j in job_ids]
        mode = self.jobs[job_ids[0]].params.mode
        before = [s.latents for s in states]  # the previews' clean estimates need both sides
        progress = [step_progress(s) for s in states]
        try:
            forward_s = self.engine.step(states, mode)
        except torch.OutOfMemoryError as exc:
            error = str(exc)
        except Exception as exc:  # one bad batch fails its rows, not the worker
            if self._restart_rows_on_broken_cache(job_ids, exc):
                return [], 0.0
            log.exception("step failed for %s", job_ids)
            for job_id in job_ids:
                self.scheduler.drop(job_id)
                self._finish(job_id, "failed", f"denoising failed: {exc}")
            return [], 0.0
        else:
            outcome.succeeded(len(job_ids))
            return self._stepped(job_ids, states, before, forward_s)
        # out of the except clause: its traceback held the failed forward's activations
        return self._after_oom(job_ids, progress, error, outcome, retried_alone)

    def _stepped(
        self,
        job_ids: list[str],
        states: list[EditState],
        before: list[torch.Tensor],
        forward_s: float,
    ) -> tuple[list[str], float]:
        """After a forward that succeeded: recordings that ended, previews, the step events."""
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
                    predicted_finish=self._predicted_finish(self.forecasts.finish_of(job_id)),
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
        if self.finish_tail is not None:  # the tail runs from the last step's end
            self.finish_tail.handed_on(job_id, time.time())
        with self.blobs.writing("latents", job_blob_name("latents", job_id)) as (latents_ref, path):
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
            service=job.message.service,
        )
        del self.jobs[job_id]
        self.stats.record_job("denoised")
        if self.mode == "inline":
            self.stages.postprocess(denoised)
        else:
            self.sink.denoised(denoised)
        self.inbox.ack(job_id)

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
        self.forecasts.forget(job.message.job_id)
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

"""The ``baseline`` worker: the ordinary diffusers pipeline behind the same stack, the measure.

What a user would otherwise run: per batch, one ordinary pipeline call (``run_ordinary_batch``: its
own text encoders, VAE encode, every token of every step, the pipeline's own batching, one forward
per step for the batch), no activation cache, no masked-token compute. Static batching: when no
call runs, the oldest waiting job and up to ``max_batch - 1`` more waiting jobs of its key (model,
size, steps, strength, guidance: what one call shares; ``BatchScheduler``'s ``baseline`` mode) run
in one call, to final latents in the engine's own format; each row then goes to post-processing as
an engine row does (``EngineWorker._hand_on``: the same VAE decode and paste-back, ``used_cache``
False). Everything around the call is the engine worker's: the inbox, events, acks, heartbeats.

The call's inputs are what pre-processing gave the engine: the template fit to the model's bucket
through the job's crop box (``fit_to_bucket``, as ``CpuStages.preprocess`` fits it) and the
prepared mask pixels; the prompt from the job, the seed and negative prompt from the prepared
request. A baseline stack's pre-processing encodes nothing for it (``CpuStages._baseline_request``:
mask, seed and settings, no tensors), so encoding is paid once, inside the call, as a user pays it.

Invariants (the engine worker's): every job that reaches the inbox ends with exactly one terminal
event from this worker (denoised -> handed on, failed, or cancelled) and is acked then. During a
call, each finished step emits a ``running`` event per row and reads the inbox without waiting; a
row cancelled then ends ``cancelled`` at once and is never handed on (its row still runs to the end
of the call: a pipeline call cannot drop a row; a call whose every row was cancelled stops at the
next step). A call that fails fails its rows only; the worker goes on. A cache recording (prepare)
ends done without running: the baseline keeps no cache. No previews.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from PIL import Image

from backend.blobs import BlobStore
from backend.config import CelerySettings
from backend.engine.editor import MaskAwareEngine
from backend.engine.ordinary import run_ordinary_batch
from backend.imaging.uploads import decode_image, fit_to_bucket
from backend.protocol import JobEvent
from backend.worker.baseline_adapters import AdapterFiles, fused_adapters
from backend.worker.channels import Inbox, JobSink
from backend.worker.loop import EngineWorker, _Job

log = logging.getLogger(__name__)

NO_CACHE = "nothing recorded: the baseline worker keeps no template cache"


def _joins_no_call(row) -> bool:
    """``BatchScheduler.schedule``'s ``ready`` during a call: no row joins a call under way."""
    return False


class BaselineWorker(EngineWorker):
    """An engine worker whose batches run as ordinary pipeline calls (module docstring).
    ``engine`` must hold every part of the model (``build_engine(role=FULL)``): only its pipeline
    and spec are used. ``max_pixels``: the largest template it decodes, as pre-processing checked
    it (``celery.max_upload_pixels``)."""

    def __init__(
        self,
        engine: MaskAwareEngine,
        blobs: BlobStore,
        inbox: Inbox,
        sink: JobSink,
        *,
        worker_id: str = "worker-0",
        max_batch: int = 8,
        max_pixels: int = CelerySettings.model_fields["max_upload_pixels"].default,
        adapter_files: AdapterFiles | None = None,
    ):
        super().__init__(
            engine, blobs, inbox, sink, worker_id=worker_id, mode="baseline", max_batch=max_batch
        )
        self.max_pixels = max_pixels
        # sha256 -> the adapter's file as users have it (diffusers/PEFT or kohya layout): the
        # baseline loads and fuses a call's adapters with diffusers, as a user would
        self.adapter_files = adapter_files
        self._step_started = 0.0  # when the call's current step began (per-step statistics)

    def iterate(self, idle_poll_s: float = 0.0) -> bool:
        """One iteration: admit a batch when none runs and run it in one pipeline call; blocks up
        to ``idle_poll_s`` for work only when nothing waits. True if a call ran."""
        for message in self.inbox.poll(self._inbox_wait_s(idle_poll_s)):
            self._receive(message)
        out = self.scheduler.schedule(time.time())
        for job_id in out.cancelled:
            self._finish(job_id, "cancelled", "cancelled by the user")
        for job_id in out.admitted:
            self._admit(job_id)
        batch = list(self.scheduler.running)  # one group: the scheduler's baseline mode
        if batch:
            self._run_call(batch)
        return bool(batch)

    def _group_key(self, job: _Job) -> str:
        """Rows of equal keys share one pipeline call (one model per worker; the key names it
        anyway, so that rows of two models could never meet)."""
        p = job.params
        # one call fuses one adapter set into the weights: rows of other sets run in other calls
        adapters = ",".join(f"{use.sha256}*{use.scale}" for use in job.message.adapters)
        return (
            f"{job.message.model_id}:{p.size[0]}x{p.size[1]}:{p.steps}:{p.strength}:{p.guidance}"
            f":{adapters}"
        )

    def _admit(self, job_id: str) -> None:
        """The row joins the next call (its inputs are read then); a recording ends here."""
        job = self.jobs[job_id]
        job.timings["wait_s"] = time.time() - job.received_at
        if job.message.prepare:
            self._finish_prepare(job_id, NO_CACHE)
            return
        job.timings["admitted_at"] = time.time()
        self._emit(job_id, "running", step=0, num_steps=job.message.num_steps)

    # ----- the call -------------------------------------------------------------------------------
    def _run_call(self, batch: list[str]) -> None:
        inputs = {job_id: self._inputs(job_id) for job_id in batch}
        rows = [job_id for job_id in batch if inputs[job_id] is not None]
        if not rows:
            return
        jobs = [self.jobs[job_id] for job_id in rows]
        try:
            with fused_adapters(
                self.engine.pipe, jobs[0].message.adapters, self.adapter_files
            ) as phases:
                self._step_started = time.perf_counter()
                latents = run_ordinary_batch(
                    self.engine.pipe,
                    self.engine.spec,
                    [inputs[job_id][0] for job_id in rows],
                    [inputs[job_id][1] for job_id in rows],
                    [job.message.prompt for job in jobs],
                    [job.prepared.seed for job in jobs],
                    jobs[0].params,  # size, steps, strength, guidance, adapters: one per call
                    output_type="latent",
                    callback=self._on_step,
                    negative_prompts=[job.params.negative_prompt for job in jobs],
                )
        except Exception as exc:  # one bad call fails its rows, not the worker
            log.exception("the pipeline call failed for %s", rows)
            for job_id in rows:
                self.scheduler.drop(job_id)
                if job_id in self.jobs:  # not cancelled during the call
                    self._finish(job_id, "failed", f"denoising failed: {exc}")
            return
        for index, job_id in enumerate(rows):
            # the batch leaves the scheduler with its call, whatever count of steps it reported
            self.scheduler.drop(job_id)
            if job_id in self.jobs:  # not cancelled during the call
                self.jobs[job_id].timings.update(phases)  # what its adapters cost (load, fuse)
                self._hand_on(self.jobs[job_id], latents[index : index + 1], used_cache=False)

    def _inputs(self, job_id: str) -> tuple[Image.Image, Image.Image] | None:
        """The row's template fit to the bucket through its crop box, and its mask; None (the row
        failed alone) when the template cannot be read."""
        job = self.jobs[job_id]
        try:
            template = decode_image(
                self.blobs.get(job.message.template_ref), self.max_pixels, what="template"
            )
            box = tuple(job.message.paste.crop_box) if job.message.paste else None
            image = fit_to_bucket(template, job.params.size, box)
        except Exception as exc:
            log.warning("the template of %s could not be read: %s", job_id, exc)
            self.scheduler.drop(job_id)
            self._finish(job_id, "failed", f"could not start: {exc}")
            return None
        return image, Image.fromarray(job.prepared.pixels.astype(np.uint8) * 255)

    def _on_step(self, pipe, index: int, timestep, tensors: dict) -> dict:
        """diffusers' ``callback_on_step_end``: step ``index`` of the call finished for every row.
        Reads the inbox (cancels end their rows now; new jobs queue), reports the step of the rows
        still live, and stops the call when none is."""
        # the pipeline's own time for the step (the first one also encodes prompts and images)
        forward_ended = time.perf_counter()
        forward_s = forward_ended - self._step_started
        for message in self.inbox.poll(0.0):
            self._receive(message)
        out = self.scheduler.schedule(time.time(), _joins_no_call)
        for job_id in out.cancelled:
            self._finish(job_id, "cancelled", "cancelled by the user")
        live = [job_id for group in out.groups for job_id in group]
        if not live:
            pipe._interrupt = True  # diffusers' documented way to skip the remaining steps
            return tensors
        self.scheduler.update_from_output(live)
        now = time.time()
        self.sink.step_events(
            [
                JobEvent(
                    job_id=job_id,
                    status="running",
                    at=now,
                    worker_id=self.worker_id,
                    step=index + 1,
                    num_steps=self.jobs[job_id].message.num_steps,
                )
                for job_id in live
            ]
        )
        self._step_started = time.perf_counter()
        self.stats.record_step(len(live), forward_s + self._step_started - forward_ended, forward_s)
        return tensors

"""The job service: what the REST routes (and the Studio UI) call to submit, watch and cancel edits.

No HTTP here: problems are ``ServiceError``s whose ``code`` says what kind they are (the REST layer
maps codes to statuses). Submission validates everything that is cheap before anything is queued
(model, numbers, prompt, image and mask decodable, within limits and of the same size), so a job
that is accepted fails later only for reasons the API could not see.

Invariants:
* a job is visible in the job state (``queued``) before its ``EditJob`` is on the pre-processing
  queue, so the pre task never meets a job it does not know;
* the seed a job runs with is chosen here when the caller gives none, stored with the job and
  returned, so every result can be reproduced;
* every read, result and cancel names the caller (``owner``): a job is found only by the owner
  recorded with it at submission, so another tenant gets the same ``not_found`` as for an id that
  never existed (ids are not confirmed);
* an owner has at most ``api.max_queued_jobs`` unfinished jobs (``too_many``, 429);
* every job has a service level (``service_levels``: class, deadline, priority); admission control
  (``admission``) refuses one of a class that sheds with ``too_many`` (429, ``Retry-After``) before
  anything is stored, and marks one of another class late; nothing accepted is dropped;
* a job names a model that a live worker serves or that the deployment configures
  (``engine.model_id``, ``api.models``): a job for any other would wait for a worker nobody is
  going to start, so it is refused (``invalid``), naming the models live workers serve;
* cancel never touches another job: it records a terminal ``cancelled`` event for that job (the
  pre task, the dispatcher and post-processing skip cancelled jobs), and a job on a worker also
  gets a ``CancelJob`` in that worker's inbox, so the worker drops it at its next step.
"""

from __future__ import annotations

import hmac
import re
import secrets
import time
import uuid
from pathlib import Path

from kombu.exceptions import OperationalError as BrokerError

from backend.adapters.store import AdapterStore
from backend.api.adapter_requests import AdapterChoice, adapter_fields, resolve_uses
from backend.api.admission import NEW_JOB_TEMPLATE, AdmissionGate, check_owner_queue
from backend.api.checks import (
    MAX_SEED,
    MAX_STEPS,
    ServiceError,
    check_numbers,
    check_prompt,
    check_range,
    check_resolution,
    whole,
)
from backend.api.service_levels import level_fields, service_level
from backend.api.submission import (
    BatchLink,
    CheckedJob,
    JobRequest,
    SubmittedJob,
    edit_job,
    record_fields,
)
from backend.api.template_source import CheckedTemplate, TemplateSource
from backend.blobs import BlobMissing, BlobStore
from backend.blobs.factory import open_objects
from backend.config import Settings
from backend.history import HistoryIndex

# the pre task's exact ranges
from backend.jobstate import TERMINAL, JobNotFound, JobStateStore
from backend.models import UnknownModelError, known_model_ids, resolve_model
from backend.models.catalog import SHIPPED
from backend.protocol import AdapterUse, CancelJob, EditJob, JobEvent
from backend.protocol.heartbeats import live_heartbeats, queue_position, read_heartbeat
from backend.tasks.celery_app import submit_edit
from backend.worker.redis_inbox import send_to_inbox
from templates_store.store import TemplateStore

__all__ = ["MAX_SEED", "JobRequest", "JobService", "ServiceError", "SubmittedJob"]

_JOB_ID = re.compile(r"^[0-9a-f]{32}$")
_EVENT_ID = re.compile(r"^\d+(-\d+)?$")
# statuses in which a job with a worker_id is that worker's to cancel
ON_WORKER = ("waiting", "running")


class JobService:
    def __init__(
        self,
        settings: Settings,
        redis_client,
        celery_app,
        blobs: BlobStore,
        templates: TemplateStore,
        jobstate: JobStateStore | None = None,
        registry=None,  # the API's metrics registry (admission counters)
    ):
        self.settings, self.client, self.celery_app = settings, redis_client, celery_app
        self.blobs, self.templates = blobs, templates
        self.sources = TemplateSource(settings, blobs, templates)
        self.adapters = AdapterStore(open_objects(settings, "adapters"))
        self.jobstate = jobstate or JobStateStore(redis_client, settings.retention.job_record_s)
        self.admission = AdmissionGate(settings, redis_client, self.jobstate, registry)
        self.history_index = HistoryIndex(
            redis_client, settings.studio.history_limit, settings.retention.job_record_s
        )

    # ----- submit ---------------------------------------------------------------------------------
    def submit(self, request: JobRequest) -> SubmittedJob:
        self.check_queued(request.owner)
        checked = self.check(request)
        return self.create(checked, checked.template.store())

    def check(
        self, request: JobRequest, template: CheckedTemplate | None = None, now: float = 0.0
    ) -> CheckedJob:
        """Everything about one edit that can be checked here, admission control included;
        nothing is stored. ``template``: checked already (a batch checks its one template once
        for every item), else checked here from the request; ``now``: the submission time (0: now).
        """
        spec = self._model(request.model or self.settings.engine.model_id)
        if request.mode != "erase":  # an erase is finished in pre-processing: it needs no worker
            self._check_served(spec.model_id)
        steps = spec.default_steps if request.steps is None else request.steps
        guidance = spec.default_guidance if request.guidance is None else request.guidance
        seed = secrets.randbelow(MAX_SEED + 1) if request.seed is None else request.seed
        # a UI's number widget gives floats
        steps, seed = whole("steps", steps), whole("seed", seed)
        check_numbers(request, steps, guidance, seed)
        check_prompt(request)
        now = now or time.time()
        level = service_level(
            request.service_class,
            request.deadline_s,
            request.priority,
            self.settings.deadlines,
            now,
        )
        adapters = self._adapter_uses(request, spec.model_id)
        if template is None:
            template = self.sources.check(request.template_id, request.image, request.owner)
        ratio = self.sources.mask_ratio(
            request.mask, template.size, request.mask_ops, request.mode, request.inpaint_area
        )
        cached = bool(request.use_cache and request.template_id)  # a gallery template's cache
        row = None if request.mode == "erase" else (ratio, NEW_JOB_TEMPLATE, cached)
        level, forecast = self.admission.admit(level, spec.model_id, steps, now, row)
        return CheckedJob(
            request, template, spec.model_id, steps, float(guidance), seed, now, level, forecast,
            tuple(adapters),
        )  # fmt: skip

    def create(
        self, checked: CheckedJob, template_ref: str, batch: BatchLink | None = None
    ) -> SubmittedJob:
        """Store a checked job (its mask, its record, its history entry) and queue it: a
        ``SubmittedJob``. ``batch``: the batch it is an item of (routed with its siblings)."""
        request = checked.request
        mask_ref = self.blobs.put_content("uploads", request.mask, ".mask")
        job_id = uuid.uuid4().hex
        job = edit_job(checked, job_id, template_ref, mask_ref, batch)
        self.jobstate.create(
            job_id, **record_fields(checked, template_ref, mask_ref, batch)
        )  # the refs keep these blobs from the janitor while the job runs
        self.history_index.add(request.listed_for or request.owner, job_id, job.submitted_at)
        self._queue(job)
        return SubmittedJob(job_id, checked.seed, checked.model_id, checked.steps)

    def _adapter_uses(self, request: JobRequest, model_id: str) -> list[AdapterUse]:
        if request.adapters and request.mode == "erase":
            raise ServiceError(
                "an erase uses no model, so no adapters: drop them or generate", field="adapters"
            )
        return resolve_uses(
            request.adapters, self.adapters, request.owner, model_id, self.settings.adapters
        )

    def prepare_template(
        self,
        template_id: str,
        owner: str,
        model: str | None = None,
        steps: int | None = None,
        resolution: int = 0,
        adapters: tuple[AdapterChoice, ...] = (),
    ) -> SubmittedJob:
        """Queue a recording of a gallery template's activation cache for ``model`` (a job with no
        mask and no image result; it ends ``done`` with "cache recorded" or "already prepared").
        With ``adapters`` the cache is pinned to that adapter set: edits naming exactly those
        adapters and scales read it instead of the base cache (its status: ``cache_status``
        with the same adapters)."""
        from backend.cachestatus import KeySettings, record_prepare_job

        spec = self._model(model or self.settings.engine.model_id)
        self._check_served(spec.model_id)
        steps = whole("steps", spec.default_steps if steps is None else steps)
        check_range("steps", steps, 1, MAX_STEPS)
        check_resolution(resolution)
        record = self.sources.owned(template_id, owner)
        uses = resolve_uses(adapters, self.adapters, owner, spec.model_id, self.settings.adapters)
        self.check_queued(owner)
        now = time.time()  # a recording is batch work: it reads no mask and computes densely
        level = service_level("batch", None, 0, self.settings.deadlines, now)
        level, forecast = self.admission.admit(
            level, spec.model_id, steps, now, (1.0, NEW_JOB_TEMPLATE, False)
        )
        job_id = uuid.uuid4().hex
        job = EditJob(
            job_id=job_id,
            model_id=spec.model_id,
            template_ref=self.sources.blob(record),
            mask_ref="",
            prompt="",
            seed=0,
            steps=steps,
            guidance=float(spec.default_guidance),
            resolution=resolution,
            submitted_at=now,
            template_id=template_id,
            prepare=True,
            adapters=uses,
            service=level,
        )
        self.jobstate.create(
            job_id,
            model_id=spec.model_id,
            kind="prepare",
            template_id=template_id,
            steps=steps,
            resolution=resolution,
            template_ref=job.template_ref,
            owner=owner,
            adapters=adapter_fields(uses),
            **level_fields(level, forecast),
        )
        self.history_index.add(owner, job_id, job.submitted_at)
        pairs = [(use.sha256, use.scale) for use in uses]
        key_settings = KeySettings.of(spec, self.settings.engine, steps, resolution, adapters=pairs)
        record_prepare_job(self.client, template_id, key_settings, job_id)
        self._queue(job)
        return SubmittedJob(job_id=job_id, seed=0, model_id=spec.model_id, steps=steps)

    def delete_template(self, template_id: str, owner: str) -> None:
        """Delete one of ``owner``'s templates and forget its cache status. Raises
        TemplateNotFound."""
        from backend.cachestatus import forget

        self.templates.delete(template_id, owner)
        forget(self.client, template_id)

    def cache_status(
        self,
        template_id: str,
        owner: str,
        model: str | None = None,
        *,
        steps: int | None = None,
        strength: float = 1.0,
        guidance: float | None = None,
        resolution: int = 0,
        adapters: tuple[AdapterChoice, ...] = (),
    ) -> dict:
        """Where the template's cache for an edit with these settings is (``None``/0: the
        model's defaults, as an edit would use them): not prepared, preparing, on disk, in RAM, on
        device; with ``adapters``, the cache pinned to exactly that adapter set
        (``prepare_template``). The settings and adapters are checked as a job submission checks
        them."""
        from backend.cachestatus import KeySettings, cache_status

        spec = self._model(model or self.settings.engine.model_id)
        steps = whole("steps", spec.default_steps if steps is None else steps)
        guidance = spec.default_guidance if guidance is None else guidance
        query = JobRequest(mask=b"", prompt="", strength=strength, resolution=resolution)
        check_numbers(query, steps, guidance, 0)
        record = self.sources.owned(template_id, owner)
        uses = resolve_uses(adapters, self.adapters, owner, spec.model_id, self.settings.adapters)
        pairs = [(use.sha256, use.scale) for use in uses]
        settings = KeySettings.of(
            spec, self.settings.engine, steps, resolution, float(strength), float(guidance), pairs
        )

        def load():
            return self.sources.decode(self.sources.image_bytes(record), "template")

        status = cache_status(self.client, template_id, settings, record.sha256, load)
        if uses:
            status["settings"]["adapters"] = adapter_fields(uses)
        return status

    def check_queued(self, owner: str, adding: int = 1) -> None:
        bound = self.settings.api.max_queued_jobs
        check_owner_queue(self.client, self.history_index, owner, bound, adding)

    def _queue(self, job: EditJob) -> None:
        try:
            submit_edit(self.celery_app, job)
        except BrokerError as exc:
            self.jobstate.record_event(
                JobEvent(
                    job_id=job.job_id,
                    status="failed",
                    at=time.time(),
                    message=f"could not be queued: {exc}",
                )
            )
            raise ServiceError(
                f"the job queue is unavailable ({exc}): try again shortly", "unavailable"
            ) from exc

    def _model(self, model_id: str):
        allowed = self.settings.api.models
        try:
            spec = resolve_model(model_id)
        except UnknownModelError as exc:
            raise ServiceError(str(exc), field="model") from None
        if allowed and model_id not in allowed:
            raise ServiceError(
                f"model {model_id!r} is not served here: use one of {', '.join(allowed)}",
                field="model",
            )
        # a shipped model, or the one the operator configured, is known to be safe to load
        trusted = model_id in SHIPPED or model_id == self.settings.engine.model_id
        if not allowed and spec.form == "checkpoint" and not trusted:
            raise ServiceError(
                f"model {model_id!r} is a checkpoint, which this deployment does not serve over "
                f"the API: use one of {', '.join(known_model_ids())} (or ask the operator to list "
                "it in MASKSERVE_API_MODELS)",
                field="model",
            )
        return spec

    def _check_served(self, model_id: str) -> None:
        """A job waits for a worker of its model only when the deployment configures that model
        (its own workers' ``engine.model_id``, or one listed in ``api.models``): one for a model
        that no live worker serves and that is not configured would wait for a worker nobody is
        going to start, so it is refused, naming the models live workers serve and how to add
        one. A configured model is accepted before its first worker's heartbeat (a stack starting
        up); its job says it waits for one (the dispatcher's message)."""
        if model_id in {self.settings.engine.model_id, *self.settings.api.models}:
            return
        served = sorted({beat.model_id for beat in live_heartbeats(self.client).values()})
        if model_id in served:
            return
        live = f"live workers serve {', '.join(served)}" if served else "no worker is live"
        raise ServiceError(
            f"no worker serves model {model_id!r} and this deployment does not configure it "
            f"({live}): leave model out for the default ({self.settings.engine.model_id}) or name "
            f"a served one; to serve {model_id}, start an engine worker for it (maskserve worker "
            f"--model {model_id}), or list it in MASKSERVE_API_MODELS (with every model jobs may "
            "name) so that its jobs are accepted and wait for such a worker",
            field="model",
        )

    # ----- read -----------------------------------------------------------------------------------
    def get(self, job_id: str, owner: str) -> dict:
        """``owner``'s job as stored (``protocol.JobRecord.as_dict``); ``queue_position`` only
        while it waits for a worker (1 = next): its worker's heartbeat's, else the latest its worker
        reported, else None (on its way). Another owner's job is ``not_found``, word for word like
        one that never existed."""
        try:
            job = self.jobstate.get(self._job_id(job_id))
        except JobNotFound:
            job = None
        # compare_digest: how long the check takes does not say how much of an owner matched
        if job is None or not owner or not hmac.compare_digest(job["owner"], owner):
            raise ServiceError(
                f"no job with id {job_id!r} (never submitted, or expired)", "not_found"
            ) from None
        reported = job.pop("queue_position", None)
        if job["status"] == "waiting" and job["worker_id"]:
            beat = read_heartbeat(self.client, job["worker_id"])
            job["queue_position"] = queue_position(beat, job["job_id"]) or reported
        return job

    def history(self, owner: str, limit: int | None = None, listed_for: str = "") -> list[dict]:
        """The jobs listed for ``listed_for`` (default: the owner), newest first, as ``get`` gives
        them; jobs whose state expired are skipped."""
        listed_for = listed_for or owner
        jobs = []
        for job_id in self.history_index.job_ids(listed_for, limit):
            try:
                jobs.append(self.get(job_id, owner))
            except ServiceError:  # expired: its state is gone
                self.history_index.forget(listed_for, job_id)
        return jobs

    def events(
        self, job_id: str, owner: str, after: str = "0", block_ms: int | None = None
    ) -> list[tuple[str, dict]]:
        """(event id, event) of one of ``owner``'s jobs after ``after``, waiting up to
        ``block_ms`` for the first."""
        self.get(job_id, owner)
        if not _EVENT_ID.match(after or ""):
            raise ServiceError(
                f"event id {after[:40]!r} is not a stream id: use one like 1700000000000-0, or 0 "
                "for the whole history"
            )
        return self.jobstate.events(self._job_id(job_id), after, block_ms)

    def result_path(self, job_id: str, owner: str) -> Path:
        return self._finished_file(job_id, owner, "result_ref", "result")

    def thumbnail_path(self, job_id: str, owner: str) -> Path:
        return self._finished_file(job_id, owner, "thumbnail_ref", "thumbnail")

    def _finished_file(self, job_id: str, owner: str, field_name: str, what: str) -> Path:
        job = self.get(job_id, owner)
        status = job["status"]
        if job.get("kind") == "prepare":
            raise ServiceError(
                f"job {job_id} records a template's cache: it has no {what}", "not_found"
            )
        if status != "done":
            detail = {
                "failed": f"the job failed: {job.get('message', '')}",
                "cancelled": "the job was cancelled",
            }.get(status)
            if detail is None:
                progress = (
                    f" (step {job['step']}/{job['num_steps']})" if job.get("num_steps") else ""
                )
                detail = (
                    f"the job is {status}{progress}: the {what} is ready when its status is done"
                )
            raise ServiceError(f"no {what}: {detail}", "conflict")
        ref = job.get(field_name, "")
        try:  # a local file to serve: the blob itself, or this host's copy of an object
            if ref:
                return self.blobs.local_path(ref)
        except BlobMissing:
            pass
        raise ServiceError(self._gone_message(job, what), "gone")

    def _gone_message(self, job: dict, what: str) -> str:
        hours = self.settings.retention.results_hours
        finished_at = job.get("done_at") or job.get("updated_at") or 0.0
        age_h = (time.time() - finished_at) / 3600
        if hours > 0 and age_h >= hours:
            return (
                f"the {what} of job {job['job_id']} expired: results are kept {hours:g} hours "
                f"after their job finishes and this one finished {age_h:.1f} hours ago; submit the "
                "edit again"
            )
        return f"the {what} of job {job['job_id']} is no longer stored: submit the edit again"

    @staticmethod
    def _job_id(job_id: str) -> str:
        if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
            raise ServiceError(
                f"no job with id {str(job_id)[:40]!r}: job ids are 32 hex digits", "not_found"
            )
        return job_id

    # ----- cancel ---------------------------------------------------------------------------------
    def cancel(self, job_id: str, owner: str) -> dict:
        """Cancel one of ``owner``'s jobs: ``{"status": "cancelled", "worker_notified": bool}``.
        ServiceError ``conflict`` when it had already finished.

        The ``cancelled`` event is recorded at once in every case (terminal, so the pre task, the
        dispatcher and post-processing all skip the job, and its event stream ends). A job that is
        on a worker (``waiting``/``running`` with a ``worker_id``) also gets a ``CancelJob`` in that
        worker's inbox: the worker drops the row at its next step. Recording the event here as well
        keeps a cancel from being lost when that worker dies and the job is routed again."""
        job = self.get(job_id, owner)
        status, worker_id = job["status"], job.get("worker_id", "")
        if status in TERMINAL:
            raise ServiceError(
                f"job already finished (status {status}): nothing to cancel", "conflict"
            )
        notify = bool(worker_id) and status in ON_WORKER
        if notify:
            send_to_inbox(self.client, worker_id, CancelJob(job_id=job_id))
        event = JobEvent(
            job_id=job_id,
            status="cancelled",
            at=time.time(),
            message="cancelled by the user",
            worker_id=worker_id,
        )
        # it finished in the meantime (first terminal wins)
        if not self.jobstate.record_event(event):
            final = self.jobstate.status(job_id)
            if final != "cancelled":
                raise ServiceError(
                    f"job already finished (status {final}): nothing to cancel", "conflict"
                )
        return {"status": "cancelled", "worker_notified": notify}

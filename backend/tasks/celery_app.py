"""Celery CPU workers: the pre- and post-processing queues (`maskserve cpu-worker`).

Configuration follows BRIEF section 3, and each value is there for a reason:
* ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acked after it ran, so a CPU worker
  that dies mid-task leaves it to be redelivered instead of lost (tasks are idempotent, see
  ``backend.tasks.core``);
* ``worker_prefetch_multiplier=1``: a busy worker does not hoard queued tasks another could run;
* JSON only: nothing is pickled between processes; task arguments are ``backend.protocol``
  messages as JSON, which carry files by reference;
* time limits, and a broker ``visibility_timeout`` above the hard limit (validated in settings):
  with the Redis broker a task running longer than the visibility timeout is delivered twice;
* retries with backoff only for transient errors (Redis connection), at most ``MAX_RETRIES``; a
  bad upload fails its job at once with the message the user needs, and so does any other error
  (a job never hangs in a stage because its task raised);
* tasks queued by service level (``CPU_TASK_LEVELS``, ``task_level``): an interactive job's
  pre- and post-processing go before batch jobs' waiting tasks, as the engine workers order rows;
* a lease per running task (``backend.tasks.leases``): a task lost with its worker is re-enqueued
  by the dispatcher's ``resend_lapsed`` within about ``celery.lease_s``, a duplicate of a running
  task does nothing, and a job whose task is lost more than ``dispatcher.max_redeliveries`` times
  fails.

Models load lazily in the process that runs the task, never in the parent before a fork (a CUDA
context does not survive fork).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping

from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_process_init
from redis import Redis

from backend import protocol
from backend.blobs import BlobError, BlobStoreUnavailable
from backend.config import Settings
from backend.imaging.masks import MaskError
from backend.imaging.uploads import UploadError
from backend.metrics import make_registry, serve_metrics
from backend.protocol import JobEvent, ProtocolError, ServiceLevel, to_text
from backend.protocol.keys import (
    ADAPTER_INGEST_TASK,
    CPU_STATS_KEY,
    CPU_TASK_LEVELS,
    POST_TASK,
    PRE_TASK,
    PREPARED_STREAM,
    cpu_queue_lists,
    cpu_task_level,
    handoff_key,
)
from backend.runtime import REDIS_UNAVAILABLE
from backend.tasks.leases import (
    EXHAUSTED,
    HELD,
    STAGE_NAMES,
    STAGE_STATUSES,
    CpuLeases,
    lapse_verdict,
    new_token,
)

log = logging.getLogger(__name__)

PREPARED_MAXLEN = 100_000
USER_ERRORS = (UploadError, MaskError, BlobError, ProtocolError, ValueError)
TRANSIENT_ERRORS = (*REDIS_UNAVAILABLE, ConnectionError, TimeoutError, BlobStoreUnavailable)
MAX_RETRIES = 5  # of a task after a transient error (then its job fails)
RETRY_BACKOFF_MAX_S = 30


def record_task(client: Redis, task: str, outcome: str, seconds: float) -> None:
    """Count one finished task (outcome: done / failed / skipped) and its seconds, in Redis:
    Celery's prefork children cannot share in-process counters with the parent that serves
    ``/metrics``."""
    with client.pipeline(transaction=False) as pipe:
        pipe.hincrby(CPU_STATS_KEY, f"{task}.{outcome}", 1)
        pipe.hincrbyfloat(CPU_STATS_KEY, f"{task}.seconds", seconds)
        pipe.execute()


def task_stats(client: Redis, queues: Mapping[str, str] | None = None) -> dict:
    """Snapshot for the metrics endpoint: ``tasks_total`` and ``task_seconds_total`` by key and,
    for each of ``queues`` (stage -> queue name), ``queued_tasks`` by ``<stage>.<level>``: the
    tasks waiting at each level of the queue."""
    raw = {to_text(k): float(v) for k, v in client.hgetall(CPU_STATS_KEY).items()}
    queued = {}
    for stage, queue in (queues or {}).items():
        with client.pipeline(transaction=False) as pipe:
            for name in cpu_queue_lists(queue):
                pipe.llen(name)
            lengths = pipe.execute()
        queued |= {f"{stage}.{level}": float(n) for level, n in zip(CPU_TASK_LEVELS, lengths)}
    return {
        "tasks_total": {k: v for k, v in raw.items() if not k.endswith(".seconds")},
        "task_seconds_total": {
            k.removesuffix(".seconds"): v for k, v in raw.items() if k.endswith(".seconds")
        },
        "queued_tasks": queued,
    }


class _Process:
    """Per-process state of a CPU worker: Redis client, job state store, one ``CpuStages`` per
    model."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._client: Redis | None = None
        self._stages: dict[str, object] = {}
        self._building = threading.Lock()

    @property
    def client(self) -> Redis:
        if self._client is None:
            self._client = Redis.from_url(self.settings.redis.url)
        return self._client

    def jobstate(self):
        from backend.jobstate import JobStateStore

        return JobStateStore(self.client, self.settings.retention.job_record_s)

    def stages(self, model_id: str):
        """The model's CPU stages, built once per process (a task waits while a warm-up builds
        them)."""
        with self._building:
            if model_id not in self._stages:
                from backend.engine.factory import CPU_STAGES, build_engine
                from backend.tasks.core import CpuStages

                engine = build_engine(
                    self.settings, model_id, device=self.settings.celery.device, role=CPU_STAGES
                )
                self._stages[model_id] = CpuStages(self.settings, engine, self.jobstate())
            return self._stages[model_id]

    def warm(self, model_id: str) -> threading.Thread:
        """Build the default model's stages in the background as the process starts, so the first
        job does not wait seconds for its encoders (Celery kills a child whose start takes over 4 s,
        so this cannot run inline). A failure is logged; the first task then raises it properly."""

        def build() -> None:
            try:
                self.stages(model_id)
                log.info("CPU stages of %s ready", model_id)
            except Exception as exc:  # the task that needs them reports it to its job
                log.warning("warming the CPU stages of %s failed: %s", model_id, exc)

        thread = threading.Thread(target=build, name="warm-stages", daemon=True)
        thread.start()
        return thread

    def fail(self, job_id: str, message: str) -> None:
        self.jobstate().fail(job_id, message)

    def leases(self) -> CpuLeases:
        return cpu_leases(self.client, self.settings)


# Once per job, atomically: a redelivered pre-processing task must not route its job twice.
_HAND_OFF_ONCE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[3]) then
  return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'msg', ARGV[1])
end
return false
"""
HAND_OFF_TTL_S = 7 * 24 * 3600


def hand_off(client: Redis, prepared) -> str | None:
    """Queue a pre-processed job for routing (the dispatcher reads ``PREPARED_STREAM``); the stream
    entry id, or None when this job was handed off before."""
    entry = client.eval(
        _HAND_OFF_ONCE,
        2,
        handoff_key(prepared.job_id),
        PREPARED_STREAM,
        protocol.encode(prepared),
        PREPARED_MAXLEN,
        HAND_OFF_TTL_S,
    )
    return None if entry is None else to_text(entry)


def make_celery(settings: Settings) -> Celery:
    if not settings.redis.url:
        raise ValueError(
            "Celery needs a Redis URL: set MASKSERVE_REDIS_URL (or start the stack with "
            "`maskserve up`)"
        )
    app = Celery("maskserve", broker=settings.redis.url)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_soft_time_limit=settings.celery.task_soft_time_limit_s,
        task_time_limit=settings.celery.task_time_limit_s,
        # one list per level of ``CPU_TASK_LEVELS``, the lowest served first: an interactive
        # job's pre- and post-processing do not wait behind a burst of batch jobs' tasks
        broker_transport_options={
            "visibility_timeout": settings.celery.visibility_timeout_s,
            "priority_steps": list(CPU_TASK_LEVELS),
        },
        maskserve_service_order=settings.celery.service_order,  # read by ``task_level``
        broker_connection_retry_on_startup=True,
        # Redis restarting: reconnect with backoff, forever (never exit: `up` or the platform
        # would have to restart the worker, and its running tasks with it)
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        worker_hijack_root_logger=False,
        task_routes={
            PRE_TASK: {"queue": settings.celery.pre_queue},
            POST_TASK: {"queue": settings.celery.post_queue},
            ADAPTER_INGEST_TASK: {"queue": settings.celery.pre_queue},
        },
        worker_send_task_events=False,
        task_default_queue=settings.celery.pre_queue,
    )
    state = _Process(settings)

    @worker_process_init.connect(weak=False)
    def warm_stages(**_kwargs) -> None:  # fires in each CPU worker child only, never in the API
        state.warm(settings.engine.model_id)

    def run(task, stage: str, job_id: str, text: str, work) -> None:
        """Run ``work`` holding the job's lease (see ``backend.tasks.leases``); every error ends
        the job ``failed`` saying why, except a transient one, which is retried first."""
        started, token, leases = time.time(), new_token(), state.leases()
        what = STAGE_NAMES[stage]
        claim = leases.claim(job_id, stage, text, token, settings.dispatcher.max_redeliveries)
        if claim == HELD:
            log.info("%s of %s skipped: a live task is running it", what, job_id)
            record_task(state.client, f"{stage}process", "skipped", 0.0)
            return
        outcome = "failed"
        try:
            if claim == EXHAUSTED:
                state.fail(job_id, f"{what} was lost with its worker too many times; giving up")
            else:
                with leases.renewing(job_id, token):
                    outcome = work() or "done"
        except USER_ERRORS as exc:
            state.fail(job_id, f"{what} failed: {exc}" if stage == "post" else str(exc))
        except SoftTimeLimitExceeded:
            state.fail(job_id, f"{what} took over {settings.celery.task_soft_time_limit_s} s")
        except TRANSIENT_ERRORS as exc:
            if task.request.retries < MAX_RETRIES:
                leases.release(job_id, token, stage_over=False)
                countdown = min(RETRY_BACKOFF_MAX_S, 2**task.request.retries)
                raise task.retry(exc=exc, countdown=countdown, max_retries=MAX_RETRIES) from exc
            state.fail(job_id, f"{what} failed after {MAX_RETRIES} retries: {exc}")
        except Exception as exc:  # a bug or a broken model: the job must not hang in this stage
            log.exception("%s of %s failed", what, job_id)
            state.fail(job_id, f"{what} failed: {type(exc).__name__}: {exc}")
        leases.release(job_id, token, stage_over=True)
        record_task(state.client, f"{stage}process", outcome, time.time() - started)

    def decoded(text: str, expected: type):
        """The task's message; an unreadable one fails the job it names (if it names one)."""
        try:
            message = protocol.decode(text)
            if not isinstance(message, expected):
                raise ProtocolError(f"expected a {expected.TYPE}, got a {message.TYPE}")
            return message
        except ProtocolError as exc:
            job_id = protocol.job_id_of(text)
            log.error("unreadable %s task for job %s: %s", expected.TYPE, job_id, exc)
            if job_id:
                state.fail(job_id, f"unreadable {expected.TYPE} message: {exc}")
            return None

    @app.task(name=PRE_TASK, bind=True)
    def preprocess(task, job_json: str) -> None:
        job = decoded(job_json, protocol.EditJob)
        if job is None:
            return

        def work():
            moved_on = state.jobstate().status(job.job_id) not in (None, *STAGE_STATUSES["pre"])
            if moved_on or state.client.exists(handoff_key(job.job_id)):
                log.info("pre-processing of %s skipped: the job already moved on", job.job_id)
                return "skipped"
            if job.mode == "erase":  # finished here, without a model: never sent to a worker
                from backend.tasks.core import erase_job

                erase_job(settings, job, state.jobstate())
                return "done"
            hand_off(state.client, state.stages(job.model_id).preprocess(job))

        run(task, "pre", job.job_id, job_json, work)

    @app.task(name=POST_TASK, bind=True)
    def postprocess(task, denoised_json: str) -> None:
        job = decoded(denoised_json, protocol.DenoisedJob)
        if job is None:
            return

        def work():
            return "done" if state.stages(job.model_id).postprocess(job) else "skipped"

        run(task, "post", job.job_id, denoised_json, work)

    @app.task(name=ADAPTER_INGEST_TASK)
    def ingest_adapter(request_json: str) -> None:
        """An uploaded LoRA adapter: read, validate, normalize; the API waits for the answer."""
        from backend.adapters.ingest import run_ingest_task
        from backend.blobs.factory import open_blob_store

        run_ingest_task(state.client, open_blob_store(settings), request_json)

    return app


def submit_edit(app: Celery, job) -> None:
    """Queue an ``EditJob`` for pre-processing, at its service level's place in the queue."""
    app.send_task(PRE_TASK, args=[protocol.encode(job)], priority=task_level(app, job.service))


def task_level(app: Celery, service: ServiceLevel) -> int:
    """The CPU queue level of the task of a job with ``service`` (``cpu_task_level``); 0 for
    every task when the deployment takes them first in, first out."""
    if not app.conf.maskserve_service_order:
        return 0
    return cpu_task_level(service.service_class, service.priority)


def _level_of(app: Celery, message: str) -> int:
    """``task_level`` of a queued task's message; a message that no longer reads goes at the
    default (batch) level (its task fails it with the reason)."""
    try:
        service = protocol.decode(message).service
    except (ValueError, AttributeError):  # ProtocolError and bad JSON are ValueErrors
        service = ServiceLevel()
    return task_level(app, service)


def cpu_leases(client: Redis, settings: Settings) -> CpuLeases:
    return CpuLeases(client, settings.celery.lease_s, settings.celery.visibility_timeout_s)


def submit_postprocess(
    app: Celery, client: Redis, settings: Settings, job, worker_id: str = ""
) -> bool:
    """Queue a ``DenoisedJob`` for post-processing, once per job: registered first (durable, and
    counted in the job's ``denoised``), then sent; False when the job was handed on before, is
    gone, or was taken from ``worker_id`` (the engine worker handing it) and nothing was sent."""
    text = protocol.encode(job)
    if not cpu_leases(client, settings).register_post(job.job_id, text, worker_id):
        log.warning(
            "post-processing of %s not queued: it was denoised before or re-dispatched elsewhere",
            job.job_id,
        )
        return False
    app.send_task(
        POST_TASK,
        args=[text],
        queue=settings.celery.post_queue,
        priority=task_level(app, job.service),
    )
    return True


def resend_lapsed(app: Celery, client: Redis, settings: Settings, jobstate) -> int:
    """Re-enqueue the CPU tasks whose lease lapsed (their worker was lost); a job redelivered
    ``dispatcher.max_redeliveries`` times fails instead. Returns how many were re-enqueued."""
    leases, resent = cpu_leases(client, settings), 0
    limit = settings.dispatcher.max_redeliveries
    for lapsed in leases.take_lapsed():
        what = STAGE_NAMES[lapsed.stage]
        try:
            record = jobstate.record(lapsed.job_id)
            status, redeliveries = record.status, record.redeliveries
        except KeyError:  # JobNotFound: expired
            status, redeliveries = None, 0
        verdict = lapse_verdict(lapsed.stage, status, redeliveries, limit)
        if verdict == "forget":
            leases.forget(lapsed.job_id)
            continue
        if verdict == "fail":
            leases.forget(lapsed.job_id)
            jobstate.fail(lapsed.job_id, f"{what} worker lost {redeliveries + 1} times; giving up")
            continue
        count = jobstate.redelivered(lapsed.job_id)
        jobstate.record_event(
            JobEvent(
                job_id=lapsed.job_id,
                status=STAGE_STATUSES[lapsed.stage][1],
                at=time.time(),
                message=f"{what} worker lost; retrying (redelivery {count} of {limit})",
            )
        )
        task = PRE_TASK if lapsed.stage == "pre" else POST_TASK
        queue = settings.celery.pre_queue if lapsed.stage == "pre" else settings.celery.post_queue
        app.send_task(
            task, args=[lapsed.message], queue=queue, priority=_level_of(app, lapsed.message)
        )
        log.warning("%s of %s lost with its worker: re-enqueued", what, lapsed.job_id)
        resent += 1
    return resent


def start_lease_sweeper(
    app: Celery, client: Redis, settings: Settings, jobstate
) -> threading.Event:
    """``resend_lapsed`` in a daemon thread every quarter of ``celery.lease_s``, so a task lost
    with its worker is sent again within about 1.25 x ``lease_s``. It runs in the API process, the
    role every deployment runs that already sends Celery tasks (the dispatcher stays Celery-free).
    Several API processes may sweep at once: taking a lapsed lease is atomic, so each is sent once.
    Returns the event that stops it."""
    stop, every_s = threading.Event(), max(0.5, settings.celery.lease_s / 4)

    def sweep_periodically() -> None:
        while not stop.wait(every_s):
            try:
                resend_lapsed(app, client, settings, jobstate)
            except TRANSIENT_ERRORS as exc:  # Redis away for a moment: the next sweep retries
                log.warning("lease sweep skipped: Redis unavailable (%s)", exc)

    threading.Thread(target=sweep_periodically, name="lease-sweeper", daemon=True).start()
    return stop


def run_cpu_worker(settings: Settings) -> int:
    """One Celery worker consuming both queues (``-Q``), ``concurrency`` processes."""
    app = make_celery(settings)
    client = Redis.from_url(settings.redis.url)
    stage_queues = {"pre": settings.celery.pre_queue, "post": settings.celery.post_queue}
    serve_metrics(
        settings.celery.metrics_port,
        make_registry({"maskserve_cpu": lambda: task_stats(client, stage_queues)}),
        settings.metrics_host,
    )
    queues = f"{settings.celery.pre_queue},{settings.celery.post_queue}"
    # prefork even for one process: the solo pool cannot enforce time limits
    app.worker_main(
        [
            "--quiet",  # no banner: it is plain text, and every line of a role's log is JSON
            "worker",
            "-Q",
            queues,
            "--concurrency",
            str(settings.celery.concurrency),
            "--pool",
            "prefork",
            "--loglevel",
            settings.log_level,
            "--hostname",
            f"cpu-{os.getpid()}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )
    return 0

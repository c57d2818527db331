"""`maskserve worker`: one engine worker process serving one model on one device through Redis.

Reads its inbox stream, reports job events into the job state store, hands finished denoises to
the Celery post-processing queue, publishes a heartbeat with its live state, and exports
Prometheus metrics. Stops after the current step on SIGTERM/SIGINT and dies with its parent.
"""

from __future__ import annotations

import logging
import threading
import time

from redis import Redis

from backend import protocol
from backend.blobs import BlobStore
from backend.cache import Tier, TieredActivationCache
from backend.config import Settings
from backend.jobstate import JobStateStore
from backend.metrics import make_registry, serve_metrics
from backend.protocol import DenoisedJob, JobEvent, WorkerHeartbeat
from backend.protocol.keys import WORKERS_KEY, heartbeat_key
from backend.runtime import stop_event_on_signals
from backend.tasks.celery_app import make_celery, submit_postprocess
from backend.worker.loop import EngineWorker
from backend.worker.redis_inbox import RedisInbox

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 5
HEARTBEAT_EVERY_S = 1.0


class RedisSink:
    """Job events into the job state store; finished denoises onto the post-processing queue
    (once per job: ``submit_postprocess``)."""

    def __init__(self, jobstate: JobStateStore, celery_app, settings: Settings):
        self.jobstate, self.celery_app, self.settings = jobstate, celery_app, settings

    def event(self, event: JobEvent) -> None:
        self.jobstate.record_event(event)

    def fail(self, job_id: str, reason: str) -> None:
        """A job that cannot run here (its inbox entry was unreadable) ends ``failed``."""
        self.event(JobEvent(job_id=job_id, status="failed", at=time.time(), message=reason))

    def step_events(self, events: list[JobEvent]) -> None:
        self.jobstate.record_events(events)

    def denoised(self, job: DenoisedJob) -> None:
        submit_postprocess(self.celery_app, self.jobstate.client, self.settings, job)


class Heartbeat:
    """The worker's heartbeat: ``WorkerHeartbeat`` under ``keys.heartbeat_key`` with a short TTL.

    The message is built in the worker's own loop (``refresh``, at most every
    ``HEARTBEAT_EVERY_S``), so the state it reports is never read while the loop changes it; a
    daemon thread re-publishes the latest message every ``HEARTBEAT_EVERY_S`` so that a step longer
    than the TTL (a big batch on a slow device) does not make a live worker look dead. The thread
    dies with the process, so a crashed worker's key expires within ``HEARTBEAT_TTL_S``. The metrics
    endpoint serves the snapshots taken here, never the live objects.
    """

    def __init__(
        self, client: Redis, worker: EngineWorker, caches: TieredActivationCache, settings: Settings
    ):
        self.client, self.worker, self.caches, self.settings = client, worker, caches, settings
        self._built_at = 0.0
        self._encoded: str | None = None
        self._lock = threading.Lock()
        self.worker_stats: dict = {}
        self.cache_stats: dict = {}

    def message(self) -> WorkerHeartbeat:
        live = self.worker.scheduler.live_state()
        self.worker_stats, self.cache_stats = (
            self.worker.stats.snapshot(),
            self.caches.metrics.snapshot(),
        )
        return WorkerHeartbeat(
            worker_id=self.worker.worker_id,
            model_id=self.worker.engine.spec.model_id,
            device=self.settings.engine.device,
            at=time.time(),
            max_batch=live["max_batch"],
            batching=live["mode"],
            running=live["running"],
            waiting=live["waiting"],
            resident_ram=self.caches.resident(Tier.RAM),
            resident_disk=self.caches.resident(Tier.DISK),
            stats=self.worker_stats,
        )

    def refresh(self, force: bool = False) -> None:
        """From the worker loop: rebuild the message when it is due (or ``force``) and publish
        it."""
        now = time.monotonic()
        if force or now - self._built_at >= HEARTBEAT_EVERY_S:
            self._built_at = now
            with self._lock:
                self._encoded = protocol.encode(self.message())
            self.publish()

    def publish(self) -> None:
        with self._lock:
            encoded = self._encoded
        if encoded is not None:
            self.client.set(heartbeat_key(self.worker.worker_id), encoded, ex=HEARTBEAT_TTL_S)

    def start_publisher(self, stop: threading.Event) -> threading.Thread:
        def publish_until_stopped():
            while not stop.wait(HEARTBEAT_EVERY_S):
                try:
                    self.publish()
                except Exception:  # Redis away for a moment: the next beat retries
                    log.warning("heartbeat not published", exc_info=True)

        thread = threading.Thread(target=publish_until_stopped, name="heartbeat", daemon=True)
        thread.start()
        return thread


def build_worker(
    settings: Settings, client: Redis, celery_app=None
) -> tuple[EngineWorker, TieredActivationCache]:
    from backend.engine.factory import build_engine, engine_worker_role
    from backend.tasks.core import CpuStages

    engine = build_engine(settings, role=engine_worker_role(settings))
    caches = TieredActivationCache(
        engine.cache_root,
        settings.cache.ram_budget_mb << 20,
        settings.cache.disk_budget_mb << 20 or None,  # 0: a share of the disk's room
        policy=settings.cache.policy,
        disk_free_share=settings.cache.disk_free_share,
        pin_memory=settings.engine.device.startswith("cuda"),
    )
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    jobstate = JobStateStore(client, settings.retention.job_record_s)
    celery_app = celery_app or make_celery(settings)
    stages = CpuStages(settings, engine, jobstate) if settings.worker.batching == "inline" else None
    sink = RedisSink(jobstate, celery_app, settings)
    worker = EngineWorker(
        engine,
        blobs,
        RedisInbox(
            client,
            settings.worker.worker_id,
            fail_job=sink.fail,
            max_redeliveries=settings.dispatcher.max_redeliveries,
        ),
        sink,
        worker_id=settings.worker.worker_id,
        mode=settings.worker.batching,
        max_batch=settings.worker.max_batch,
        caches=caches,
        stages=stages,
    )
    return worker, caches


def run_worker(settings: Settings) -> int:
    client = Redis.from_url(settings.redis.url)
    client.ping()
    worker, caches = build_worker(settings, client)
    heartbeat = Heartbeat(client, worker, caches, settings)
    serve_metrics(
        settings.worker.metrics_port,
        make_registry(
            {
                "maskserve_worker": lambda: heartbeat.worker_stats,
                "maskserve_cache": lambda: heartbeat.cache_stats,
            }
        ),
    )
    stop = stop_event_on_signals()
    log.info(
        "worker %s serving %s on %s (%s batching, max batch %d)",
        worker.worker_id,
        worker.engine.spec.model_id,
        settings.engine.device,
        worker.mode,
        worker.scheduler.max_batch,
    )
    heartbeat.refresh(force=True)
    heartbeat.start_publisher(stop)
    # the dispatcher recovers this inbox if the heartbeat stops
    client.sadd(WORKERS_KEY, worker.worker_id)
    try:
        while not stop.is_set():
            worker.iterate(settings.worker.idle_poll_s)
            heartbeat.refresh()
    finally:
        stop.set()
        client.delete(heartbeat_key(worker.worker_id))
        caches.close()
    return 0

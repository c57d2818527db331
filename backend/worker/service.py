"""`maskserve worker`: one engine worker process serving one model on one device through Redis.

Reads its inbox stream, reports job events into the job state store, hands finished denoises to
the Celery post-processing queue, publishes a heartbeat with its live state, and exports
Prometheus metrics. Stops after the current step on SIGTERM/SIGINT and dies with its parent.
"""

from __future__ import annotations

import logging
import time

from redis import Redis

from backend import protocol
from backend.blobs import BlobStore
from backend.cache import TieredActivationCache, Tier
from backend.config import Settings
from backend.jobstate import JobStateStore
from backend.metrics import make_registry, serve_metrics
from backend.protocol import DenoisedJob, JobEvent, WorkerHeartbeat
from backend.runtime import stop_event_on_signals
from backend.tasks.celery_app import POST_TASK, make_celery
from backend.worker.loop import EngineWorker
from backend.worker.redis_inbox import RedisInbox

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 5
HEARTBEAT_EVERY_S = 1.0


def heartbeat_key(worker_id: str) -> str:
    return f"maskserve:worker:{worker_id}"


class RedisSink:
    """Job events into the job state store; finished denoises onto the post-processing queue."""

    def __init__(self, jobstate: JobStateStore, celery_app, post_queue: str):
        self.jobstate, self.celery_app, self.post_queue = jobstate, celery_app, post_queue

    def event(self, event: JobEvent) -> None:
        self.jobstate.record_event(event)

    def step_events(self, events: list[JobEvent]) -> None:
        self.jobstate.record_events(events)

    def denoised(self, job: DenoisedJob) -> None:
        self.celery_app.send_task(POST_TASK, args=[protocol.encode(job)], queue=self.post_queue)


class Heartbeat:
    """Publishes ``WorkerHeartbeat`` at most every ``HEARTBEAT_EVERY_S`` from the worker's own loop
    (so the state it reports is never read while the loop changes it). The metrics endpoint serves
    the snapshots taken here, never the live objects, for the same reason."""

    def __init__(self, client: Redis, worker: EngineWorker, caches: TieredActivationCache, settings: Settings):
        self.client, self.worker, self.caches, self.settings = client, worker, caches, settings
        self._last = 0.0
        self.worker_stats: dict = {}
        self.cache_stats: dict = {}

    def message(self) -> WorkerHeartbeat:
        live = self.worker.scheduler.live_state()
        self.worker_stats, self.cache_stats = self.worker.stats.snapshot(), self.caches.metrics.snapshot()
        return WorkerHeartbeat(
            worker_id=self.worker.worker_id, model_id=self.worker.engine.spec.model_id,
            device=self.settings.engine.device, at=time.time(), max_batch=live["max_batch"], batching=live["mode"],
            running=live["running"], waiting=live["waiting"], resident_ram=self.caches.resident(Tier.RAM),
            resident_disk=self.caches.resident(Tier.DISK), stats=self.worker_stats)

    def maybe_beat(self) -> None:
        now = time.monotonic()
        if now - self._last >= HEARTBEAT_EVERY_S:
            self._last = now
            self.client.set(heartbeat_key(self.worker.worker_id), protocol.encode(self.message()), ex=HEARTBEAT_TTL_S)


def build_worker(settings: Settings, client: Redis, celery_app=None) -> tuple[EngineWorker, TieredActivationCache]:
    from backend.engine.factory import build_engine
    from backend.tasks.core import CpuStages

    engine = build_engine(settings)
    caches = TieredActivationCache(engine.cache_root, settings.cache.ram_budget_mb << 20,
                                   settings.cache.disk_budget_mb << 20, policy=settings.cache.policy,
                                   pin_memory=settings.engine.device.startswith("cuda"))
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    jobstate = JobStateStore(client)
    celery_app = celery_app or make_celery(settings)
    stages = CpuStages(settings, engine, jobstate) if settings.worker.batching == "inline" else None
    worker = EngineWorker(engine, blobs, RedisInbox(client, settings.worker.worker_id),
                          RedisSink(jobstate, celery_app, settings.celery.post_queue),
                          worker_id=settings.worker.worker_id, mode=settings.worker.batching,
                          max_batch=settings.worker.max_batch, caches=caches, stages=stages)
    return worker, caches


def run_worker(settings: Settings) -> int:
    client = Redis.from_url(settings.redis.url)
    client.ping()
    worker, caches = build_worker(settings, client)
    heartbeat = Heartbeat(client, worker, caches, settings)
    serve_metrics(settings.worker.metrics_port, make_registry({
        "maskserve_worker": lambda: heartbeat.worker_stats, "maskserve_cache": lambda: heartbeat.cache_stats}))
    stop = stop_event_on_signals()
    log.info("worker %s serving %s on %s (%s batching, max batch %d)", worker.worker_id, worker.engine.spec.model_id,
             settings.engine.device, worker.mode, worker.scheduler.max_batch)
    try:
        while not stop.is_set():
            worker.iterate(settings.worker.idle_poll_s)
            heartbeat.maybe_beat()
    finally:
        client.delete(heartbeat_key(worker.worker_id))
        caches.close()
    return 0

"""`maskserve worker`: one engine worker process serving one model on one device through Redis.

Reads its inbox stream, reports job events into the job state store, hands finished denoises to
the Celery post-processing queue, publishes a heartbeat with its live state, and exports
Prometheus metrics. Stops after the current step on SIGTERM/SIGINT and dies with its parent.

Redis going away does not stop it. Every write the loop makes (job events, the hand-off to
post-processing, inbox acks) goes through one ``Outbox``: a write that fails because Redis is away
waits, with every later one, in order, until Redis answers again -- nothing is dropped and no ack
overtakes the hand-off of its job. While Redis is away the running batch keeps stepping and the
inbox is not read; ``run_worker`` retries with ``supervisor.reconnect_*`` backoff. When Redis is
back the worker writes what waited, joins ``WORKERS_KEY`` again, republishes its heartbeat (it may
have expired: the dispatcher then re-dispatched this inbox, and the job record's first terminal
status wins) and re-reads its own unacked inbox entries (a read whose reply was lost).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kombu.exceptions import OperationalError as BrokerUnavailable
from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from backend import protocol
from backend.blobs.factory import open_blob_store
from backend.cache import CacheMetrics, Tier, TieredActivationCache
from backend.config import Settings
from backend.costmodel.profiles import device_kind, load_profile
from backend.dispatch.router import RoutingCostModel
from backend.jobstate import JobStateStore
from backend.metrics import make_registry, serve_metrics
from backend.protocol import DenoisedJob, JobEvent, WorkerHeartbeat
from backend.protocol.keys import WORKERS_KEY, heartbeat_key
from backend.protocol.records import TERMINAL
from backend.runtime import REDIS_UNAVAILABLE, stop_event_on_signals
from backend.services.supervisor import Backoff, Reconnect
from backend.tasks.celery_app import make_celery, submit_postprocess
from backend.worker.adapter_book import AdapterBook
from backend.worker.adapter_tiers import worker_adapters
from backend.worker.baseline import BaselineWorker
from backend.worker.cache_budget import device_cache_budget
from backend.worker.deadlines import DeadlinePlan
from backend.worker.finish_tail import FinishTail
from backend.worker.loop import EngineWorker
from backend.worker.redis_inbox import RedisInbox
from backend.worker.stats import WorkerStats
from backend.worker.step_clock import StepClock

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 5
HEARTBEAT_EVERY_S = 1.0
# Redis (or the Celery broker on it) is away: wait and retry, never crash
REDIS_DOWN = (*REDIS_UNAVAILABLE, BrokerUnavailable)
# one quick retry on a pooled connection Redis closed when it restarted; outages are ours to handle
CLIENT_RETRY = Retry(ExponentialBackoff(cap=0.05, base=0.01), 1)
BASELINE_NOTE = (
    ": the ordinary diffusers pipeline, one call per batch, no activation cache, no masked-token "
    "compute"
)
SOCKET_TIMEOUT_S = 15.0  # above the longest inbox block (``worker.idle_poll_s`` <= 5 s)


class Outbox:
    """The worker's Redis writes, done in order even across a Redis outage.

    ``do(write)`` runs ``write`` at once unless earlier writes are waiting; a write that fails
    because Redis is away waits, and so does every later one, until ``flush`` gets them all
    through. Invariant: writes reach Redis in the order the loop made them (a job's ack never
    precedes its hand-off, its terminal event never precedes its progress), each at least once; a
    write retried after a lost reply may land twice, which the job record and the post-processing
    registration make harmless.
    """

    def __init__(self) -> None:
        self._waiting: deque[tuple[str, Callable[[], object]]] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def do(self, what: str, write: Callable[[], object]) -> None:
        if self._waiting:
            self._waiting.append((what, write))
            return
        try:
            write()
        except REDIS_DOWN as exc:
            log.warning("Redis unavailable (%s): %s waits until it is back", exc, what)
            self._waiting.append((what, write))

    def flush(self) -> None:
        """Do the waiting writes in order; raises (one of ``REDIS_DOWN``) while Redis is still
        away, keeping the write that failed and every later one."""
        while self._waiting:
            self._waiting[0][1]()
            self._waiting.popleft()


class OutboxSink:
    """A ``JobSink`` whose every write goes through the ``Outbox`` (it never raises for an
    outage)."""

    def __init__(self, sink: RedisSink, outbox: Outbox):
        self.sink, self.outbox = sink, outbox

    def event(self, event: JobEvent) -> None:
        self.outbox.do(f"{event.status} event of {event.job_id}", lambda: self.sink.event(event))

    def fail(self, job_id: str, reason: str) -> None:
        self.outbox.do(f"failure of {job_id}", lambda: self.sink.fail(job_id, reason))

    def step_events(self, events: list[JobEvent]) -> None:
        self.outbox.do(f"{len(events)} step events", lambda: self.sink.step_events(events))

    def denoised(self, job: DenoisedJob) -> None:
        self.outbox.do(f"hand-off of {job.job_id}", lambda: self.sink.denoised(job))


class OutageSafeInbox:
    """The ``RedisInbox`` as the loop reads it while Redis may be away: acks go through the
    ``Outbox`` (after the writes that precede them); while ``online`` is False ``poll`` reads
    nothing, and a poll that finds Redis gone returns what it has not lost (nothing) and turns
    ``online`` off. Coming back online re-reads this worker's unacked entries: a read whose reply
    was lost left them pending; duplicates of held jobs are dropped by the loop."""

    def __init__(self, inbox: RedisInbox, outbox: Outbox):
        self.inbox, self.outbox = inbox, outbox
        self.online = True

    def poll(self, timeout_s: float) -> list:
        if not self.online:
            return []
        try:
            return self.inbox.poll(timeout_s)
        except REDIS_DOWN as exc:
            log.warning("Redis unavailable while reading the inbox (%s)", exc)
            self.online = False
            return []

    def ack(self, job_id: str) -> None:
        self.outbox.do(f"ack of {job_id}", lambda: self.inbox.ack(job_id))

    def pending(self) -> int:
        return self.inbox.pending()

    def resume(self) -> None:
        """Redis answers again: read the inbox, our own unacked entries first."""
        self.inbox.replay()
        self.online = True


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
        submit_postprocess(
            self.celery_app,
            self.jobstate.client,
            self.settings,
            job,
            worker_id=self.settings.worker.worker_id,
        )


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
        self.jobstate = JobStateStore(client)
        self._built_at = 0.0
        self._encoded: str | None = None
        self._lock = threading.Lock()
        self.worker_stats: dict = {}
        self.cache_stats: dict = {}
        self.adapter_stats: dict = {}

    def message(self) -> WorkerHeartbeat:
        at = time.time()
        live = self.worker.scheduler.live_state(at)
        reserve_s = self.worker.finish_reserve_s()
        tails = {} if self.worker.finish_tail is None else {"finish_tail_s": reserve_s}
        self.worker_stats, self.cache_stats = (
            self.worker.stats.snapshot() | tails,
            self.caches.metrics.snapshot(),
        )
        return WorkerHeartbeat(
            worker_id=self.worker.worker_id,
            model_id=self.worker.engine.spec.model_id,
            device=self.settings.engine.device,
            at=at,
            max_batch=live["max_batch"],
            batching=live["mode"],
            running=live["running"],
            waiting=live["waiting"],
            # a worker that reads no cache (baseline) holds none, whatever the shared disk has
            resident_ram=self.caches.resident(Tier.RAM) if self.worker.caches else [],
            resident_disk=self.caches.resident(Tier.DISK) if self.worker.caches else [],
            resident_device=self.caches.resident(Tier.DEVICE) if self.worker.caches else [],
            **self._adapters(),
            finish_tail_s=reserve_s,
            stats=self.worker_stats,
        )

    def read_finish_tails(self) -> None:
        """The records of the jobs this worker handed on and has not measured yet, in one round
        trip: each done one gives its finish tail (``FinishTail``)."""
        tail = self.worker.finish_tail
        pending = [] if tail is None else tail.unresolved(time.time())
        if not pending:
            return
        for job_id, (status, done_at) in self.jobstate.statuses(pending).items():
            tail.resolve(job_id, done_at, ended=status is None or status in TERMINAL)

    def _adapters(self) -> dict[str, list[str]]:
        """The adapters on this worker's device and host tiers (routing prefers where a job's
        adapters are)."""
        if self.worker.adapters is None:
            return {}
        self.adapter_stats = self.worker.adapters.tiers.snapshot()
        on_device, on_host = self.worker.adapters.tiers.resident_shas()
        return {"adapters_device": on_device, "adapters_host": on_host}

    def refresh(self, force: bool = False) -> None:
        """From the worker loop: rebuild the message when it is due (or ``force``) and publish
        it."""
        now = time.monotonic()
        if force or now - self._built_at >= HEARTBEAT_EVERY_S:
            self._built_at = now
            self.read_finish_tails()
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
                except REDIS_DOWN:  # the worker loop reports the outage; the next beat retries
                    log.debug("heartbeat not published: Redis unavailable")

        thread = threading.Thread(target=publish_until_stopped, name="heartbeat", daemon=True)
        thread.start()
        return thread


def deadline_plan(settings: Settings) -> tuple[DeadlinePlan, StepClock]:
    """How the worker orders its rows (``settings.deadlines``), on its ``step_clock``. The plan
    decides on the clock's ``planned`` step time (with its noise margin); forecasts take the
    clock's prediction itself."""
    clock = step_clock(settings)
    return DeadlinePlan.from_settings(settings.deadlines, clock.planned), clock


def step_clock(settings: Settings) -> StepClock:
    """The worker's step clock, shaped by the model's fitted cost profile when one ships for it
    (else it learns seconds per row)."""
    model = None
    try:
        profile = load_profile(
            settings.paths.profiles_dir,
            settings.engine.model_id,
            device_kind(settings.engine.device),
            settings.engine.cache_mode,
        )
        model = RoutingCostModel.from_profile(profile).step_latency
    except (OSError, ValueError) as exc:
        log.info("no cost profile for the step clock (%s): it learns seconds per row", exc)
    return StepClock(model, plan_quantile=settings.deadlines.plan_quantile)


def build_worker(
    settings: Settings, client: Redis, celery_app=None
) -> tuple[EngineWorker, TieredActivationCache]:
    from backend.engine.factory import build_engine, engine_worker_role
    from backend.engine.previews import worker_previews
    from backend.tasks.core import CpuStages

    engine = build_engine(settings, role=engine_worker_role(settings))
    device_budget = device_cache_budget(settings)  # measured now that the model is loaded
    log.info(
        "cache device budget device=%s budget_bytes=%d reason=%s",
        settings.engine.device,
        device_budget.budget_bytes,
        device_budget.reason,
    )
    caches = TieredActivationCache(
        engine.cache_root,
        settings.cache.ram_budget_mb << 20,
        settings.cache.disk_budget_mb << 20 or None,  # 0: a share of the disk's room
        policy=settings.cache.policy,
        disk_free_share=settings.cache.disk_free_share,
        pin_memory=settings.engine.device.startswith("cuda"),
        device_budget_bytes=device_budget.budget_bytes,
        device=settings.engine.device,
    )
    blobs = open_blob_store(settings)
    jobstate = JobStateStore(client, settings.retention.job_record_s)
    celery_app = celery_app or make_celery(settings)
    outbox = Outbox()
    sink = OutboxSink(RedisSink(jobstate, celery_app, settings), outbox)
    inbox = RedisInbox(
        client,
        settings.worker.worker_id,
        fail_job=sink.fail,
        max_redeliveries=settings.dispatcher.max_redeliveries,
    )
    common = dict(worker_id=settings.worker.worker_id, max_batch=settings.worker.max_batch)
    if settings.worker.batching == "baseline":  # reads no cache: ``caches`` serves the heartbeat
        worker: EngineWorker = BaselineWorker(
            engine,
            blobs,
            OutageSafeInbox(inbox, outbox),
            sink,
            max_pixels=settings.celery.max_upload_pixels,
            **common,
        )
        return worker, caches
    inline = settings.worker.batching == "inline"
    plan, clock = deadline_plan(settings)
    worker = EngineWorker(
        engine,
        blobs,
        OutageSafeInbox(inbox, outbox),
        sink,
        mode=settings.worker.batching,
        caches=caches,
        stages=CpuStages(settings, engine, jobstate) if inline else None,
        previews=worker_previews(settings, engine),  # fits its latent -> RGB map once
        adapters=worker_adapters(settings, engine),
        plan=plan,
        clock=clock,
        join_rule=clock.join_rule(settings.worker.join_when_it_pays),
        forecast_refresh_s=settings.deadlines.forecast_refresh_s,
        finish_tail=FinishTail() if settings.deadlines.finish_tail else None,
        **common,
    )
    # a step that runs out of device memory first takes it back from the cache's device tier
    # (reloaded from host RAM), then from the compiled graphs (compiled again, much slower)
    worker.memory.register(caches.release_device_bytes)
    worker.memory.register(engine.release_graphs)
    return worker, caches


def connect(settings: Settings) -> Redis:
    """The worker's Redis client: bounded socket waits, one quick retry (``CLIENT_RETRY``)."""
    return Redis.from_url(
        settings.redis.url,
        retry=CLIENT_RETRY,
        socket_connect_timeout=2.0,
        socket_timeout=SOCKET_TIMEOUT_S,
    )


class Serving:
    """``run_worker``'s loop, one ``turn`` at a time: write what waited, rejoin after an outage,
    iterate the engine worker; back off while Redis is away (stepping the running batch
    meanwhile)."""

    def __init__(self, settings: Settings, client: Redis, worker: EngineWorker, heartbeat):
        self.settings, self.client = settings, client
        self.worker, self.heartbeat = worker, heartbeat
        self.inbox: OutageSafeInbox = worker.inbox
        self.reconnect = Reconnect(
            Backoff(settings.supervisor.reconnect_initial_s, settings.supervisor.reconnect_max_s)
        )
        self.retry_at = 0.0  # monotonic time of the next attempt to reach Redis
        self.down_since: float | None = None

    def join(self) -> None:
        """Publish the heartbeat and join ``WORKERS_KEY`` (the dispatcher recovers the inbox of a
        member whose heartbeat stops)."""
        self.heartbeat.refresh(force=True)
        self.client.sadd(WORKERS_KEY, self.worker.worker_id)

    def turn(self, stop: threading.Event) -> None:
        now = time.monotonic()
        if now >= self.retry_at:
            self._reach_redis(now)
        if not self.inbox.online and self.worker.scheduler.idle:
            stop.wait(max(0.0, self.retry_at - now))  # nothing to step until Redis is back
            return
        # while Redis is away the running batch keeps stepping, its writes wait in the outbox
        self.worker.iterate(self.settings.worker.idle_poll_s if self.inbox.online else 0.0)

    def _reach_redis(self, now: float) -> None:
        """Write what waited, rejoin after an outage (the inbox found Redis gone, or the last
        attempt failed) and refresh the heartbeat; while Redis is away, schedule the next attempt
        and keep the inbox offline."""
        outbox: Outbox = self.inbox.outbox
        try:
            outbox.flush()
            if self.inbox.online:
                self.heartbeat.refresh()
            else:
                self.join()
                self.inbox.resume()
                self._log_back(now)
            self.reconnect.succeeded()
        except REDIS_DOWN as exc:
            wait = self.reconnect.failed()
            self.retry_at, self.inbox.online = now + wait, False
            self.down_since = now if self.down_since is None else self.down_since
            log.warning(
                "Redis unavailable (%s): %d writes waiting, retrying in %.1f s",
                exc,
                len(outbox),
                wait,
                extra={"fields": {"event": "redis_unavailable", "retry_in_s": wait}},
            )

    def _log_back(self, now: float) -> None:
        if self.down_since is None:
            return
        log.warning(
            "Redis back after %.1f s: waiting writes done, %s re-registered",
            now - self.down_since,
            self.worker.worker_id,
            extra={"fields": {"event": "redis_back", "outage_s": now - self.down_since}},
        )
        self.down_since = None


def run_worker(settings: Settings) -> int:
    client = connect(settings)
    client.ping()
    worker, caches = build_worker(settings, client)
    heartbeat = Heartbeat(client, worker, caches, settings)
    serve_metrics(
        settings.worker.metrics_port,
        make_registry(
            {
                "maskserve_worker": lambda: heartbeat.worker_stats,
                "maskserve_cache": lambda: heartbeat.cache_stats,
                "maskserve_adapters": lambda: heartbeat.adapter_stats,
            },
            counters={
                "maskserve_worker": WorkerStats.COUNTERS,
                "maskserve_cache": CacheMetrics.COUNTERS,
                "maskserve_adapters": AdapterBook.COUNTERS,
            },
        ),
        settings.metrics_host,
    )
    stop = stop_event_on_signals()
    log.info(
        "worker %s serving %s on %s (%s batching, max batch %d)%s",
        worker.worker_id,
        worker.engine.spec.model_id,
        settings.engine.device,
        worker.mode,
        worker.scheduler.max_batch,
        BASELINE_NOTE if isinstance(worker, BaselineWorker) else "",
    )
    serving = Serving(settings, client, worker, heartbeat)
    serving.join()
    heartbeat.start_publisher(stop)
    try:
        while not stop.is_set():
            serving.turn(stop)
    finally:
        stop.set()
        try:
            client.delete(heartbeat_key(worker.worker_id))
        except REDIS_DOWN:  # the key expires on its own
            pass
        caches.close()
    return 0

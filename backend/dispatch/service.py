"""`maskserve dispatcher`: routes pre-processed jobs to engine workers and recovers dead workers'
jobs.

Input: the stream ``keys.PREPARED_STREAM`` read through consumer group ``keys.DISPATCHER_GROUP``.
An entry is acked only once its job sits in a worker's inbox (or was dropped because it had already
finished or was cancelled), so a restarted dispatcher first re-reads its own pending entries, then
new ones: no job is lost between the two streams. An entry that cannot be decoded is acked and, when
it names its job, fails that job with a terminal event saying why (it never hangs).

Workers: heartbeats (``backend.protocol.heartbeats``) give the live workers and their state
(rows, templates and LoRA adapters resident per tier; each job's adapters, sha256 and size, go to
the router with it);
``keys.WORKERS_KEY`` (a set every worker joins at start) remembers the ones that may have died.
Between two heartbeats the dispatcher adds the jobs it has just sent to a worker's view, so a burst
is not routed as if every worker were still idle.

Late binding (``late_binding``): the router refuses a job while no worker has slack, and the job
waits in the dispatcher's backlog (its stream entry still pending) until one has. Waiting jobs and
those just read are placed in the workers' order (``deadline_cost.placing_order``: priority, then
deadline, then arrival), so a freed slot goes to a tight job before bulk jobs held ahead of it.
A job no live worker's model serves waits there too, and its message (and event stream) says so,
naming the models live workers serve: once, and again only when those change, not at every
retry; when it is routed at last its message says to which worker. (The API refuses a job for a
model no live worker serves that the deployment does not configure, so only a configured model's
jobs wait here.)

Idempotent routing: a job's inbox entry and its ``worker_id`` are written in one transaction, so an
entry read again (this dispatcher died before its ack, or a job handed off twice) whose job is
assigned to a live worker, or is past routing, is acked and dropped.

Recovery: when a known worker's heartbeat has expired, the entries of its inbox it had not finished
(pending in its group, or never read) are read, and every job among them that was not denoised yet
goes back to ``waiting`` and is routed again (at most ``dispatcher.max_redeliveries`` times: then
it fails); then the dead inbox is deleted. The job state's first terminal status wins, so a job
finishes at most once even if a worker presumed dead was only slow.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from dataclasses import replace

from redis import Redis
from redis.exceptions import ResponseError

from backend import protocol
from backend.config import Settings
from backend.costmodel.profiles import device_kind, load_profile
from backend.dispatch.deadline_cost import placing_order
from backend.dispatch.router import (
    AdapterNeed,
    JobRequest,
    Router,
    RoutingCostModel,
    RowOrder,
    RowState,
    view_from_heartbeat,
    waiting_note,
)
from backend.jobstate import EXHAUSTED, REQUEUED, TERMINAL, JobStateStore
from backend.protocol import JobEvent, PreparedJob, entry_fields, entry_message, to_text
from backend.protocol.heartbeats import live_heartbeats
from backend.protocol.keys import (
    DISPATCHER_GROUP,
    INBOX_GROUP,
    PREPARED_STREAM,
    WORKERS_KEY,
    heartbeat_key,
    inbox_stream,
    job_key,
)
from backend.services.supervisor import Backoff, Reconnect
from backend.worker.redis_inbox import queue_to_inbox
from backend.worker.stats import percentile

log = logging.getLogger(__name__)

# Entries another dispatcher read but never acked (it died) are taken over after this long.
CLAIM_IDLE_MS = 30_000
PENDING_PAGE = 500  # a dead inbox's pending entries read per round trip
PAST_ROUTING = ("running", "postprocessing", *TERMINAL)


class CostModels:
    """Routing cost models per (model, device), loaded lazily from the shipped profiles."""

    def __init__(self, settings: Settings):
        self.profiles_dir = settings.paths.profiles_dir
        self.mode = settings.engine.cache_mode
        d = settings.dispatcher
        # adapter loads (router docstring): bandwidths set in GB/s, 0 = fitted / default; the join
        # deadline is the workers' own setting, so router and workers agree on K
        self.adapter_costs = {
            "adapter_copy_s_per_byte": 1e-9 / d.adapter_copy_gbps if d.adapter_copy_gbps else None,
            "adapter_read_s_per_byte": 1e-9 / d.adapter_read_gbps if d.adapter_read_gbps else None,
            "adapter_join_by": settings.adapters.join_by,
        }
        self.models: dict[tuple[str, str], RoutingCostModel] = {}
        self._missing: set[tuple[str, str]] = set()

    def ensure(self, model_id: str, device: str) -> RoutingCostModel | None:
        """The cost model of ``model_id`` on ``device``'s kind, loaded on first use; None without a
        profile."""
        key = (model_id, device_kind(device))
        if key not in self.models and key not in self._missing:
            try:
                profile = load_profile(self.profiles_dir, model_id, key[1], self.mode)
                self.models[key] = RoutingCostModel.from_profile(profile, **self.adapter_costs)
            except (OSError, ValueError) as exc:
                log.warning(
                    "no cost profile for %s on %s (%s): routing it by request count",
                    model_id,
                    device,
                    exc,
                )
                self._missing.add(key)
        return self.models.get(key)


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        client: Redis,
        consumer: str | None = None,
        claim_idle_ms: int = CLAIM_IDLE_MS,
    ):
        self.settings, self.client = settings, client
        self.jobstate = JobStateStore(client, settings.retention.job_record_s)
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.costs = CostModels(settings)
        d = settings.dispatcher
        self.router = Router(
            d.policy,
            allow_queueing=not d.late_binding,
            queue_depth=d.queue_depth if d.late_binding else 0,
        )
        self.backlog: deque[tuple[str, PreparedJob]] = deque()  # (entry id, job) with no worker yet
        self._replay_from: str | None = "0"
        self.claim_idle_ms = claim_idle_ms
        self._views: dict = {}
        self._checked_at = 0.0
        self.decision_s: deque[float] = deque(maxlen=10_000)
        self.counts = {
            "routed": 0,
            "dropped": 0,
            "duplicates": 0,
            "redispatched": 0,
            "unreadable": 0,
            "routed_with_deadline": 0,  # jobs with a deadline routed
            "routed_late": 0,  # ... to a worker where they were predicted to finish late
        }
        # job id -> what its message says while no live worker serves its model
        self._told_no_worker: dict[str, str] = {}
        try:
            client.xgroup_create(PREPARED_STREAM, DISPATCHER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # ----- the loop ----------------------------------------------------------------------------
    def iterate(self, block_ms: int = 100) -> None:
        if time.monotonic() - self._checked_at >= self.settings.dispatcher.check_every_s:
            self._checked_at = time.monotonic()
            self.refresh_workers()
            self.recover_dead_workers()
            for entry_id, job in self._claim_orphans():
                self._route(entry_id, job)
        fresh = self._read(block_ms)  # blocks while nothing arrives: also paces backlog retries
        waiting = [*self.backlog, *fresh]  # in arrival order
        self.backlog.clear()
        services = [(job.service.priority, job.service.deadline) for _, job in waiting]
        for index in placing_order(services, time.time()):
            self._route(*waiting[index])

    def refresh_workers(self) -> None:
        beats = live_heartbeats(self.client)
        if beats:
            # a worker we route to is one we recover: its heartbeat may come back (from its
            # heartbeat thread) before its loop re-joins the set after a Redis outage, and if it
            # died then, its inbox would otherwise never be recovered
            self.client.sadd(WORKERS_KEY, *beats)
        for beat in beats.values():
            model = self.costs.ensure(beat.model_id, beat.device)
            if model is not None:
                self.router.cost_models[(beat.model_id, device_kind(beat.device))] = model
        dl = self.settings.deadlines  # the workers' step scheduler, as the router models it
        order = RowOrder(
            dl.scheduler,
            dl.round_steps,
            dl.max_parks_per_round,
            dl.size_batches,
            dl.urgent_parks,
            dl.max_wait_s,
            dl.park_by_deadline,
        )
        self._views = {
            worker_id: view_from_heartbeat(beat, order) for worker_id, beat in beats.items()
        }

    def _read(self, block_ms: int) -> list[tuple[str, PreparedJob]]:
        replaying = self._replay_from is not None
        reply = self.client.xreadgroup(
            DISPATCHER_GROUP,
            self.consumer,
            {PREPARED_STREAM: self._replay_from or ">"},
            count=64,
            block=None if replaying or block_ms <= 0 else block_ms,
        )
        entries = reply[0][1] if reply else []
        if replaying:  # our own pending entries first (a restart), then new ones
            self._replay_from = to_text(entries[-1][0]) if len(entries) == 64 else None
        return self._decode_entries(entries)

    def _claim_orphans(self) -> list[tuple[str, PreparedJob]]:
        """Entries a dead dispatcher left pending (XAUTOCLAIM), minus our own backlog."""
        mine = {entry_id for entry_id, _ in self.backlog}
        reply = self.client.xautoclaim(
            PREPARED_STREAM,
            DISPATCHER_GROUP,
            self.consumer,
            min_idle_time=self.claim_idle_ms,
            start_id="0-0",
            count=100,
        )
        return [(e, j) for e, j in self._decode_entries(reply[1]) if e not in mine]

    def _decode_entries(self, entries) -> list[tuple[str, PreparedJob]]:
        jobs = []
        for entry_id, fields in entries:
            entry_id, encoded = to_text(entry_id), entry_message(fields)
            try:
                job = protocol.decode(encoded)
                if not isinstance(job, PreparedJob):
                    raise protocol.ProtocolError(f"expected a prepared_job, got a {job.TYPE}")
            except protocol.ProtocolError as exc:
                self._drop_unreadable(entry_id, encoded, exc)
                continue
            jobs.append((entry_id, job))
        return jobs

    def _drop_unreadable(self, entry_id: str, encoded, error: Exception) -> None:
        """Ack an entry that cannot be routed; the job it names (if any) fails, saying why."""
        job_id = protocol.job_id_of(encoded)
        log.error("dropping unreadable entry %s (job %s): %s", entry_id, job_id, error)
        self.counts["unreadable"] += 1
        if job_id:
            message = f"the dispatcher could not read this job ({error}): submit it again"
            self.jobstate.record_event(
                JobEvent(job_id=job_id, status="failed", at=time.time(), message=message)
            )
        self.client.xack(PREPARED_STREAM, DISPATCHER_GROUP, entry_id)

    # ----- routing -------------------------------------------------------------------------------
    def _route(self, entry_id: str, job: PreparedJob) -> None:
        status, worker_id = (
            None if value is None else to_text(value)
            for value in self.client.hmget(job_key(job.job_id), "status", "worker_id")
        )
        if status in TERMINAL:  # cancelled (or failed) before it reached a worker
            self.counts["dropped"] += 1
            self._told_no_worker.pop(job.job_id, None)
            self.client.xack(PREPARED_STREAM, DISPATCHER_GROUP, entry_id)
            return
        if status in PAST_ROUTING or worker_id in self._views:  # routed before: a duplicate
            log.warning(
                "%s is on worker %s already (%s): entry dropped", job.job_id, worker_id, status
            )
            self.counts["duplicates"] += 1
            self.client.xack(PREPARED_STREAM, DISPATCHER_GROUP, entry_id)
            return
        worker_id = self.place(job)
        if worker_id is None:
            self.backlog.append((entry_id, job))
            self._tell_if_no_worker(job)
            return
        if self._told_no_worker.pop(job.job_id, None) is not None:
            # the job said it waits for a worker: its message (and its events) now say where it went
            self._tell(job.job_id, f"routed to worker {worker_id}, which serves {job.model_id}")
        self.client.xack(PREPARED_STREAM, DISPATCHER_GROUP, entry_id)

    def _tell_if_no_worker(self, job: PreparedJob) -> None:
        """While no live worker serves the job's model, its message (and its event stream) says so
        and names the models live workers serve: once, and again only when that changes, never at
        every retry. It is routed as soon as a worker of its model beats."""
        note = waiting_note(job.model_id, list(self._views.values()))
        if note is None:  # served, only busy (late binding)
            if job.job_id not in self._told_no_worker:
                return
            note = f"waiting for a free slot on a worker that serves {job.model_id}"
        if self._told_no_worker.get(job.job_id) != note:
            self._told_no_worker[job.job_id] = note
            self._tell(job.job_id, note)

    def _tell(self, job_id: str, message: str) -> None:
        self.jobstate.record_event(
            JobEvent(job_id=job_id, status="waiting", at=time.time(), message=message)
        )

    def place(self, job: PreparedJob, note: str = "") -> str | None:
        """Choose a worker and put the job in its inbox, recording the worker and ``note`` (the
        job's message) in the same transaction; None when no worker can take it yet."""
        request = JobRequest(
            job_id=job.job_id,
            model_id=job.model_id,
            mask_ratio=job.mask_ratio,
            num_steps=job.num_steps,
            template=job.cache_digest,
            adapters=tuple(AdapterNeed(a.sha256, a.nbytes) for a in job.adapters),
            deadline=job.service.deadline,
            priority=job.service.priority,
            now=time.time(),  # deadlines are epoch seconds
            batch_id=job.batch_id,
        )
        started = time.perf_counter()
        decision = self.router.choose(request, list(self._views.values()))
        self.decision_s.append(time.perf_counter() - started)
        if decision.worker_id is None:
            return None
        with self.client.pipeline(transaction=True) as pipe:
            queue_to_inbox(pipe, decision.worker_id, job)
            self.jobstate.assign(job.job_id, decision.worker_id, note, client=pipe)
            pipe.execute()
        view = self._views[decision.worker_id]  # count it until the worker's next heartbeat does
        self._views[decision.worker_id] = replace(
            view,
            waiting=view.waiting
            + (
                RowState(
                    job.job_id,
                    job.mask_ratio,
                    job.num_steps,
                    job.cache_digest,
                    tuple(a.sha256 for a in job.adapters),
                    job.service.deadline,
                    job.service.priority,
                ),
            ),
        )
        self.counts["routed"] += 1
        if request.deadline:
            self.counts["routed_with_deadline"] += 1
            late = decision.terms.get(decision.worker_id, {}).get("late_s", 0.0)
            self.counts["routed_late"] += late > 0
        log.info(
            "routed %s to %s (%s: %s)",
            job.job_id,
            decision.worker_id,
            decision.policy,
            decision.reason,
        )
        return decision.worker_id

    # ----- recovery ------------------------------------------------------------------------------
    def recover_dead_workers(self) -> None:
        known = {to_text(w) for w in self.client.smembers(WORKERS_KEY)}
        for worker_id in sorted(known - set(self._views)):
            if self.client.exists(heartbeat_key(worker_id)):
                continue  # came back since the last refresh
            self._recover(worker_id)

    def _recover(self, worker_id: str) -> None:
        stream = inbox_stream(worker_id)
        entries = self._unfinished_entries(stream)
        for _entry_id, fields in entries:
            try:
                message = protocol.decode(entry_message(fields))
            except protocol.ProtocolError:
                continue
            if isinstance(message, PreparedJob):  # cancels and the like die with their worker
                self._redispatch(message, worker_id)
        self.client.delete(stream)
        self.client.srem(WORKERS_KEY, worker_id)
        log.warning("worker %s is gone: %d inbox entries recovered", worker_id, len(entries))

    def _redispatch(self, job: PreparedJob, worker_id: str) -> None:
        note = f"worker {worker_id} stopped; re-dispatched"
        limit = self.settings.dispatcher.max_redeliveries
        verdict = self.jobstate.requeue(job.job_id, note, limit)
        if verdict == EXHAUSTED:
            self.jobstate.fail(
                job.job_id, f"the job stopped its worker {limit + 1} times; giving up"
            )
        elif verdict == REQUEUED:
            self.counts["redispatched"] += 1
            if self.place(job, note) is None:  # no worker now: park it in the routing stream
                self.client.xadd(PREPARED_STREAM, entry_fields(protocol.encode(job)))

    def _unfinished_entries(self, stream: str) -> list:
        """The entries of an inbox its worker had not finished: pending in its group (read, not
        acked) and never read (after the group's last delivered id); not its acked history."""
        groups = self.client.xinfo_groups(stream) if self.client.exists(stream) else []
        group = next((g for g in groups if to_text(g["name"]) == INBOX_GROUP), None)
        if group is None:  # its worker never read it: every entry is unread
            return self.client.xrange(stream)
        pending_ids, start = [], "-"
        while True:
            page = self.client.xpending_range(
                stream, INBOX_GROUP, min=start, max="+", count=PENDING_PAGE
            )
            pending_ids += [to_text(row["message_id"]) for row in page]
            if len(page) < PENDING_PAGE:
                break
            start = f"({pending_ids[-1]}"
        with self.client.pipeline(transaction=False) as pipe:
            for entry_id in pending_ids:
                pipe.xrange(stream, entry_id, entry_id)
            pending = [entry for found in pipe.execute() for entry in found]  # gone if trimmed
        unread = self.client.xrange(stream, f"({to_text(group['last-delivered-id'])}", "+")
        return pending + unread

    def stats(self) -> dict:
        return {
            **{f"{k}_total": v for k, v in self.counts.items()},
            "backlog": len(self.backlog),
            "live_workers": len(self._views),
            "decision_p50_s": percentile(self.decision_s, 50),
            "decision_p95_s": percentile(self.decision_s, 95),
        }


def run_dispatcher(settings: Settings) -> int:
    from backend.metrics import make_registry, serve_metrics
    from backend.runtime import REDIS_UNAVAILABLE, stop_event_on_signals

    client = Redis.from_url(settings.redis.url)
    client.ping()
    dispatcher = Dispatcher(settings, client)
    serve_metrics(
        settings.dispatcher.metrics_port,
        make_registry({"maskserve_dispatcher": dispatcher.stats}),
        settings.metrics_host,
    )
    stop = stop_event_on_signals()
    log.info("dispatcher %s routing with %s", dispatcher.consumer, settings.dispatcher.policy)
    supervision = settings.supervisor
    reconnect = Reconnect(Backoff(supervision.reconnect_initial_s, supervision.reconnect_max_s))
    while not stop.is_set():
        try:
            dispatcher.iterate()
        # Redis restarting: wait (backing off), then resume from the stream
        except REDIS_UNAVAILABLE as exc:
            wait_s = reconnect.failed()
            log.warning("Redis unavailable (%s); retrying in %.1f s", exc, wait_s)
            stop.wait(wait_s)
            continue
        if reconnect.succeeded():
            log.info("Redis is back: routing again")
    return 0

"""Leases of CPU tasks in flight: a lost Celery worker's task is re-enqueued within a bound.

The broker's visibility timeout (``celery.visibility_timeout_s``, minutes: it must exceed the
longest task) stays the backstop; a lease makes the usual loss quick. Per job, at most one CPU
stage is in flight (pre, then post), kept in two keys:

* ``keys.cpu_task_key(job_id)``: a hash with the ``stage`` (pre | post), the task's durable
  ``message`` (what the sweeper re-enqueues) and the live holder's ``token`` ("" when none);
* ``keys.CPU_LEASES_KEY``: a sorted set, job id -> the lease deadline.

A task ``claim``s its job's lease when it starts and a thread renews it every third of
``celery.lease_s`` while it runs; it ``release``s it when it ends (the record goes: the stage is
over) or when it retries (the holder is cleared). The dispatcher's ``sweep_lapsed`` takes every
lease past its deadline: a job still in that stage is re-enqueued from the durable message (counted
in the job's ``redeliveries``; past ``dispatcher.max_redeliveries`` the job fails instead), one that
moved on or ended is forgotten. A claim that finds a predecessor which never released (Celery
redelivered a lost task itself) counts a redelivery the same way; a claim that finds a live holder
is a duplicate and does nothing. Post-processing is registered before it is sent
(``register_post``), atomically with the job's ``denoised`` count, so a job's post task is queued
once even if it is denoised twice, and one lost between the two writes is re-enqueued by the sweep.

Every script is atomic, so two dispatchers sweeping, or a sweep racing a task's renewal, take a
lease once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from redis import Redis

from backend.jobstate import worker_fence
from backend.protocol import to_text
from backend.protocol.keys import CPU_LEASES_KEY, cpu_task_key, job_key
from backend.protocol.records import TERMINAL

log = logging.getLogger(__name__)

STAGE_STATUSES = {"pre": ("queued", "preprocessing"), "post": ("running", "postprocessing")}
STAGE_NAMES = {"pre": "pre-processing", "post": "post-processing"}
CLAIMED, HELD, EXHAUSTED = "claimed", "held", "exhausted"
SWEEP_BATCH = 100  # leases taken per sweep (the rest at the next)

# KEYS: task hash, leases, job hash. ARGV: job id, stage, message, deadline, the handing worker.
# 1 when registered, 0 when the job is gone, was denoised before (its post task is queued
# already) or was taken from this worker (re-dispatched while it was cut off: the record's
# worker_id fences it, see backend.jobstate).
_REGISTER_POST = (
    """
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
"""
    + worker_fence("KEYS[3]", "ARGV[5]")
    + """
if redis.call('HINCRBY', KEYS[3], 'denoised', 1) > 1 then return 0 end
redis.call('HSET', KEYS[1], 'stage', ARGV[2], 'message', ARGV[3], 'token', '')
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return 1
"""
)
# KEYS: task hash, leases, job hash. ARGV: job id, stage, message, token, now, lease_s, max.
_CLAIM = """
local holder = redis.call('HGET', KEYS[1], 'token')
local deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
if holder and holder ~= '' and holder ~= ARGV[4] then
  if deadline and tonumber(deadline) > tonumber(ARGV[5]) then return 'held' end
  if redis.call('EXISTS', KEYS[3]) == 1
     and redis.call('HINCRBY', KEYS[3], 'redeliveries', 1) > tonumber(ARGV[7]) then
    return 'exhausted'
  end
end
redis.call('HSET', KEYS[1], 'stage', ARGV[2], 'message', ARGV[3], 'token', ARGV[4])
redis.call('ZADD', KEYS[2], tonumber(ARGV[5]) + tonumber(ARGV[6]), ARGV[1])
return 'claimed'
"""
# KEYS: task hash, leases. ARGV: job id, token, deadline.
_RENEW = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""
# KEYS: task hash, leases. ARGV: job id, token, 1 to end the stage / 0 to keep it (a retry),
# the deadline a kept record gets (the retry is queued: the broker's bound).
_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[2] then return 0 end
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  redis.call('HSET', KEYS[1], 'token', '')
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
end
return 1
"""
# KEYS: task hash, leases. ARGV: job id, now, the next deadline. {stage, message} of a lapsed
# lease, now taken by this sweep; nil when it is live or another sweep took it.
_TAKE = """
local deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not deadline or tonumber(deadline) > tonumber(ARGV[2]) then return nil end
local record = redis.call('HMGET', KEYS[1], 'stage', 'message')
if not record[1] or not record[2] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return nil
end
redis.call('HSET', KEYS[1], 'token', '')
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return record
"""


def lapse_verdict(stage: str, status: str | None, redeliveries: int, max_redeliveries: int) -> str:
    """What to do with a job whose ``stage`` task lost its lease: ``forget`` it (the job is gone,
    ended, or moved past the stage), ``fail`` it (redelivered ``max_redeliveries`` times already),
    or ``requeue`` its task."""
    if status is None or status in TERMINAL or status not in STAGE_STATUSES[stage]:
        return "forget"
    return "fail" if redeliveries >= max_redeliveries else "requeue"


@dataclass(frozen=True)
class Lapsed:
    """A lease the sweep took: the job, its stage and the task's message to send again."""

    job_id: str
    stage: str
    message: str


class CpuLeases:
    """The lease keys of every CPU task, over one Redis client (see the module docstring)."""

    def __init__(self, client: Redis, lease_s: float, backstop_s: float):
        """``backstop_s``: the deadline given to a task that is queued, not running (registered,
        retrying, re-enqueued): the broker's visibility timeout, which redelivers it anyway."""
        self.client, self.lease_s, self.backstop_s = client, lease_s, backstop_s
        self._register_post = client.register_script(_REGISTER_POST)
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._take = client.register_script(_TAKE)

    def _keys(self, job_id: str) -> list[str]:
        return [cpu_task_key(job_id), CPU_LEASES_KEY, job_key(job_id)]

    def register_post(self, job_id: str, message: str, worker_id: str = "") -> bool:
        """Record a job's post task before it is sent, counting the job's denoise; False when it
        must not be sent (the job is gone, it was denoised and handed on before, or it now
        belongs to another worker than ``worker_id``)."""
        args = [job_id, "post", message, time.time() + self.backstop_s, worker_id]
        return bool(self._register_post(keys=self._keys(job_id), args=args))

    def claim(self, job_id: str, stage: str, message: str, token: str, max_redel: int) -> str:
        """A task starting: ``CLAIMED`` (it holds the lease now), ``HELD`` (a live task holds it:
        this one is a duplicate) or ``EXHAUSTED`` (its predecessors were lost too often)."""
        args = [job_id, stage, message, token, time.time(), self.lease_s, max_redel]
        return to_text(self._claim(keys=self._keys(job_id), args=args))

    def renew(self, job_id: str, token: str) -> bool:
        """Extend the holder's lease; False once it is not the holder any more."""
        args = [job_id, token, time.time() + self.lease_s]
        return bool(self._renew(keys=self._keys(job_id)[:2], args=args))

    def release(self, job_id: str, token: str, stage_over: bool) -> None:
        """The holder ends: the stage is over (the record goes) or its task was queued again."""
        args = [job_id, token, int(stage_over), time.time() + self.backstop_s]
        self._release(keys=self._keys(job_id)[:2], args=args)

    @contextlib.contextmanager
    def renewing(self, job_id: str, token: str) -> Iterator[None]:
        """Renew the lease every third of ``lease_s`` while the block runs (a daemon thread: it
        dies with its process, and the lease then lapses)."""
        stop = threading.Event()

        def renew_until_stopped() -> None:
            while not stop.wait(self.lease_s / 3):
                try:
                    if not self.renew(job_id, token):
                        return  # taken over (lapsed while Redis was away): the sweep re-sent it
                except Exception:  # Redis away for a moment: the next renewal tries again
                    log.warning("lease of %s not renewed", job_id, exc_info=True)

        thread = threading.Thread(target=renew_until_stopped, name="cpu-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()

    def take_lapsed(self, now: float | None = None) -> list[Lapsed]:
        """Take every lease past its deadline at ``now`` (default: the time); each gets the
        backstop deadline, so it is taken once even by racing sweeps."""
        now = time.time() if now is None else now
        job_ids = self.client.zrangebyscore(CPU_LEASES_KEY, "-inf", now, start=0, num=SWEEP_BATCH)
        lapsed = []
        for job_id in map(to_text, job_ids):
            reply = self._take(
                keys=self._keys(job_id)[:2], args=[job_id, now, now + self.backstop_s]
            )
            if reply:
                lapsed.append(Lapsed(job_id, to_text(reply[0]), to_text(reply[1])))
        return lapsed

    def forget(self, job_id: str) -> None:
        """Drop a job's record (its stage is over, or the job is)."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(cpu_task_key(job_id))
            pipe.zrem(CPU_LEASES_KEY, job_id)
            pipe.execute()


def new_token() -> str:
    """A task execution's lease token."""
    return uuid.uuid4().hex

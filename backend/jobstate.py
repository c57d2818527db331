"""Job state in Redis: one hash per job plus a stream of its events.

Keys: ``keys.job_key`` (the hash, typed by ``backend.protocol.records.JobRecord``) and
``keys.job_events_key`` (a capped stream of ``records.event_payload``s).

Invariants (enforced atomically by one Lua script, so racing writers from different processes
cannot break them):
* status only moves forward (``requeue``, below, is the one way back): queued < preprocessing <
  waiting < running < postprocessing < terminal; a late event of an earlier stage is dropped (a
  step event arriving after ``done`` does not resurrect the job);
* a terminal status (done, failed, cancelled) is final: the first one wins, so a job completes at
  most once even when a task is delivered twice;
* an event for a job that was never created is dropped (no half-made jobs);
* an event a worker sends for a job the dispatcher has since taken from it (the record names
  another worker, or none after ``requeue``) is dropped: a worker cut off from Redis past its
  heartbeat keeps stepping, and what it writes when the link heals must not overwrite the state of
  the worker that now runs the job (the record's ``worker_id`` is the fencing token);
* the message says what is happening now: an event that changes the status replaces the message
  with its own (none clears it), an event of the same status replaces it only when it has one;
* a failed or cancelled job reports timings like a done one: its terminal event sets the stages it
  went through (the time between the statuses it reached, ``records.STAGE_TIMINGS``) and
  ``total_s`` (creation to the end), keeping any the event gives, and carries them in the stream;
* ``redeliveries`` counts the deliveries of the job again after a lost worker; ``requeue`` refuses
  to go past the bound its caller gives (the caller fails the job instead), so a job that kills its
  worker every time ends ``failed`` instead of looping.
* a job is in the unstarted set (``UNSTARTED_KEY``, admission control's queue) from its creation
  until it first reaches ``running`` or a terminal status (again after a ``requeue``);
* a job with a deadline that ends ``done`` gets ``met_deadline`` (its done event at or before its
  deadline), counted once by class in ``DEADLINE_STATS_KEY``.
The only way back is ``requeue`` (a dead worker's job, re-dispatched), which resets a job that is
not terminal and was not denoised yet to ``waiting`` and says so on its event stream: a
``waiting`` event with ``redelivered: true`` and the job's ``redeliveries`` count, so a client
knows why the status and the step went back.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from redis import Redis

from backend.config_operations import MIN_JOB_RECORD_S
from backend.metrics import job_latency_lua
from backend.protocol import JobEvent, JobRecord, event_fields, event_payload, to_text
from backend.protocol.keys import (
    DEADLINE_STATS_KEY,
    UNSTARTED_KEY,
    job_events_key,
    job_key,
)
from backend.protocol.records import (
    DERIVED_TIMINGS,
    REACHED_SUFFIX,
    STAGE_TIMINGS,
    TERMINAL,
    TIMING_PREFIX,
    TOTAL_TIMING,
)

__all__ = [
    "EXHAUSTED",
    "NOTHING_TO_REDO",
    "REQUEUED",
    "TERMINAL",
    "JobNotFound",
    "JobStateStore",
    "UnstartedJob",
    "deadline_counts",
]
_RANK = {
    "queued": 0,
    "preprocessing": 1,
    "waiting": 2,
    "running": 3,
    "postprocessing": 4,
    "done": 5,
    "failed": 5,
    "cancelled": 5,
}
_RANK_JSON = json.dumps(_RANK)
EVENTS_MAXLEN = 1000
JOB_TTL_S = MIN_JOB_RECORD_S  # the default; services pass ``settings.retention.job_record_s``
# When a job moves past ``running`` its live previews (``records.event_payload``: the last key of
# a running event, a data URL) are stale: every event of the stream is kept, under its own id, with
# the preview cut out. A job's stream holds previews only while it runs, so a finished job's
# stream stays small however long it is kept.
_STRIP_PREVIEWS = """
if new_rank > ranks['running'] and current_rank <= ranks['running'] then
  local entries, kept, cut = redis.call('XRANGE', KEYS[2], '-', '+'), {}, 0
  for _, entry in ipairs(entries) do
    local text, n = string.gsub(entry[2][2], ', "preview": "[^"]*"', '')
    cut = cut + n
    kept[#kept + 1] = {entry[1], text}
  end
  if cut > 0 then
    redis.call('DEL', KEYS[2])
    for _, entry in ipairs(kept) do redis.call('XADD', KEYS[2], entry[1], 'event', entry[2]) end
  end
end
"""


def worker_fence(job_hash: str, worker: str) -> str:
    """Lua that returns 0 (drops the write) when the worker named by the expression ``worker``
    no longer holds the job whose hash is ``job_hash``: the record names another worker, or none
    after ``requeue`` took it away (a redelivered job with no worker yet). A write naming no
    worker ('') and a job never routed (no ``worker_id``) pass."""
    return f"""
local owner = redis.call('HGET', {job_hash}, 'worker_id')
if {worker} ~= '' and owner then
  if owner ~= '' and owner ~= {worker} then return 0 end
  if owner == '' and tonumber(redis.call('HGET', {job_hash}, 'redeliveries') or '0') > 0 then
    return 0
  end
end
"""


# A failed or cancelled job's timings (``records.DERIVED_TIMINGS``), set when its terminal event
# is applied: each status it reached (``<status>_at``) lasts until the next one it reached or the
# end, named by ``records.STAGE_TIMINGS``; ``total_s`` runs from its creation. A timing the event
# (or an earlier one) set is kept. The event in the stream carries the job's timings.
_DERIVE_TIMINGS = f"""
if {" or ".join(f"ARGV[2] == '{status}'" for status in DERIVED_TIMINGS)} then
  local stages = cjson.decode('{json.dumps(STAGE_TIMINGS)}')
  local finished = tonumber(redis.call('HGET', KEYS[1], 'updated_at'))
  local ends = finished
  for i = #stages, 1, -1 do
    local since = tonumber(redis.call('HGET', KEYS[1], stages[i][1] .. '{REACHED_SUFFIX}') or '')
    if since then
      redis.call('HSETNX', KEYS[1], '{TIMING_PREFIX}' .. stages[i][2],
                 string.format('%.6f', math.max(0, ends - since)))
      ends = since
    end
  end
  local created = tonumber(redis.call('HGET', KEYS[1], 'created_at') or '')
  if created and created > 0 then
    redis.call('HSETNX', KEYS[1], '{TIMING_PREFIX}{TOTAL_TIMING}',
               string.format('%.6f', math.max(0, finished - created)))
  end
  local timings, fields = {{}}, redis.call('HGETALL', KEYS[1])
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, {len(TIMING_PREFIX)}) == '{TIMING_PREFIX}' then
      timings[string.sub(fields[i], {len(TIMING_PREFIX) + 1})] = tonumber(fields[i + 1])
    end
  end
  event = string.sub(event, 1, -2) .. ', "timings": ' .. cjson.encode(timings) .. '}}'
end
"""

# Accepted jobs not running yet, over the deployment (a sorted set: job id by deadline, +inf for
# none): a job enters it when created (and again when ``requeue`` sends it back to ``waiting``) and
# leaves it when it reaches ``running`` or a terminal status. The API's admission control counts
# it (``DeadlineSettings.max_queue``) and reads the earliest deadlines for its forecast.
UNSTARTED_READ = 512  # the earliest deadlines ``unstarted`` reads (the forecast's unplaced jobs)
# Leaving the unstarted set at ``running`` (or beyond); a job with a deadline that ends ``done``
# records ``met_deadline`` (its result stored at or before its deadline) and is counted by class.
# Part of the script that applies the status: a terminal status is applied once per job.
_SERVICE_LEVEL = f"""
if new_rank >= ranks['running'] then redis.call('ZREM', KEYS[3], ARGV[8]) end
if ARGV[2] == 'done' then
  local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline') or '')
  if deadline and deadline > 0 then
    local ended = tonumber(redis.call('HGET', KEYS[1], 'updated_at') or '') or 0
    local met = 0
    if ended <= deadline then met = 1 end
    redis.call('HSET', KEYS[1], 'met_deadline', met)
    local class = redis.call('HGET', KEYS[1], 'service_class') or 'batch'
    redis.call('HINCRBY', '{DEADLINE_STATS_KEY}', class .. '|' .. met, 1)
  end
end
"""

# KEYS[1] hash, KEYS[2] events stream, KEYS[3] the unstarted set. ARGV: new rank, status, event
# json, maxlen, ttl, ranks, the sending worker ('' when not a worker), the job id, then field/value
# pairs to set. Returns 1 when applied,
# 0 when dropped.
_APPLY = (
    """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
"""
    + worker_fence("KEYS[1]", "ARGV[7]")
    + """
local ranks = cjson.decode(ARGV[6])
local current_rank = ranks[current]
local new_rank = tonumber(ARGV[1])
if current_rank >= 5 or new_rank < current_rank then return 0 end
"""
    + _STRIP_PREVIEWS
    + """
if ARGV[2] ~= current then redis.call('HSET', KEYS[1], 'message', '') end
for i = 9, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if redis.call('HEXISTS', KEYS[1], ARGV[2] .. '_at') == 0 then
  redis.call('HSET', KEYS[1], ARGV[2] .. '_at', redis.call('HGET', KEYS[1], 'updated_at'))
end
"""
    + _SERVICE_LEVEL
    + """
local event = ARGV[3]
"""
    + _DERIVE_TIMINGS
    + """
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'event', event)
if new_rank >= 5 and tonumber(ARGV[5]) > 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('EXPIRE', KEYS[2], ARGV[5])
end
"""
    + job_latency_lua("KEYS[1]", "ARGV[2]", terminal="new_rank >= 5")  # once per job
    + """
return 1
"""
)


_ASSIGN = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'done' or status == 'failed' or status == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], 'worker_id', ARGV[1], 'message', ARGV[2])
return 1
"""
# KEYS: hash, the unstarted set, the events stream. ARGV: message, now, max redeliveries, job id,
# the redelivered event's JSON (its ``redeliveries`` added here), stream maxlen. 1: requeued; 0:
# finished or denoised (nothing to redo); -1: the bound is reached (the caller fails the job).
_REQUEUE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'done' or status == 'failed' or status == 'cancelled'
   or status == 'postprocessing' then return 0 end
if tonumber(redis.call('HGET', KEYS[1], 'denoised') or '0') > 0 then return 0 end
if tonumber(redis.call('HGET', KEYS[1], 'redeliveries') or '0') >= tonumber(ARGV[3]) then
  return -1
end
local count = redis.call('HINCRBY', KEYS[1], 'redeliveries', 1)
redis.call('HSET', KEYS[1], 'status', 'waiting', 'step', 0, 'message', ARGV[1],
           'updated_at', ARGV[2], 'worker_id', '')
local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline') or '') or 0
if deadline > 0 then redis.call('ZADD', KEYS[2], deadline, ARGV[4])
else redis.call('ZADD', KEYS[2], '+inf', ARGV[4]) end
local event = string.sub(ARGV[5], 1, -2) .. ', "redeliveries": ' .. count .. '}'
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'event', event)
return 1
"""
REQUEUED, NOTHING_TO_REDO, EXHAUSTED = 1, 0, -1


@dataclass(frozen=True)
class UnstartedJob:
    """An accepted job that is not running yet, as admission control reads it."""

    job_id: str
    model_id: str
    status: str
    deadline: float  # 0: none
    priority: int
    steps: int  # its denoising steps (``num_steps`` once pre-processed, else those asked for)
    worker_id: str


class JobNotFound(KeyError):
    """No job with this id (never created, or expired)."""


class JobStateStore:
    def __init__(self, client: Redis, ttl_s: int = JOB_TTL_S):
        """``ttl_s``: a finished job's record and events expire that long after it finished (0:
        never)."""
        if ttl_s < 0:
            raise ValueError(
                f"job record ttl must be >= 0 s (0 keeps records forever), got {ttl_s}"
            )
        self.ttl_s = int(ttl_s)
        self.client = client
        self._apply = client.register_script(_APPLY)
        # scripts, not WATCH/MULTI: a worker's events change the same hash at any moment
        self._assign = client.register_script(_ASSIGN)
        self._requeue = client.register_script(_REQUEUE)

    def create(self, job_id: str, **fields) -> None:
        """Record a new job as ``queued``; ``fields`` are ``JobRecord`` fields (a name it does not
        have raises ``TypeError``). Creating an existing job again is a no-op (idempotent
        submission)."""
        record = JobRecord(job_id=job_id, created_at=time.time(), **fields)
        if self.client.hsetnx(job_key(job_id), "status", "queued"):
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(job_key(job_id), mapping=record.creation_fields())
                pipe.zadd(UNSTARTED_KEY, {job_id: record.deadline or math.inf})
                pipe.execute()

    def record_event(self, event: JobEvent) -> bool:
        """Apply one event (see the module invariants); True when it changed the job."""
        return bool(self._apply(keys=self._keys(event.job_id), args=self._argv(event)))

    def record_events(self, events: list[JobEvent]) -> list[bool]:
        """Apply several events in one round trip (a worker's progress events of one step)."""
        with self.client.pipeline(transaction=False) as pipe:
            for event in events:
                self._apply(keys=self._keys(event.job_id), args=self._argv(event), client=pipe)
            return [bool(applied) for applied in pipe.execute()]

    @staticmethod
    def _keys(job_id: str) -> list[str]:
        return [job_key(job_id), job_events_key(job_id), UNSTARTED_KEY]

    def _argv(self, event: JobEvent) -> list:
        argv = [
            _RANK[event.status],
            event.status,
            json.dumps(event_payload(event)),
            EVENTS_MAXLEN,
            self.ttl_s,
            _RANK_JSON,
            event.worker_id,
            event.job_id,
        ]
        for name, value in event_fields(event).items():
            argv += [name, value]
        return argv

    def assign(self, job_id: str, worker_id: str, message: str = "", client=None) -> bool:
        """Record the worker a job was routed to (cancels go to its inbox) and what it is doing
        (``message``, replacing an older one); False if the job is gone or finished. ``client``:
        a pipeline to run it in (the dispatcher writes the inbox entry in the same transaction)."""
        return bool(self._assign(keys=[job_key(job_id)], args=[worker_id, message], client=client))

    def requeue(self, job_id: str, message: str, max_redeliveries: int) -> int:
        """A job its worker had not finished goes back to ``waiting`` with no worker (the worker
        died), counted in ``redeliveries``: ``REQUEUED``; ``NOTHING_TO_REDO`` if it had finished
        or was denoised already (its result is on the way); ``EXHAUSTED`` when it was redelivered
        ``max_redeliveries`` times already (the caller fails it). The way back is said on the
        job's events: a ``waiting`` event with ``redelivered: true``, the message and the count."""
        now = time.time()
        event = event_payload(JobEvent(job_id=job_id, status="waiting", at=now, message=message))
        reply = self._requeue(
            keys=[job_key(job_id), UNSTARTED_KEY, job_events_key(job_id)],
            args=[
                message,
                now,
                max_redeliveries,
                job_id,
                json.dumps(event | {"redelivered": True}),
                EVENTS_MAXLEN,
            ],
        )
        return int(reply)

    def redelivered(self, job_id: str) -> int:
        """Count one more delivery of the job after a lost worker; the count now (0: no such
        job)."""
        if not self.client.exists(job_key(job_id)):
            return 0
        return int(self.client.hincrby(job_key(job_id), "redeliveries", 1))

    def fail(self, job_id: str, message: str, **fields) -> bool:
        """End the job ``failed`` saying why (False when it had finished already)."""
        return self.record_event(
            JobEvent(job_id=job_id, status="failed", at=time.time(), message=message, **fields)
        )

    def record(self, job_id: str) -> JobRecord:
        """The job's typed record; raises ``JobNotFound``."""
        raw = self.client.hgetall(job_key(job_id))
        if not raw:
            raise JobNotFound(job_id)
        return JobRecord.from_hash(job_id, raw)

    def get(self, job_id: str) -> dict:
        """The job's record as the API shows it (``JobRecord.as_dict``); raises ``JobNotFound``."""
        return self.record(job_id).as_dict()

    def statuses(self, job_ids: list[str]) -> dict[str, tuple[str | None, float | None]]:
        """Job id -> (status, when it was done) in one round trip: (None, None) for a job that is
        gone, a None time for one not done."""
        with self.client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(job_key(job_id), "status", "done" + REACHED_SUFFIX)
            replies = pipe.execute()
        return {
            job_id: (
                None if status is None else to_text(status),
                None if done_at is None else float(to_text(done_at)),
            )
            for job_id, (status, done_at) in zip(job_ids, replies)
        }

    def status(self, job_id: str) -> str | None:
        value = self.client.hget(job_key(job_id), "status")
        return None if value is None else to_text(value)

    def events(
        self, job_id: str, after: str = "0", block_ms: int | None = None
    ) -> list[tuple[str, dict]]:
        """(stream id, event dict) after ``after``; waits up to ``block_ms`` for the first."""
        reply = self.client.xread({job_events_key(job_id): after}, block=block_ms)
        entries = reply[0][1] if reply else []
        return [
            (to_text(entry_id), json.loads(to_text(fields.get(b"event") or fields.get("event"))))
            for entry_id, fields in entries
        ]

    def unstarted(self, limit: int = UNSTARTED_READ) -> tuple[int, list[UnstartedJob]]:
        """(how many jobs are accepted and not running yet, over the deployment; the ``limit`` of
        them with the earliest deadlines). An entry whose job is gone or running is dropped from
        the set as it is met (the set heals itself)."""
        count = int(self.client.zcard(UNSTARTED_KEY))
        entries = self.client.zrange(UNSTARTED_KEY, 0, max(0, limit) - 1, withscores=True)
        fields = ("status", "model_id", "num_steps", "steps", "priority", "worker_id")
        with self.client.pipeline(transaction=False) as pipe:
            for member, _ in entries:
                pipe.hmget(job_key(to_text(member)), fields)
            replies = pipe.execute()
        jobs, gone = [], []
        for (member, deadline), values in zip(entries, replies):
            job_id = to_text(member)
            status, model_id, num_steps, steps, priority, worker_id = (
                to_text(v) if v is not None else "" for v in values
            )
            if _RANK.get(status, 99) >= _RANK["running"]:
                gone.append(job_id)
                continue
            jobs.append(
                UnstartedJob(
                    job_id=job_id,
                    model_id=model_id,
                    status=status,
                    deadline=0.0 if math.isinf(deadline) else float(deadline),
                    priority=int(float(priority or 0)),
                    steps=int(float(num_steps or 0)) or int(float(steps or 0)),
                    worker_id=worker_id,
                )
            )
        if gone:
            self.client.zrem(UNSTARTED_KEY, *gone)
        return count - len(gone), jobs


def deadline_counts(client: Redis) -> dict[tuple[str, bool], int]:
    """(service class, met) -> done jobs with a deadline, over the deployment, from Redis."""
    counts: dict[tuple[str, bool], int] = {}
    for name, value in client.hgetall(DEADLINE_STATS_KEY).items():
        service_class, _, met = to_text(name).rpartition("|")
        if service_class and met in ("0", "1"):
            counts[(service_class, met == "1")] = int(to_text(value))
    return counts

"""Job state in Redis: one hash per job plus a stream of its events.

Keys: ``maskserve:job:<id>`` (hash) and ``maskserve:job:<id>:events`` (stream, capped).

Hash fields: ``status``, ``created_at``, ``updated_at``, ``<status>_at`` (first time each status
was reached), ``step``, ``num_steps``, ``worker_id``, ``message``, ``result_ref``,
``thumbnail_ref``, ``timing.<stage>`` (seconds), plus whatever ``create`` was given (model,
prompt, seed, ...).

Invariants (enforced atomically by one Lua script, so racing writers from different processes
cannot break them):
* status only moves forward: queued < preprocessing < waiting < running < postprocessing <
  terminal; a late event of an earlier stage is dropped (a step event arriving after ``done``
  does not resurrect the job);
* a terminal status (done, failed, cancelled) is final: the first one wins, so a job completes at
  most once even when a task is delivered twice;
* an event for a job that was never created is dropped (no half-made jobs).
The only way back is ``requeue`` (a dead worker's job, re-dispatched), which resets a
non-terminal job to ``waiting``.
"""

from __future__ import annotations

import json
import time

from redis import Redis

from backend.config import MIN_JOB_RECORD_S
from backend.protocol import JobEvent

TERMINAL = ("done", "failed", "cancelled")
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

# KEYS[1] hash, KEYS[2] events stream. ARGV: new rank, status, event json, maxlen, ttl,
# then field/value pairs to set. Returns 1 when applied, 0 when dropped.
_APPLY = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
local ranks = cjson.decode(ARGV[6])
local current_rank = ranks[current]
local new_rank = tonumber(ARGV[1])
if current_rank >= 5 or new_rank < current_rank then return 0 end
for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if redis.call('HEXISTS', KEYS[1], ARGV[2] .. '_at') == 0 then
  redis.call('HSET', KEYS[1], ARGV[2] .. '_at', redis.call('HGET', KEYS[1], 'updated_at'))
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'event', ARGV[3])
if new_rank >= 5 and tonumber(ARGV[5]) > 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('EXPIRE', KEYS[2], ARGV[5])
end
return 1
"""


_ASSIGN = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'done' or status == 'failed' or status == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], 'worker_id', ARGV[1])
return 1
"""
_REQUEUE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'done' or status == 'failed' or status == 'cancelled'
   or status == 'postprocessing' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'waiting', 'step', 0, 'message', ARGV[1], 'updated_at', ARGV[2])
return 1
"""


class JobNotFound(KeyError):
    """No job with this id (never created, or expired)."""


def job_key(job_id: str) -> str:
    return f"maskserve:job:{job_id}"


def events_key(job_id: str) -> str:
    return f"maskserve:job:{job_id}:events"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class JobStateStore:
    def __init__(self, client: Redis, ttl_s: int = JOB_TTL_S):
        """``ttl_s``: a finished job's record and events expire that long after it finished (0: never)."""
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
        """Record a new job as ``queued``; fields are stored as strings (JSON for dicts and lists).
        Creating an existing job again is a no-op (idempotent submission)."""
        now = time.time()
        values = {
            "status": "queued",
            "created_at": now,
            "updated_at": now,
            "queued_at": now,
            "step": 0,
        }
        values |= {
            k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in fields.items()
        }
        if self.client.hsetnx(job_key(job_id), "status", "queued"):
            self.client.hset(job_key(job_id), mapping={k: str(v) for k, v in values.items()})

    def record_event(self, event: JobEvent) -> bool:
        """Apply one event (see the module invariants); True when it changed the job."""
        return bool(
            self._apply(
                keys=[job_key(event.job_id), events_key(event.job_id)], args=self._argv(event)
            )
        )

    def record_events(self, events: list[JobEvent]) -> list[bool]:
        """Apply several events in one round trip (a worker's progress events of one step)."""
        with self.client.pipeline(transaction=False) as pipe:
            for event in events:
                self._apply(
                    keys=[job_key(event.job_id), events_key(event.job_id)],
                    args=self._argv(event),
                    client=pipe,
                )
            return [bool(applied) for applied in pipe.execute()]

    def _argv(self, event: JobEvent) -> list:
        fields = {"status": event.status, "updated_at": event.at}
        if event.num_steps:
            fields |= {"step": event.step, "num_steps": event.num_steps}
        for name in ("worker_id", "message", "result_ref", "thumbnail_ref"):
            if getattr(event, name):
                fields[name] = getattr(event, name)
        fields |= {f"timing.{stage}": seconds for stage, seconds in event.timings.items()}
        argv = [
            _RANK[event.status],
            event.status,
            json.dumps(_event_dict(event)),
            EVENTS_MAXLEN,
            self.ttl_s,
            _RANK_JSON,
        ]
        for name, value in fields.items():
            argv += [name, str(value)]
        return argv

    def assign(self, job_id: str, worker_id: str) -> bool:
        """Record the worker a job was routed to (cancels go to its inbox); False if the job is gone
        or finished."""
        return bool(self._assign(keys=[job_key(job_id)], args=[worker_id]))

    def requeue(self, job_id: str, message: str) -> bool:
        """A job its worker had not finished goes back to ``waiting`` (the worker died); False if it
        had finished or already reached post-processing (its result is on the way)."""
        return bool(self._requeue(keys=[job_key(job_id)], args=[message, time.time()]))

    def get(self, job_id: str) -> dict:
        """The job's fields, typed: numbers as float/int, ``timings`` gathered into a dict."""
        raw = self.client.hgetall(job_key(job_id))
        if not raw:
            raise JobNotFound(job_id)
        job, timings = {"job_id": job_id}, {}
        for key, value in ((_text(k), _text(v)) for k, v in raw.items()):
            if key.startswith("timing."):
                timings[key.removeprefix("timing.")] = float(value)
            elif key in ("step", "num_steps", "seed"):
                job[key] = int(value)
            elif key.endswith("_at"):
                job[key] = float(value)
            else:
                job[key] = value
        job["timings"] = timings
        return job

    def status(self, job_id: str) -> str | None:
        value = self.client.hget(job_key(job_id), "status")
        return None if value is None else _text(value)

    def events(
        self, job_id: str, after: str = "0", block_ms: int | None = None
    ) -> list[tuple[str, dict]]:
        """(stream id, event dict) after ``after``; waits up to ``block_ms`` for the first."""
        reply = self.client.xread({events_key(job_id): after}, block=block_ms)
        entries = reply[0][1] if reply else []
        return [
            (_text(entry_id), json.loads(_text(fields.get(b"event") or fields.get("event"))))
            for entry_id, fields in entries
        ]


def _event_dict(event: JobEvent) -> dict:
    keep = {"status": event.status, "at": event.at}
    for name in ("step", "num_steps", "worker_id", "message", "result_ref", "thumbnail_ref"):
        if getattr(event, name):
            keep[name] = getattr(event, name)
    if event.timings:
        keep["timings"] = event.timings
    return keep

"""Reading workers' heartbeats: the one reader every role uses (dispatcher, API, cache status).

A worker writes its ``WorkerHeartbeat`` under ``keys.heartbeat_key`` with a short TTL; a worker
whose key expired is presumed dead. The client is any Redis client (duck-typed: ``scan_iter``,
``mget``, ``get``), so this module imports no Redis library.
"""

from __future__ import annotations

import logging
from typing import Any

from backend.protocol import keys
from backend.protocol.messages import ProtocolError, WorkerHeartbeat, decode

log = logging.getLogger(__name__)


def _heartbeat(raw: bytes | str | None) -> WorkerHeartbeat | None:
    if raw is None:
        return None  # expired between listing and reading
    try:
        beat = decode(raw)
    except ProtocolError as exc:
        log.warning("ignoring an unreadable heartbeat: %s", exc)
        return None
    return beat if isinstance(beat, WorkerHeartbeat) else None


def live_heartbeats(client: Any) -> dict[str, WorkerHeartbeat]:
    """Worker id -> its latest heartbeat, for every worker whose heartbeat has not expired."""
    names = list(client.scan_iter(match=keys.HEARTBEAT_PATTERN, count=500))
    beats = (_heartbeat(raw) for raw in (client.mget(names) if names else []))
    return {beat.worker_id: beat for beat in beats if beat is not None}


def read_heartbeat(client: Any, worker_id: str) -> WorkerHeartbeat | None:
    """One worker's latest heartbeat; None when it expired or cannot be read."""
    return _heartbeat(client.get(keys.heartbeat_key(worker_id)))


def queue_position(beat: WorkerHeartbeat | None, job_id: str) -> int | None:
    """1 = next to join the worker's running batch; None when the heartbeat does not list the job
    as waiting (it is on its way to the worker, or already running)."""
    waiting = [row.job_id for row in beat.waiting] if beat else []
    return waiting.index(job_id) + 1 if job_id in waiting else None

"""A worker's inbox as a Redis stream read through a consumer group.

Stream ``maskserve:inbox:<worker_id>``, group ``workers``. A message stays pending until the job
leaves the worker (``ack``), so a worker that dies mid-job leaves its jobs pending for the
dispatcher to reclaim (XAUTOCLAIM) and a restarted worker first re-reads its own pending entries.
Every entry holds one field ``msg``: a ``backend.protocol`` message as JSON.
"""

from __future__ import annotations

import logging

from redis import Redis
from redis.exceptions import ResponseError

from backend import protocol
from backend.protocol import CancelJob, EditJob, PreparedJob

log = logging.getLogger(__name__)

GROUP = "workers"
INBOX_MAXLEN = 100_000
INBOX_TYPES = (
    PreparedJob,
    EditJob,
    CancelJob,
)  # what a worker's inbox carries; anything else is dropped


def inbox_stream(worker_id: str) -> str:
    return f"maskserve:inbox:{worker_id}"


def send_to_inbox(client: Redis, worker_id: str, message) -> str:
    """Append ``message`` to a worker's inbox; returns the stream entry id."""
    entry = client.xadd(
        inbox_stream(worker_id),
        {"msg": protocol.encode(message)},
        maxlen=INBOX_MAXLEN,
        approximate=True,
    )
    return entry.decode() if isinstance(entry, bytes) else entry


class RedisInbox:
    def __init__(self, client: Redis, worker_id: str, batch: int = 64):
        self.client, self.worker_id, self.batch = client, worker_id, batch
        self.stream = inbox_stream(worker_id)
        self._entries: dict[str, list[str]] = {}  # job id -> stream entry ids not yet acked
        self._replay_from: str | None = "0"  # after a restart, our own unacked entries come first
        self._create_group()

    def _create_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def poll(self, timeout_s: float) -> list:
        replaying = self._replay_from is not None
        start_id = self._replay_from if replaying else ">"
        block = None if replaying or timeout_s <= 0 else max(1, int(timeout_s * 1000))
        try:
            reply = self.client.xreadgroup(
                GROUP, self.worker_id, {self.stream: start_id}, count=self.batch, block=block
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # the dispatcher took this inbox for a dead worker's and re-dispatched its jobs: start afresh
            log.warning("inbox %s was removed (presumed dead); recreating it", self.stream)
            self._create_group()
            return []
        entries = reply[0][1] if reply else []
        if replaying:  # pending entries are re-read from an id, not consumed: walk past them once
            self._replay_from = entries[-1][0] if len(entries) == self.batch else None
        return [
            m
            for m in (self._read(entry_id, fields) for entry_id, fields in entries)
            if m is not None
        ]

    def _read(self, entry_id, fields):
        entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        fields = (
            fields or {}
        )  # a pending entry deleted (XDEL, MAXLEN trim) since it was delivered has none
        raw = fields.get(b"msg") or fields.get("msg")
        try:
            if raw is None:
                raise protocol.ProtocolError("no 'msg' field (deleted, or not a MaskServe message)")
            message = protocol.decode(
                raw
            )  # TypeError too: protocol.from_dict lets a bad nested field through
            if not isinstance(message, INBOX_TYPES):
                raise protocol.ProtocolError(
                    f"a {message.TYPE} message does not belong in a worker's inbox"
                )
        except (
            ValueError,
            TypeError,
        ) as exc:  # unreadable: drop it, or it would be redelivered forever
            log.error("dropping unreadable inbox entry %s: %s", entry_id, exc)
            self.client.xack(self.stream, GROUP, entry_id)
            return None
        if isinstance(message, CancelJob):
            self.client.xack(self.stream, GROUP, entry_id)
        else:
            self._entries.setdefault(message.job_id, []).append(entry_id)
        return message

    def ack(self, job_id: str) -> None:
        entry_ids = self._entries.pop(job_id, [])
        if entry_ids:
            self.client.xack(self.stream, GROUP, *entry_ids)

    def pending(self) -> int:
        return int(self.client.xpending(self.stream, GROUP)["pending"])

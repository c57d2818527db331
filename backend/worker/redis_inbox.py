"""A worker's inbox as a Redis stream read through a consumer group.

Stream ``keys.inbox_stream(worker_id)``, group ``keys.INBOX_GROUP``. A message stays pending until
the job
leaves the worker (``ack``), so a worker that dies mid-job leaves its jobs pending for the
dispatcher to reclaim (XAUTOCLAIM) and a restarted worker first re-reads its own pending entries.
Every entry holds one encoded ``backend.protocol`` message (``protocol.entry_message``). An entry
that cannot be decoded is acked and, when it names its job, ``on_unreadable`` fails that job.
"""

from __future__ import annotations

import logging

from redis import Redis
from redis.exceptions import ResponseError

from backend import protocol
from backend.protocol import CancelJob, EditJob, PreparedJob, entry_fields, entry_message, to_text
from backend.protocol.keys import INBOX_GROUP, inbox_stream

log = logging.getLogger(__name__)

INBOX_MAXLEN = 100_000
# what a worker's inbox carries; anything else is dropped
INBOX_TYPES = (PreparedJob, EditJob, CancelJob)


def send_to_inbox(client: Redis, worker_id: str, message) -> str:
    """Append ``message`` to a worker's inbox; returns the stream entry id."""
    entry = client.xadd(
        inbox_stream(worker_id),
        entry_fields(protocol.encode(message)),
        maxlen=INBOX_MAXLEN,
        approximate=True,
    )
    return to_text(entry)


class RedisInbox:
    def __init__(self, client: Redis, worker_id: str, batch: int = 64, on_unreadable=None):
        """``on_unreadable(job_id, reason)``: called for an entry that cannot be decoded but names
        its job (the worker service fails that job); such entries are acked either way."""
        self.client, self.worker_id, self.batch = client, worker_id, batch
        self.on_unreadable = on_unreadable
        self.stream = inbox_stream(worker_id)
        self._entries: dict[str, list[str]] = {}  # job id -> stream entry ids not yet acked
        self._replay_from: str | None = "0"  # after a restart, our own unacked entries come first
        self._create_group()

    def _create_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, INBOX_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def poll(self, timeout_s: float) -> list:
        """Our own unacked entries first (after a restart), then new ones; waits up to
        ``timeout_s`` for new ones only once the replay is done."""
        if self._replay_from is not None:
            entries = self._xread(self._replay_from, block=None)
            # pending entries are re-read from an id, not consumed: walk past them once
            self._replay_from = to_text(entries[-1][0]) if len(entries) == self.batch else None
            if entries or self._replay_from is not None:
                return self._messages(entries)
        block = max(1, int(timeout_s * 1000)) if timeout_s > 0 else None
        return self._messages(self._xread(">", block))

    def _xread(self, start_id: str, block: int | None) -> list:
        try:
            reply = self.client.xreadgroup(
                INBOX_GROUP, self.worker_id, {self.stream: start_id}, count=self.batch, block=block
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # the dispatcher took this inbox for a dead worker's and re-dispatched its jobs
            log.warning("inbox %s was removed (presumed dead); recreating it", self.stream)
            self._create_group()
            return []
        return reply[0][1] if reply else []

    def _messages(self, entries: list) -> list:
        read = (self._read(entry_id, fields) for entry_id, fields in entries)
        return [message for message in read if message is not None]

    def _read(self, entry_id, fields):
        entry_id = to_text(entry_id)
        # a pending entry deleted (XDEL, MAXLEN trim) since it was delivered has no fields
        encoded = entry_message(fields)
        try:
            if not encoded:
                raise protocol.ProtocolError("no message (deleted, or not a MaskServe message)")
            message = protocol.decode(encoded)
            if not isinstance(message, INBOX_TYPES):
                raise protocol.ProtocolError(
                    f"a {message.TYPE} message does not belong in a worker's inbox"
                )
        except protocol.ProtocolError as exc:  # drop it, or it would be redelivered forever
            self._drop_unreadable(entry_id, encoded, exc)
            return None
        if isinstance(message, CancelJob):
            self.client.xack(self.stream, INBOX_GROUP, entry_id)
        else:
            self._entries.setdefault(message.job_id, []).append(entry_id)
        return message

    def _drop_unreadable(self, entry_id: str, encoded, error: Exception) -> None:
        job_id = protocol.job_id_of(encoded) if encoded else None
        log.error("dropping unreadable inbox entry %s (job %s): %s", entry_id, job_id, error)
        self.client.xack(self.stream, INBOX_GROUP, entry_id)
        if job_id and self.on_unreadable is not None:
            self.on_unreadable(job_id, f"the worker could not read this job ({error})")

    def ack(self, job_id: str) -> None:
        entry_ids = self._entries.pop(job_id, [])
        if entry_ids:
            self.client.xack(self.stream, INBOX_GROUP, *entry_ids)

    def pending(self) -> int:
        return int(self.client.xpending(self.stream, INBOX_GROUP)["pending"])

"""A worker's inbox as a Redis stream read through a consumer group.

Stream ``keys.inbox_stream(worker_id)``, group ``keys.INBOX_GROUP``. A message stays pending until
the job
leaves the worker (``ack``), so a worker that dies mid-job leaves its jobs pending for the
dispatcher to reclaim (XAUTOCLAIM) and a restarted worker first re-reads its own pending entries.
Every entry holds one encoded ``backend.protocol`` message (``protocol.entry_message``). An entry
that cannot be decoded is acked and, when it names its job, ``fail_job`` fails that job.

Idempotent delivery: a job entry is checked against the job record as it is read. A job already
denoised (``denoised`` > 0), in post-processing or finished is acked and dropped: it is never
denoised again. An entry re-read after a restart (ours, still pending) counts one redelivery of its
job; past ``max_redeliveries`` the job fails instead of crashing this worker again. A second entry
of a job this worker holds is passed on, and the loop drops it (its id is acked with the job's).
"""

from __future__ import annotations

import logging

from redis import Redis
from redis.exceptions import ResponseError

from backend import protocol
from backend.protocol import CancelJob, EditJob, PreparedJob, entry_fields, entry_message, to_text
from backend.protocol.keys import INBOX_GROUP, inbox_stream, job_key
from backend.protocol.records import TERMINAL

log = logging.getLogger(__name__)

INBOX_MAXLEN = 100_000
# what a worker's inbox carries; anything else is dropped
INBOX_TYPES = (PreparedJob, EditJob, CancelJob)


def send_to_inbox(client: Redis, worker_id: str, message) -> str:
    """Append ``message`` to a worker's inbox; returns the stream entry id."""
    return to_text(queue_to_inbox(client, worker_id, message))


def queue_to_inbox(client, worker_id: str, message):
    """Append ``message`` to a worker's inbox through ``client`` (a pipeline: its ``execute``
    answers the entry id)."""
    return client.xadd(
        inbox_stream(worker_id),
        entry_fields(protocol.encode(message)),
        maxlen=INBOX_MAXLEN,
        approximate=True,
    )


class RedisInbox:
    def __init__(
        self,
        client: Redis,
        worker_id: str,
        batch: int = 64,
        fail_job=None,
        max_redeliveries: int | None = None,
    ):
        """``fail_job(job_id, reason)``: called for an entry that cannot be decoded but names its
        job, or whose job was redelivered more than ``max_redeliveries`` times (None: no bound);
        such entries are acked either way."""
        self.client, self.worker_id, self.batch = client, worker_id, batch
        self.fail_job, self.max_redeliveries = fail_job, max_redeliveries
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
                return self._messages(entries, replayed=True)
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

    def _messages(self, entries: list, replayed: bool = False) -> list:
        read = (self._read(entry_id, fields, replayed) for entry_id, fields in entries)
        return [message for message in read if message is not None]

    def _read(self, entry_id, fields, replayed: bool):
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
            return message
        if entry_id in self._entries.get(message.job_id, ()):
            return None  # re-read after a Redis outage: the loop holds it already (no redelivery)
        if not self._deliverable(message.job_id, entry_id, replayed):
            self.client.xack(self.stream, INBOX_GROUP, entry_id)
            return None
        self._entries.setdefault(message.job_id, []).append(entry_id)
        return message

    def _deliverable(self, job_id: str, entry_id: str, replayed: bool) -> bool:
        """Should this job entry reach the loop? No when its job is past denoising (a duplicate)
        or its redeliveries ran out (it failed here). A job without a record (tests feeding the
        inbox directly) is delivered."""
        status, denoised = self.client.hmget(job_key(job_id), "status", "denoised")
        status = None if status is None else to_text(status)
        if status in (*TERMINAL, "postprocessing") or int(to_text(denoised or b"0")) > 0:
            log.warning("dropping entry %s: job %s is %s, past denoising", entry_id, job_id, status)
            return False
        if replayed and status is not None and self.max_redeliveries is not None:
            count = int(self.client.hincrby(job_key(job_id), "redeliveries", 1))
            if count > self.max_redeliveries:
                log.error("job %s redelivered %d times: failing it", job_id, count)
                if self.fail_job is not None:
                    self.fail_job(job_id, f"the job stopped its worker {count} times; giving up")
                return False
        return True

    def _drop_unreadable(self, entry_id: str, encoded, error: Exception) -> None:
        job_id = protocol.job_id_of(encoded) if encoded else None
        log.error("dropping unreadable inbox entry %s (job %s): %s", entry_id, job_id, error)
        self.client.xack(self.stream, INBOX_GROUP, entry_id)
        if job_id and self.fail_job is not None:
            self.fail_job(job_id, f"the worker could not read this job ({error})")

    def ack(self, job_id: str) -> None:
        entry_ids = self._entries.pop(job_id, [])
        if entry_ids:
            self.client.xack(self.stream, INBOX_GROUP, *entry_ids)

    def replay(self) -> None:
        """Re-read our own unacked entries at the next poll (after Redis was away: a read whose
        reply was lost left its entries pending here)."""
        self._replay_from = "0"

    def pending(self) -> int:
        return int(self.client.xpending(self.stream, INBOX_GROUP)["pending"])

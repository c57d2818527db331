"""How an engine worker talks to the rest of the system: an inbox it reads and a sink it reports to.

Two implementations of each: in-process (tests and the worker benchmark, messages still go through
the wire format so nothing the Redis path can't carry slips through) and Redis (the service).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from backend import protocol
from backend.protocol import DenoisedJob, JobEvent


class Inbox(Protocol):
    def poll(self, timeout_s: float) -> list:
        """Messages that arrived (``PreparedJob``, ``EditJob`` in inline mode, ``CancelJob``); waits
        up to ``timeout_s`` for the first one, returns at once with what is there when ``timeout_s``
        is 0."""

    def ack(self, job_id: str) -> None:
        """The job left this worker (finished, failed or cancelled): do not redeliver it."""


class JobSink(Protocol):
    def event(self, event: JobEvent) -> None: ...

    def step_events(self, events: list[JobEvent]) -> None:
        """The progress events of one step, all rows at once (one round trip for the Redis sink)."""

    def denoised(self, job: DenoisedJob) -> None:
        """Hand a finished denoise to post-processing."""


class LocalInbox:
    """A thread-safe in-process inbox; ``put`` round-trips each message through the wire format."""

    def __init__(self):
        self._queue: queue.Queue[str] = queue.Queue()
        self.acked: list[str] = []

    def put(self, message) -> None:
        self._queue.put(protocol.encode(message))

    def poll(self, timeout_s: float) -> list:
        messages = []
        try:
            first = (
                self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
            )
        except queue.Empty:
            return messages
        messages.append(protocol.decode(first))
        while True:
            try:
                messages.append(protocol.decode(self._queue.get_nowait()))
            except queue.Empty:
                return messages

    def ack(self, job_id: str) -> None:
        self.acked.append(job_id)


@dataclass
class LocalSink:
    """Collects events and finished denoises; an optional callback lets a benchmark chain
    post-processing. Events are kept encoded (what a Redis sink pays per event) and decoded only
    when read."""

    on_denoised: Callable[[DenoisedJob], None] | None = None
    denoised_jobs: list[DenoisedJob] = field(default_factory=list)
    _encoded_events: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def events(self) -> list[JobEvent]:
        with self._lock:
            encoded = list(self._encoded_events)
        return [protocol.decode(text) for text in encoded]

    def event(self, event: JobEvent) -> None:
        text = protocol.encode(event)
        with self._lock:
            self._encoded_events.append(text)

    def step_events(self, events: list[JobEvent]) -> None:
        encoded = [protocol.encode(event) for event in events]
        with self._lock:
            self._encoded_events.extend(encoded)

    def denoised(self, job: DenoisedJob) -> None:
        job = protocol.decode(protocol.encode(job))
        with self._lock:
            self.denoised_jobs.append(job)
        if self.on_denoised:
            self.on_denoised(job)

    def statuses(self, job_id: str) -> list[str]:
        return [e.status for e in self.events if e.job_id == job_id]

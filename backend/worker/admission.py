"""Admission rules of one engine worker: which waiting row may join the running batch now.

Pure (no torch, no redis, no clock): the engine worker (``backend.worker.loop``) and the route
simulation's workers (``backend.bench.route_sim``) both decide with ``AdmissionRules``, through
``BatchScheduler.schedule(now, ready)``, over their template caches (a ``TieredActivationCache``,
or a ``CacheManager`` on simulated time) seen through ``CacheGate``.

Prefetch-gated admission (FlashPS's bubble-free serving), in the order ``admit`` applies it:

* a row that reads no template cache joins at once;
* a row whose template this worker is recording (a running row, or a row admitted earlier in the
  same schedule that will record it) waits for that recording's commit, which loads the new entry
  into RAM, rather than computing densely beside it; a prepare job joins, and ends at once;
* a row whose cache cannot be acquired without waiting (its disk -> RAM read is in flight, or RAM
  is full of entries in use so the read cannot start) waits: ``CacheGate.ready`` starts the read
  when it can;
* otherwise the row joins and acquires (pins) its entry at once, so a read started for a row
  behind it in the same schedule cannot evict it; a row that finds no entry records it when it
  may (``records_on_miss``), and claims the template so rows of it behind it wait.

A row that waits keeps its place in the queue while rows behind it take the free slots; the
running batch never stalls on a read. Where the cache prefetches on arrival, a prefetch never
evicts an entry prefetched for an earlier row not yet admitted (``CacheManager.plan_prefetch``).

Invariants: one template is recorded by at most one row of a worker at a time; ``admit`` returns
True for a row with a template only after ``CacheGate.acquire`` was called for it, exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    """A waiting row as admission sees it."""

    job_id: str
    template: str  # cache entry id of the row's template; "" when the row reads no cache
    records_on_miss: bool = True  # records the cache when it finds none (first edit or prepare)
    prepare: bool = False  # a prepare job: it only records, and ends at once when it need not


class CacheGate(Protocol):
    """A worker's template caches as admission asks them, per waiting row."""

    def ready(self, row: Candidate) -> bool:
        """``acquire(row)`` would return at once; may start the read that makes it so."""
        ...

    def acquire(self, row: Candidate) -> bool:
        """Acquire (pin) the row's entry now; True when there is none to read (a miss)."""
        ...


class AdmissionRules:
    """The admission state of one worker: the templates it records (module docstring)."""

    def __init__(self) -> None:
        self.recording: set[str] = set()  # templates a running row is recording
        self._claimed: set[str] = set()  # templates a row admitted in this schedule will record

    def start_schedule(self) -> None:
        """A new ``BatchScheduler.schedule``: claims of the last one became recordings or ended."""
        self._claimed.clear()

    def admit(self, row: Candidate, caches: CacheGate) -> bool:
        """May ``row`` join the batch now? Acquires its entry when it may (module docstring)."""
        if not row.template:
            return True
        if row.template in self.recording or row.template in self._claimed:
            return row.prepare  # a prepare job for it ends at once ("being recorded")
        if not caches.ready(row):
            return False
        if caches.acquire(row) and self.should_record(row):
            self._claimed.add(row.template)
        return True

    def should_record(self, row: Candidate, forced: bool = False) -> bool:
        """Whether ``row``, finding no entry, records its template: when it may (``forced`` for a
        prepare job), and never while a running row of this worker records it."""
        return (
            bool(row.template)
            and (forced or row.records_on_miss)
            and row.template not in self.recording
        )

    def start_recording(self, template: str) -> None:
        self.recording.add(template)

    def end_recording(self, template: str) -> None:
        """The recording was committed or abandoned; rows of the template may join again."""
        self.recording.discard(template)

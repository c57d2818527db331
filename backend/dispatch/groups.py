"""Batch affinity: the items of one batch (jobs with the same ``batch_id``) go to the worker its
first item went to, while that worker is a candidate. Pure Python over the router's views.

Why: the items of a batch edit one template with the same settings, so they read one template
cache. On one worker that cache is loaded (or recorded) once, and the items join one running
batch as slots free up (``backend.worker.admission``); spread over workers, each would load it.

Rule (``BatchAffinity.home``): among the candidates the ``Router`` picked for an item (workers of
its model with slack; when every one is full and queueing is allowed, the least loaded), the
batch's *homes*, the workers its earlier items went to, in the order they became homes; the first
home that is a candidate takes the item. None is a candidate (a home is full while another worker
has slack, or it died): the routing policy chooses as for any job, and that worker becomes the
batch's next home. So a batch fills its first worker's slots, then spills to the next, and never
waits for a full worker while another has room ("where slots allow").

Bookkeeping is bounded: a batch is forgotten ``ttl_s`` after its latest item was routed, and at
most ``max_batches`` are remembered (the least recently used goes first). Forgetting only loses
the preference: the item is then routed like any job.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BATCHES = 10_000


@dataclass
class _Homes:
    workers: list[str] = field(default_factory=list)
    last_routed: float = 0.0


class BatchAffinity:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_batches: int = DEFAULT_MAX_BATCHES):
        if ttl_s <= 0 or max_batches < 1:
            raise ValueError(f"ttl_s must be > 0 and max_batches >= 1, got {ttl_s}, {max_batches}")
        self.ttl_s, self.max_batches = float(ttl_s), int(max_batches)
        self._batches: OrderedDict[str, _Homes] = OrderedDict()

    def home(self, batch_id: str, candidate_ids: Sequence[str], now: float) -> str | None:
        """The worker that takes this item of ``batch_id`` among ``candidate_ids`` (module
        docstring); None: no home is a candidate (or the item is in no batch)."""
        self._expire(now)
        homes = self._batches.get(batch_id) if batch_id else None
        if homes is None:
            return None
        return next((w for w in homes.workers if w in candidate_ids), None)

    def routed(self, batch_id: str, worker_id: str, now: float) -> None:
        """An item of ``batch_id`` went to ``worker_id``: it is (or becomes) one of its homes."""
        if not batch_id:
            return
        homes = self._batches.pop(batch_id, None) or _Homes()
        if worker_id not in homes.workers:
            homes.workers.append(worker_id)
        homes.last_routed = now
        self._batches[batch_id] = homes  # most recently used last
        while len(self._batches) > self.max_batches:
            self._batches.popitem(last=False)

    def homes(self, batch_id: str) -> tuple[str, ...]:
        homes = self._batches.get(batch_id)
        return tuple(homes.workers) if homes else ()

    def _expire(self, now: float) -> None:
        while self._batches:
            oldest = next(iter(self._batches.values()))
            if now - oldest.last_routed < self.ttl_s:
                return
            self._batches.popitem(last=False)

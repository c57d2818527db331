"""Eviction policies for the activation cache: pure bookkeeping, one instance per tier.

A policy only ranks entries; it never decides *whether* to evict (the ``CacheManager`` does, from
its budgets) nor *what may* be evicted (the manager passes the candidates: unpinned, idle entries).

Contract, checked by one test suite run over every entry of ``POLICIES``:
- ``choose_victim(candidates)`` returns one element of ``candidates`` (non-empty, all tracked);
- the policy forgets an entry on ``on_remove`` and never returns an entry it does not track.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Protocol


class EvictionPolicy(Protocol):
    """Ranks the entries of one tier; the manager calls the hooks, then asks for a victim."""

    def on_insert(self, entry_id: str, size_bytes: int) -> None: ...

    def on_access(self, entry_id: str) -> None: ...

    def on_remove(self, entry_id: str) -> None: ...

    def choose_victim(self, candidates: Collection[str]) -> str: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # oldest access first

    def on_insert(self, entry_id: str, size_bytes: int) -> None:
        self._order[entry_id] = None
        self._order.move_to_end(entry_id)

    def on_access(self, entry_id: str) -> None:
        if entry_id in self._order:
            self._order.move_to_end(entry_id)

    def on_remove(self, entry_id: str) -> None:
        self._order.pop(entry_id, None)

    def choose_victim(self, candidates: Collection[str]) -> str:
        allowed = set(candidates)
        for entry_id in self._order:
            if entry_id in allowed:
                return entry_id
        raise ValueError("no candidate is tracked by this policy")


class LFUPolicy:
    """LFU with dynamic aging (LFU-DA): priority = access count + the tier's age at the last access.

    The age rises to each victim's priority, so an entry that was hot long ago but is no longer
    used eventually ranks below entries in current use (plain LFU would keep it forever). Ties go
    to the least recently used.
    """

    def __init__(self) -> None:
        self._age = 0.0
        self._counts: dict[str, int] = {}
        self._priority: dict[str, float] = {}
        self._last_use: dict[str, int] = {}
        self._clock = itertools.count()

    def on_insert(self, entry_id: str, size_bytes: int) -> None:
        self._counts[entry_id] = 1
        self._touch(entry_id)

    def on_access(self, entry_id: str) -> None:
        if entry_id in self._counts:
            self._counts[entry_id] += 1
            self._touch(entry_id)

    def _touch(self, entry_id: str) -> None:
        self._priority[entry_id] = self._age + self._counts[entry_id]
        self._last_use[entry_id] = next(self._clock)

    def on_remove(self, entry_id: str) -> None:
        for table in (self._counts, self._priority, self._last_use):
            table.pop(entry_id, None)

    def choose_victim(self, candidates: Collection[str]) -> str:
        tracked = [entry_id for entry_id in candidates if entry_id in self._priority]
        if not tracked:
            raise ValueError("no candidate is tracked by this policy")
        victim = min(tracked, key=lambda e: (self._priority[e], self._last_use[e]))
        self._age = self._priority[victim]
        return victim


PolicyFactory = Callable[[], EvictionPolicy]

POLICIES: dict[str, PolicyFactory] = {"lru": LRUPolicy, "lfu": LFUPolicy}

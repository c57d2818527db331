"""Adapter tiers and late joining as plain bookkeeping: which LoRA adapters sit where, what to
evict, when a row takes its adapters. No torch, no I/O (``backend.worker.adapter_tiers`` moves the
bytes).

Tiers, by adapter sha256: ``device`` (in the model's dtype, where the engine reads it), ``host``
(RAM, loaded from the store's file) and ``disk`` (the adapter store itself: every adapter is
there). Tiers are inclusive: an adapter on the device keeps its host copy while the host budget
allows, so a device eviction costs no disk read later.

Invariants:
* each tier's bytes stay within its budget, except for adapters pinned on the device (rows are
  running with them: never evicted) and an adapter larger than a whole budget (kept alone, so a
  request naming it still runs);
* victims are chosen by the tier's eviction policy (``backend.cache.policies``: LRU, or LFU with
  ageing, which keeps the popular head of a long-tailed catalogue resident where LRU thrashes)
  among unpinned entries only;
* a row joins an adapter at the first step at which it is on the device, and blocks only at its
  join deadline (``join_deadline``) for adapters still missing; a joined adapter stays joined.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from backend.cache.policies import POLICIES, EvictionPolicy

DEVICE, HOST, DISK, LOADING = "device", "host", "disk", "loading"


@dataclass
class TierCounters:
    """What the tiers did, for metrics: hits by the tier an adapter was found in when a row asked
    for it, loads from disk and their bytes, host -> device copies, rows that blocked."""

    hits: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0, DISK: 0})
    disk_loads: int = 0
    disk_bytes: int = 0
    device_loads: int = 0
    device_bytes: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0})
    rows_blocked: int = 0
    rows_with_adapters: int = 0


class _Tier:
    """One tier's entries, sizes and policy."""

    def __init__(self, budget_bytes: int, policy: str):
        self.budget = budget_bytes
        self.sizes: dict[str, int] = {}
        self.policy: EvictionPolicy = POLICIES[policy]()

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    def insert(self, sha: str, nbytes: int) -> None:
        self.sizes[sha] = nbytes
        self.policy.on_insert(sha, nbytes)

    def touch(self, sha: str) -> None:
        self.policy.on_access(sha)

    def remove(self, sha: str) -> None:
        self.sizes.pop(sha, None)
        self.policy.on_remove(sha)

    def victims(self, incoming: str, pinned: Collection[str]) -> list[str]:
        """Entries to evict so the tier fits its budget with ``incoming`` in it."""
        out: list[str] = []
        used = self.used
        while used > self.budget:
            candidates = [s for s in self.sizes if s != incoming and s not in pinned]
            candidates = [s for s in candidates if s not in out]
            if not candidates:
                break
            victim = self.policy.choose_victim(candidates)
            out.append(victim)
            used -= self.sizes[victim]
        return out


class AdapterBook:
    """Residency of adapters in the device and host tiers of one worker."""

    def __init__(self, device_bytes: int, host_bytes: int, policy: str = "lfu"):
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}: one of {', '.join(POLICIES)}")
        self.device = _Tier(device_bytes, policy)
        self.host = _Tier(host_bytes, policy)
        self.loading: set[str] = set()
        self.pins: dict[str, int] = {}  # sha -> running rows using it on the device
        self.counters = TierCounters()

    # the keys of ``snapshot`` that only grow (Prometheus counters)
    COUNTERS = frozenset(
        {
            "hits",
            "disk_loads",
            "disk_load_bytes",
            "device_loads",
            "device_load_bytes",
            "evictions",
            "rows_blocked",
            "rows_with_adapters",
        }
    )

    def snapshot(self) -> dict:
        """Counters and residency for metrics (``maskserve_adapters_*``)."""
        counters = self.counters
        return {
            "hits": dict(counters.hits),
            "disk_loads": counters.disk_loads,
            "disk_load_bytes": counters.disk_bytes,
            "device_loads": counters.device_loads,
            "device_load_bytes": counters.device_bytes,
            "evictions": dict(counters.evictions),
            "rows_blocked": counters.rows_blocked,
            "rows_with_adapters": counters.rows_with_adapters,
            "resident": {DEVICE: len(self.device.sizes), HOST: len(self.host.sizes)},
            "resident_bytes": {DEVICE: self.device.used, HOST: self.host.used},
            "loading": len(self.loading),
        }

    def where(self, sha: str) -> str:
        if sha in self.device.sizes:
            return DEVICE
        if sha in self.host.sizes:
            return HOST
        return LOADING if sha in self.loading else DISK

    def asked(self, sha: str) -> str:
        """A row asks for ``sha``: count the hit by tier and return the tier."""
        tier = self.where(sha)
        self.counters.hits[DISK if tier == LOADING else tier] += 1
        if tier == DEVICE:
            self.device.touch(sha)
        if tier in (DEVICE, HOST) and sha in self.host.sizes:
            self.host.touch(sha)
        return tier

    def start_load(self, sha: str) -> bool:
        """Mark a disk -> host load of ``sha`` started; False when it is loaded or loading."""
        if self.where(sha) != DISK:
            return False
        self.loading.add(sha)
        return True

    def load_failed(self, sha: str) -> None:
        self.loading.discard(sha)

    def loaded(self, sha: str, nbytes: int) -> list[str]:
        """A disk -> host load finished: record it; returns host entries to drop."""
        self.loading.discard(sha)
        self.counters.disk_loads += 1
        self.counters.disk_bytes += nbytes
        self.host.insert(sha, nbytes)
        victims = self.host.victims(sha, ())
        for victim in victims:
            self.host.remove(victim)
        self.counters.evictions[HOST] += len(victims)
        return victims

    def on_device(self, sha: str, nbytes: int) -> list[str]:
        """A host -> device copy of ``sha`` finished: record it; returns device entries to drop
        (never pinned ones)."""
        self.counters.device_loads += 1
        self.counters.device_bytes += nbytes
        self.device.insert(sha, nbytes)
        victims = self.device.victims(sha, self.pins)
        for victim in victims:
            self.device.remove(victim)
        self.counters.evictions[DEVICE] += len(victims)
        return victims

    def pin(self, sha: str) -> None:
        self.pins[sha] = self.pins.get(sha, 0) + 1

    def unpin(self, sha: str) -> None:
        left = self.pins.get(sha, 0) - 1
        if left > 0:
            self.pins[sha] = left
        else:
            self.pins.pop(sha, None)


def join_deadline(num_steps: int, join_by: float) -> int:
    """The step by which a row must have every adapter: ``join_by`` of its steps, rounded up
    (0: adapters must be there before the first step)."""
    return min(num_steps, math.ceil(join_by * num_steps))


@dataclass
class RowJoins:
    """One row's adapters: wanted (sha -> scale), and the step each joined at."""

    wanted: dict[str, float]
    deadline: int
    joined: dict[str, int] = field(default_factory=dict)

    def missing(self) -> list[str]:
        return [sha for sha in self.wanted if sha not in self.joined]

    def plan(self, step: int, on_device: Collection[str]) -> tuple[list[str], list[str]]:
        """(adapters joining at ``step``, adapters the row must wait for now). A row waits only
        at or past its deadline; everything it waited for joins at this step too."""
        ready = [sha for sha in self.missing() if sha in on_device]
        waits = (
            [sha for sha in self.missing() if sha not in on_device] if step >= self.deadline else []
        )
        return ready, waits

    def join(self, shas: Collection[str], step: int) -> None:
        for sha in shas:
            self.joined.setdefault(sha, step)

    def active(self) -> tuple[tuple[str, float], ...]:
        """(sha, scale) of the joined adapters, for ``EditState.adapters``."""
        return tuple((sha, self.wanted[sha]) for sha in self.wanted if sha in self.joined)

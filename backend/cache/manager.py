"""Pure bookkeeping of the two-tier activation cache: host RAM above local disk.

The manager decides, the shell acts. Every method returns a dataclass saying which I/O to do
(evictions to execute, a load to start) and the shell (``backend.cache.store``) does it, then
reports back with ``complete_load`` / ``complete_store``. No torch, no files, no clocks: times
come in as arguments, so every decision is unit-tested in milliseconds.

Invariants (the random-walk test checks them after every operation):
- budgets are never exceeded: RAM use (entries in RAM + reservations of in-flight loads and
  stores) <= ``ram_budget_bytes``; disk use (entries on disk + reservations of in-flight stores)
  <= ``disk_budget_bytes``;
- a pinned entry, or one with a load or store in flight, is never evicted from either tier;
- an entry is readable only once its load/store completed: ``lookup`` says RAM only after
  ``complete_load(ok=True)`` or a completed store, and never reports an entry being stored;
- each tier's policy tracks exactly the entries resident in that tier.

Plans list evictions in execution order; the manager's state already reflects them, so the shell
executes them (under the same lock as its manager calls) before using the space they free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields, replace
from enum import Enum, Flag, auto
from typing import Any, ClassVar

from backend.cache.policies import LRUPolicy, PolicyFactory

LEAD_WINDOW = 1024  # prefetch lead times kept for the snapshot's statistics


class Tier(Flag):
    RAM = auto()
    DISK = auto()
    BOTH = RAM | DISK


class Residency(Enum):
    RAM = "ram"  # readable from host memory
    LOADING = "loading"  # on disk, a disk -> RAM load in flight
    DISK = "disk"  # readable from disk only
    MISS = "miss"


@dataclass(frozen=True)
class DropFromRam:
    """Release the entry's host-memory copy (it is on disk, or is being dropped entirely)."""

    entry_id: str


@dataclass(frozen=True)
class SpillToDisk:
    """Write the entry's host-memory copy to disk, then release it from RAM."""

    entry_id: str
    size_bytes: int


@dataclass(frozen=True)
class DeleteFromDisk:
    entry_id: str


Eviction = DropFromRam | SpillToDisk | DeleteFromDisk


@dataclass(frozen=True)
class LoadPlan:
    """A disk -> RAM load: execute ``evictions``, read the entry, then call ``complete_load``.

    ``ok=False``: the entry cannot fit in RAM even after evicting every unpinned entry; nothing
    was reserved and the entry stays readable from disk.
    """

    entry_id: str
    size_bytes: int
    ok: bool
    evictions: tuple[Eviction, ...] = ()


@dataclass(frozen=True)
class StorePlan:
    """A new entry: execute ``evictions``, write it to ``tier``, then call ``complete_store``.

    ``ok=False``: it does not fit (``reason`` says where); nothing was reserved or evicted.
    """

    entry_id: str
    size_bytes: int
    tier: Tier
    ok: bool
    evictions: tuple[Eviction, ...] = ()
    reason: str = ""


@dataclass
class EntryState:
    entry_id: str
    size_bytes: int
    in_ram: bool = False
    on_disk: bool = False
    loading: bool = False
    storing: Tier = Tier(0)  # tiers reserved by an in-flight store
    pins: int = 0
    prefetched_at: float | None = None  # start of a prefetch not yet followed by a lookup

    @property
    def busy(self) -> bool:
        """Not evictable: in use by a row, or with I/O in flight."""
        return self.pins > 0 or self.loading or bool(self.storing)

    def resident(self, tier: Tier) -> bool:
        return self.in_ram if tier is Tier.RAM else self.on_disk

    def holds(self, tier: Tier) -> bool:
        """Counts against ``tier``'s budget (resident, or reserved by a load/store)."""
        reserved = tier in self.storing or (tier is Tier.RAM and self.loading)
        return self.resident(tier) or reserved


@dataclass
class CacheMetrics:
    """Counters since start-up. A lookup counts once per tier it consulted: a DISK or LOADING
    residency is a RAM miss (and, for DISK, a disk hit); a MISS is a miss in both tiers."""

    # the keys of ``snapshot`` that only grow: Prometheus counters (the rates and lead times are
    # gauges)
    COUNTERS: ClassVar[frozenset[str]] = frozenset(
        {
            "ram_hits",
            "ram_misses",
            "disk_hits",
            "disk_misses",
            "load_waits",
            "bytes_loaded",
            "bytes_spilled",
            "ram_evictions",
            "disk_evictions",
            "corrupt_entries",
            "store_failures",
            "record_failures",
            "records_skipped",
            "partials_removed",
            "partial_bytes_removed",
            "prefetches",
            "prefetch_uses",
        }
    )
    ram_hits: int = 0
    ram_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    load_waits: int = 0  # lookups that found a load in flight (the caller waits for it)
    bytes_loaded: int = 0
    bytes_spilled: int = 0
    ram_evictions: int = 0
    disk_evictions: int = 0
    corrupt_entries: int = 0
    store_failures: int = 0
    record_failures: int = 0  # recordings ended by a disk error (ENOSPC, EFBIG, EIO...)
    records_skipped: int = 0  # recordings not started: no room in the disk budget
    partials_removed: int = 0  # partial recordings of gone processes removed at start-up
    partial_bytes_removed: int = 0
    prefetches: int = 0
    prefetch_uses: int = 0
    prefetch_lead_s: deque[float] = field(default_factory=lambda: deque(maxlen=LEAD_WINDOW))

    def record_lookup(self, residency: Residency) -> None:
        if residency is Residency.RAM:
            self.ram_hits += 1
            return
        self.ram_misses += 1
        if residency is Residency.LOADING:
            self.load_waits += 1
        elif residency is Residency.DISK:
            self.disk_hits += 1
        else:
            self.disk_misses += 1

    def record_prefetch_use(self, lead_s: float) -> None:
        self.prefetch_uses += 1
        self.prefetch_lead_s.append(lead_s)

    def snapshot(self) -> dict[str, Any]:
        """Plain dict for logs and heartbeats; lead-time statistics over the last ``LEAD_WINDOW``
        uses."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "prefetch_lead_s"}
        lookups = self.ram_hits + self.ram_misses
        out["ram_hit_rate"] = self.ram_hits / lookups if lookups else 0.0  # of all lookups
        # of RAM misses, those the disk tier served (read at once, or a prefetch already under way)
        out["disk_hit_rate"] = (
            (self.disk_hits + self.load_waits) / self.ram_misses if self.ram_misses else 0.0
        )
        leads = sorted(self.prefetch_lead_s)
        out["prefetch_lead_s_min"] = leads[0] if leads else None
        out["prefetch_lead_s_p50"] = leads[len(leads) // 2] if leads else None
        out["prefetch_lead_s_mean"] = sum(leads) / len(leads) if leads else None
        return out


@dataclass(frozen=True)
class DiskBudget:
    """The disk tier's budget and why (logged at start-up)."""

    budget_bytes: int
    reason: str


def choose_disk_budget(
    configured_bytes: int | None, free_share: float, free_bytes: int, held_bytes: int
) -> DiskBudget:
    """The disk tier's budget: ``configured_bytes`` when set (an explicit budget wins, even above
    what the file system has: the reason says so), else ``free_share`` of the room the cache can
    have, the free space plus what its entries already hold (``held_bytes``). The automatic budget
    never exceeds that room, so recordings are skipped before the file system fills."""
    if not 0.0 < free_share <= 1.0:
        raise ValueError(f"disk_free_share must be in (0, 1], got {free_share}")
    if configured_bytes is not None and configured_bytes < 0:
        raise ValueError("the disk budget must be >= 0 bytes")
    room = max(free_bytes, 0) + max(held_bytes, 0)
    if configured_bytes is not None:
        note = (
            f"; above the {room} bytes free or held by the cache: a write that finds the disk full "
            "makes its row compute without the cache"
            if configured_bytes > room
            else ""
        )
        return DiskBudget(configured_bytes, f"configured {configured_bytes} bytes{note}")
    budget = int(free_share * room)
    return DiskBudget(
        budget,
        f"auto: {free_share:g} of {room} bytes ({free_bytes} free + {held_bytes} held by entries)",
    )


class CacheManager:
    """Which entries live in which tier, what is reserved, and what to evict. Not thread-safe:
    the shell serialises calls."""

    def __init__(
        self,
        ram_budget_bytes: int,
        disk_budget_bytes: int,
        policy_factory: PolicyFactory = LRUPolicy,
    ):
        if ram_budget_bytes < 0 or disk_budget_bytes < 0:
            raise ValueError("cache budgets must be >= 0 bytes")
        self.budget_bytes = {Tier.RAM: ram_budget_bytes, Tier.DISK: disk_budget_bytes}
        self.used_bytes = {Tier.RAM: 0, Tier.DISK: 0}  # resident + reserved
        self.metrics = CacheMetrics()
        self._policies = {Tier.RAM: policy_factory(), Tier.DISK: policy_factory()}
        self._entries: dict[str, EntryState] = {}

    # ----- queries -------------------------------------------------------------------------------
    def residency(self, entry_id: str) -> Residency:
        """Where ``entry_id`` can be read from, without counting an access."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return Residency.MISS
        if entry.in_ram:
            return Residency.RAM
        if entry.on_disk:
            return Residency.LOADING if entry.loading else Residency.DISK
        return Residency.MISS  # still being stored

    def lookup(self, entry_id: str, now: float | None = None) -> Residency:
        """Residency of ``entry_id``, counted as an access (metrics, policies, prefetch lead
        time)."""
        residency = self.residency(entry_id)
        self.metrics.record_lookup(residency)
        entry = self._entries.get(entry_id)
        if residency is not Residency.MISS:
            for policy in self._policies.values():
                policy.on_access(entry_id)  # a policy ignores ids it does not track
            if now is not None and entry is not None and entry.prefetched_at is not None:
                self.metrics.record_prefetch_use(now - entry.prefetched_at)
                entry.prefetched_at = None
        return residency

    def resident(self, tier: Tier) -> list[str]:
        return [e.entry_id for e in self._entries.values() if e.resident(tier)]

    def known(self, entry_id: str) -> bool:
        """Whether ``entry_id`` is resident somewhere or has a store in flight."""
        return entry_id in self._entries

    def storing(self, entry_id: str) -> bool:
        """Whether ``entry_id`` has a store in flight."""
        entry = self._entries.get(entry_id)
        return entry is not None and bool(entry.storing)

    # ----- other processes sharing the disk tier ---------------------------------------------
    def touch(self, entry_id: str) -> None:
        """Another process sharing the disk tier used ``entry_id``: rank it as just used (no
        metrics)."""
        if entry_id in self._entries:
            for policy in self._policies.values():
                policy.on_access(entry_id)

    def disk_gone(self, entry_id: str) -> None:
        """Another process deleted ``entry_id`` from the shared disk tier. A RAM copy stays usable
        (RAM-only now: spilled back if evicted, as after a deletion of this manager's own); an
        entry read lazily from disk or being loaded is left to its reader, which meets the loss
        and forgets it; otherwise the entry is forgotten (not counted corrupt)."""
        entry = self._entries.get(entry_id)
        if entry is None or not entry.on_disk or entry.storing:
            return
        if entry.in_ram:
            self._update(entry, on_disk=False)
        elif not entry.busy:
            self._remove(entry)

    def entries(self) -> list[EntryState]:
        """Copies of every entry's state (for invariant checks and debugging)."""
        return [replace(e) for e in self._entries.values()]

    # ----- pins --------------------------------------------------------------------------------
    def pin(self, entry_id: str) -> None:
        """Keep a readable entry in its tiers while a running row uses it."""
        entry = self._entries.get(entry_id)
        if entry is None or not (entry.in_ram or entry.on_disk):
            raise KeyError(f"cache entry {entry_id} is not readable: look it up before pinning it")
        entry.pins += 1

    def unpin(self, entry_id: str) -> None:
        """Release one pin; a forgotten entry's pins are already gone, so that is a no-op."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return
        if entry.pins == 0:
            raise ValueError(f"cache entry {entry_id} is not pinned")
        entry.pins -= 1

    # ----- loads (disk -> RAM) -------------------------------------------------------------------
    def prepare_load(
        self, entry_id: str, prefetch_at: float | None = None, spare_prefetched: bool = False
    ) -> LoadPlan | None:
        """Reserve RAM for reading ``entry_id`` from disk. None when there is nothing to load
        (already in RAM, load in flight, or not on disk). ``prefetch_at`` marks a prefetch started
        then; its lead time is recorded at the next ``lookup``. ``spare_prefetched``: a speculative
        prefetch (a job just queued) must not evict an entry prefetched for an earlier job that has
        not looked it up yet; otherwise a queue longer than the RAM tier evicts its own head's
        entries before their rows run and every row reads its template twice."""
        entry = self._entries.get(entry_id)
        if entry is None or entry.in_ram or entry.loading or not entry.on_disk:
            return None
        if not self._can_fit(Tier.RAM, entry.size_bytes, spare_prefetched):
            return LoadPlan(entry_id, entry.size_bytes, ok=False)
        self._update(entry, loading=True)  # reserve first: busy, so no eviction below can take it
        evictions: list[Eviction] = []
        self._make_room(Tier.RAM, evictions, keep=entry_id, spare_prefetched=spare_prefetched)
        if prefetch_at is not None:
            self.metrics.prefetches += 1
            entry.prefetched_at = prefetch_at
        return LoadPlan(entry_id, entry.size_bytes, ok=True, evictions=tuple(evictions))

    def plan_prefetch(self, entry_id: str, now: float, speculative: bool) -> LoadPlan | None:
        """The disk -> RAM load to start now for an entry on disk only, or None (nothing to load,
        or no room). It spares entries prefetched for rows queued earlier (they come first); a
        ``speculative`` prefetch (a job just queued) stops there, while one for a row whose turn
        has come (rows admitted in this very schedule pin their entry only after it) evicts them
        when nothing else makes room. Entries in use are never evicted: while RAM is full of
        them there is no plan, and the row waits for a running row to release one."""
        if self.residency(entry_id) is not Residency.DISK:
            return None
        plan = self.prepare_load(entry_id, prefetch_at=now, spare_prefetched=True)
        if plan is not None and not plan.ok and not speculative:
            plan = self.prepare_load(entry_id, prefetch_at=now)
        return plan if plan is not None and plan.ok else None

    def acquirable_now(self, entry_id: str) -> bool:
        """Whether acquiring ``entry_id`` returns at once: in RAM, a miss, or on disk but too large
        for the whole RAM budget (only ever read lazily, file by file). False while its load is in
        flight, and for an entry on disk only that fits RAM (its load has yet to start)."""
        residency = self.residency(entry_id)
        if residency is Residency.LOADING:
            return False
        return not (residency is Residency.DISK and self.fits_ram(entry_id))

    def complete_load(self, entry_id: str, ok: bool) -> None:
        """The load finished: the entry becomes readable from RAM, or its reservation is
        returned."""
        entry = self._entries.get(entry_id)
        if entry is None or not entry.loading:
            return  # forgotten while loading: the reservation went with it
        self._update(entry, loading=False, in_ram=ok)
        if ok:
            self.metrics.bytes_loaded += entry.size_bytes

    # ----- stores (new entries) ------------------------------------------------------------------
    def prepare_store(self, entry_id: str, size_bytes: int, tier: Tier) -> StorePlan:
        """Reserve ``size_bytes`` in every tier of ``tier`` for a new entry, evicting as needed."""
        if entry_id in self._entries:
            raise ValueError(
                f"cache entry {entry_id} already exists: forget it before storing it again"
            )
        if not tier:
            raise ValueError("store into at least one tier")
        for one in (Tier.DISK, Tier.RAM):
            if one in tier and not self._can_fit(one, size_bytes):
                self.metrics.store_failures += 1
                reason = (
                    f"{size_bytes} bytes do not fit the {one.name} budget of "
                    f"{self.budget_bytes[one]} bytes even after evicting every unpinned entry"
                )
                return StorePlan(entry_id, size_bytes, tier, ok=False, reason=reason)
        entry = self._entries[entry_id] = EntryState(entry_id, size_bytes)
        self._update(entry, storing=tier)
        evictions: list[Eviction] = []
        # disk first: RAM victims then spill only into what is left after this entry's reservation
        for one in (Tier.DISK, Tier.RAM):
            if one in tier:
                self._make_room(one, evictions, keep=entry_id)
        return StorePlan(entry_id, size_bytes, tier, ok=True, evictions=tuple(evictions))

    def complete_store(self, entry_id: str, ok: bool) -> None:
        entry = self._entries.get(entry_id)
        if entry is None or not entry.storing:
            return
        if ok:
            stored = entry.storing
            self._update(
                entry, storing=Tier(0), in_ram=Tier.RAM in stored, on_disk=Tier.DISK in stored
            )
        else:
            self.metrics.store_failures += 1
            self._remove(entry)

    def settle_store(self, entry_id: str, size_bytes: int) -> StorePlan:
        """A store in flight turned out ``size_bytes`` (a recording reserves an upper bound before
        its first byte): its reservation becomes that size, evicting if it grew. ``ok=False``: it
        cannot fit even after evicting every unpinned entry; the entry is forgotten (counted as a
        store failure). Then ``complete_store`` as usual."""
        entry = self._entries.get(entry_id)
        if entry is None or not entry.storing:
            raise ValueError(f"cache entry {entry_id} has no store in flight to settle")
        tiers = entry.storing
        self._update(entry, storing=Tier(0))  # give the reservation back, then take the new size
        entry.size_bytes = size_bytes
        for one in (Tier.DISK, Tier.RAM):
            if one in tiers and not self._can_fit(one, size_bytes):
                self.metrics.store_failures += 1
                del self._entries[entry_id]
                reason = (
                    f"{size_bytes} bytes do not fit the {one.name} budget of "
                    f"{self.budget_bytes[one]} bytes even after evicting every unpinned entry"
                )
                return StorePlan(entry_id, size_bytes, tiers, ok=False, reason=reason)
        self._update(entry, storing=tiers)
        evictions: list[Eviction] = []
        for one in (Tier.DISK, Tier.RAM):
            if one in tiers:
                self._make_room(one, evictions, keep=entry_id)
        return StorePlan(entry_id, size_bytes, tiers, ok=True, evictions=tuple(evictions))

    def abandon_store(self, entry_id: str) -> None:
        """A store in flight ended without data (a recording aborted or refused): its reservation
        is returned, not counted as a failure. A no-op for an entry with no store in flight."""
        entry = self._entries.get(entry_id)
        if entry is not None and entry.storing:
            self._remove(entry)

    def register_disk(self, entry_id: str, size_bytes: int) -> tuple[Eviction, ...]:
        """An entry found on disk at start-up (register oldest first). Returns the deletions that
        keep the disk budget, ``DeleteFromDisk(entry_id)`` itself when it can never fit."""
        if entry_id in self._entries:
            return ()
        if not self._can_fit(Tier.DISK, size_bytes):
            return (DeleteFromDisk(entry_id),)
        entry = self._entries[entry_id] = EntryState(entry_id, size_bytes)
        self._update(entry, on_disk=True)
        evictions: list[Eviction] = []
        self._make_room(Tier.DISK, evictions, keep=entry_id)
        return tuple(evictions)

    def forget(self, entry_id: str, corrupt: bool = False) -> None:
        """Drop an entry from both tiers, pins and reservations included (its data is unusable)."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return
        if corrupt:
            self.metrics.corrupt_entries += 1
        self._remove(entry)

    # ----- eviction ------------------------------------------------------------------------------
    def _candidates(
        self, tier: Tier, keep: str | None = None, spare_prefetched: bool = False
    ) -> list[EntryState]:
        return [
            e
            for e in self._entries.values()
            if e.resident(tier)
            and not e.busy
            and e.entry_id != keep
            and not (spare_prefetched and e.prefetched_at is not None)
        ]

    def _can_fit(self, tier: Tier, size_bytes: int, spare_prefetched: bool = False) -> bool:
        evictable = sum(
            e.size_bytes for e in self._candidates(tier, spare_prefetched=spare_prefetched)
        )
        return self.used_bytes[tier] + size_bytes - evictable <= self.budget_bytes[tier]

    def fits_ram(self, entry_id: str) -> bool:
        """Whether ``entry_id`` fits the RAM budget at all (once no entry is in use); False for an
        unknown entry. An entry that does not is only ever read from disk."""
        entry = self._entries.get(entry_id)
        return entry is not None and entry.size_bytes <= self.budget_bytes[Tier.RAM]

    def _make_room(
        self,
        tier: Tier,
        evictions: list[Eviction],
        keep: str | None,
        spare_prefetched: bool = False,
    ) -> None:
        """Evict policy-chosen victims until ``tier`` is within budget (callers checked
        ``_can_fit``)."""
        while self.used_bytes[tier] > self.budget_bytes[tier]:
            candidates = {e.entry_id: e for e in self._candidates(tier, keep, spare_prefetched)}
            if not candidates:
                raise AssertionError(
                    f"{tier.name} over budget with nothing evictable: _can_fit was skipped"
                )
            victim = candidates[self._policies[tier].choose_victim(list(candidates))]
            if tier is Tier.RAM:
                self._evict_from_ram(victim, evictions)
            else:
                self._evict_from_disk(victim, evictions)

    def _evict_from_ram(self, victim: EntryState, evictions: list[Eviction]) -> None:
        self.metrics.ram_evictions += 1
        if victim.on_disk:
            self._update(victim, in_ram=False)
            evictions.append(DropFromRam(victim.entry_id))
        elif self._can_fit(Tier.DISK, victim.size_bytes):
            self._update(victim, in_ram=False, on_disk=True)
            # deletions run before the spill
            self._make_room(Tier.DISK, evictions, keep=victim.entry_id)
            evictions.append(SpillToDisk(victim.entry_id, victim.size_bytes))
            self.metrics.bytes_spilled += victim.size_bytes
        else:  # the disk cannot take it: the entry is lost
            self._remove(victim)
            evictions.append(DropFromRam(victim.entry_id))

    def _evict_from_disk(self, victim: EntryState, evictions: list[Eviction]) -> None:
        self.metrics.disk_evictions += 1
        evictions.append(DeleteFromDisk(victim.entry_id))
        if victim.in_ram:
            # still readable from RAM; spilled back if evicted there
            self._update(victim, on_disk=False)
        else:
            self._remove(victim)

    # ----- state changes: every flag change goes through here (bytes and policies stay exact) --
    def _update(self, entry: EntryState, **changes: Any) -> None:
        before = {tier: (entry.holds(tier), entry.resident(tier)) for tier in (Tier.RAM, Tier.DISK)}
        for name, value in changes.items():
            setattr(entry, name, value)
        for tier, (held, was_resident) in before.items():
            self.used_bytes[tier] += (entry.holds(tier) - held) * entry.size_bytes
            if entry.resident(tier) and not was_resident:
                self._policies[tier].on_insert(entry.entry_id, entry.size_bytes)
            elif was_resident and not entry.resident(tier):
                self._policies[tier].on_remove(entry.entry_id)

    def _remove(self, entry: EntryState) -> None:
        self._update(entry, in_ram=False, on_disk=False, loading=False, storing=Tier(0))
        del self._entries[entry.entry_id]

"""Pure bookkeeping of the tiered activation cache: device memory above host RAM above local disk.

The manager decides, the shell acts. Every method returns a plan (``backend.cache.plans``) saying
which I/O to do (evictions to execute, a load or a copy to start) and the shell
(``backend.cache.store``) does it, then reports back with ``complete_load`` /
``complete_promotion`` / ``complete_store``. No torch, no files, no clocks: times come in as
arguments, so every decision is unit-tested in milliseconds.

Tiers: disk holds recordings; RAM holds copies read from disk (or entries not yet, or no longer,
on disk); the device tier (off while its budget is 0) holds copies promoted from RAM, so that a
step reads them without touching host memory. Each tier has its own budget and its own instance
of one eviction policy. An entry is read from the fastest tier that holds it.

Device tier rules:
- promotion copies an entry's RAM copy to the device (``plan_promotion``), on a hit or for a
  queued job; it evicts device entries by policy but never one promoted for a queued job that has
  not looked it up yet (queued rows come first);
- the RAM copy may be evicted while the device holds one: dropped when the entry is on disk or when
  the disk cannot take it, else spilled to disk as usual;
- demotion (a device eviction) drops the device copy when RAM holds one; otherwise it copies the
  entry back to RAM when RAM can make room (``DemoteToRam``), else drops it when it is on disk,
  else the entry is lost (as a RAM entry the disk cannot take);
- ``release_device`` gives device memory back under pressure, shrinking the tier's budget by what
  it released.

Invariants (the random-walk test checks them after every operation):
- budgets are never exceeded: device use (entries on the device + reservations of copies in
  flight) <= its budget; RAM use (entries in RAM + reservations of in-flight loads and stores)
  <= ``ram_budget_bytes``; disk use (entries on disk + reservations of in-flight stores)
  <= ``disk_budget_bytes``;
- a pinned entry, or one with a load, copy or store in flight, is never evicted from any tier;
- an entry is readable only once its load/copy/store completed: ``lookup`` says DEVICE only after
  ``complete_promotion(ok=True)``, RAM only after ``complete_load(ok=True)`` or a completed store,
  and never reports an entry being stored;
- each tier's policy tracks exactly the entries resident in that tier;
- with the device budget 0 no entry is ever promoted: the manager behaves as a two-tier cache.

Plans list evictions in execution order; the manager's state already reflects them, so the shell
executes them (under the same lock as its manager calls) before using the space they free.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from backend.cache.metrics import CacheMetrics
from backend.cache.plans import (
    DeleteFromDisk,
    DemoteToRam,
    DeviceRelease,
    DropFromDevice,
    DropFromRam,
    EntryState,
    Eviction,
    LoadPlan,
    PromotePlan,
    Residency,
    SpillToDisk,
    StorePlan,
    Tier,
)
from backend.cache.policies import LRUPolicy, PolicyFactory

# the names callers import from here (the types live in ``plans`` and ``metrics``)
__all__ = [
    "CacheManager",
    "CacheMetrics",
    "DeleteFromDisk",
    "DemoteToRam",
    "DeviceRelease",
    "DropFromDevice",
    "DropFromRam",
    "EntryState",
    "Eviction",
    "LoadPlan",
    "PromotePlan",
    "Residency",
    "SpillToDisk",
    "StorePlan",
    "TIERS",
    "Tier",
]

TIERS = (Tier.DEVICE, Tier.RAM, Tier.DISK)  # fastest first


class CacheManager:
    """Which entries live in which tier, what is reserved, and what to evict. Not thread-safe:
    the shell serialises calls."""

    def __init__(
        self,
        ram_budget_bytes: int,
        disk_budget_bytes: int,
        policy_factory: PolicyFactory = LRUPolicy,
        device_budget_bytes: int = 0,
    ):
        if min(ram_budget_bytes, disk_budget_bytes, device_budget_bytes) < 0:
            raise ValueError("cache budgets must be >= 0 bytes")
        self.budget_bytes = {
            Tier.DEVICE: device_budget_bytes,
            Tier.RAM: ram_budget_bytes,
            Tier.DISK: disk_budget_bytes,
        }
        self.used_bytes = {tier: 0 for tier in TIERS}  # resident + reserved
        self.metrics = CacheMetrics(device_budget_bytes=device_budget_bytes)
        self._policies = {tier: policy_factory() for tier in TIERS}
        self._entries: dict[str, EntryState] = {}

    # ----- queries -------------------------------------------------------------------------------
    def residency(self, entry_id: str) -> Residency:
        """Where ``entry_id`` can be read from, without counting an access."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return Residency.MISS
        if entry.on_device:
            return Residency.DEVICE
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
            if entry is not None:
                entry.device_prefetched = False  # its queued job came: an ordinary resident
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
        """Another process deleted ``entry_id`` from the shared disk tier. A RAM or device copy
        stays usable (spilled back if evicted, as after a deletion of this manager's own); an
        entry read lazily from disk or being loaded is left to its reader, which meets the loss
        and forgets it; otherwise the entry is forgotten (not counted corrupt)."""
        entry = self._entries.get(entry_id)
        if entry is None or not entry.on_disk or entry.storing:
            return
        if entry.in_ram or entry.on_device:
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
        if entry is None or not (entry.on_device or entry.in_ram or entry.on_disk):
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
        (already in RAM or on the device, load in flight, or not on disk). ``prefetch_at`` marks a
        prefetch started then; its lead time is recorded at the next ``lookup``.
        ``spare_prefetched``: a speculative prefetch (a job just queued) must not evict an entry
        prefetched for an earlier job that has not looked it up yet; otherwise a queue longer than
        the RAM tier evicts its own head's entries before their rows run and every row reads its
        template twice."""
        entry = self._entries.get(entry_id)
        if entry is None or entry.in_ram or entry.on_device or entry.loading or not entry.on_disk:
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
        """Whether acquiring ``entry_id`` returns at once: on the device or in RAM, a miss, or on
        disk but too large for the whole RAM budget (only ever read lazily, file by file). False
        while its load is in flight, and for an entry on disk only that fits RAM (its load has yet
        to start)."""
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

    # ----- promotions (RAM -> device) and demotions -------------------------------------------
    def plan_promotion(self, entry_id: str, for_queued_job: bool = False) -> PromotePlan | None:
        """Reserve device memory for copying ``entry_id``'s RAM copy to the device, evicting by
        policy. None when there is nothing to copy (the tier is off, the entry is not in RAM, is
        on the device already or being copied) or no room: device entries in use, or promoted for
        queued jobs that have not looked them up yet, are never evicted for it.
        ``for_queued_job``: a prefetch while a job queues; later promotions spare this entry
        until its next ``lookup``."""
        entry = self._entries.get(entry_id)
        if (
            entry is None
            or not self.budget_bytes[Tier.DEVICE]  # the tier is off
            or not entry.in_ram
            or entry.on_device
            or entry.promoting
            or not self._can_fit(Tier.DEVICE, entry.size_bytes, spare_prefetched=True)
        ):
            return None
        self._update(entry, promoting=True)  # reserve first: busy, so no eviction below takes it
        evictions: list[Eviction] = []
        self._make_room(Tier.DEVICE, evictions, keep=entry_id, spare_prefetched=True)
        entry.device_prefetched = entry.device_prefetched or for_queued_job
        return PromotePlan(entry_id, entry.size_bytes, tuple(evictions))

    def complete_promotion(self, entry_id: str, ok: bool) -> None:
        """The copy finished: the entry becomes readable from the device, or its reservation is
        returned."""
        entry = self._entries.get(entry_id)
        if entry is None or not entry.promoting:
            return  # forgotten while copying: the reservation went with it
        self._update(entry, promoting=False, on_device=ok)
        if ok:
            self.metrics.bytes_promoted += entry.size_bytes
        else:
            entry.device_prefetched = False

    def release_device(self, nbytes: int) -> DeviceRelease:
        """Give back at least ``nbytes`` of device memory when the tier's unpinned entries hold
        that much (else all of them), victims by policy, demoted as any device eviction. The
        tier's budget shrinks by what was released, so that later promotions do not take back the
        memory the pressure asked for."""
        evictions: list[Eviction] = []
        released = 0
        while released < nbytes:
            candidates = {e.entry_id: e for e in self._candidates(Tier.DEVICE)}
            if not candidates:
                break
            victim = candidates[self._policies[Tier.DEVICE].choose_victim(list(candidates))]
            released += victim.size_bytes
            self._evict_from_device(victim, evictions)
        self.budget_bytes[Tier.DEVICE] -= released
        self.metrics.device_budget_bytes = self.budget_bytes[Tier.DEVICE]
        return DeviceRelease(released, tuple(evictions))

    # ----- stores (new entries) ------------------------------------------------------------------
    def prepare_store(self, entry_id: str, size_bytes: int, tier: Tier) -> StorePlan:
        """Reserve ``size_bytes`` in every tier of ``tier`` for a new entry, evicting as needed."""
        if entry_id in self._entries:
            raise ValueError(
                f"cache entry {entry_id} already exists: forget it before storing it again"
            )
        if not tier or Tier.DEVICE in tier:
            raise ValueError("store into RAM and/or disk: the device tier fills by promotion")
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
        """Drop an entry from every tier, pins and reservations included (its data is unusable)."""
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
            and not (spare_prefetched and _prefetched(e, tier))
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
            if tier is Tier.DEVICE:
                self._evict_from_device(victim, evictions)
            elif tier is Tier.RAM:
                self._evict_from_ram(victim, evictions)
            else:
                self._evict_from_disk(victim, evictions)

    def _evict_from_device(self, victim: EntryState, evictions: list[Eviction]) -> None:
        """Demote ``victim`` (module docstring): RAM keeps a copy, or gets one back when it can
        make room (sparing entries prefetched for queued jobs), or disk has one, or it is lost."""
        self.metrics.device_evictions += 1
        victim.device_prefetched = False
        if victim.in_ram:
            self._update(victim, on_device=False)
            evictions.append(DropFromDevice(victim.entry_id))
        elif self._can_fit(Tier.RAM, victim.size_bytes, spare_prefetched=True):
            self._update(victim, on_device=False, in_ram=True)
            # RAM's evictions run before the copy back
            self._make_room(Tier.RAM, evictions, keep=victim.entry_id, spare_prefetched=True)
            evictions.append(DemoteToRam(victim.entry_id, victim.size_bytes))
        elif victim.on_disk:
            self._update(victim, on_device=False)
            evictions.append(DropFromDevice(victim.entry_id))
        else:  # neither RAM nor disk can take it: the entry is lost
            self._remove(victim)
            evictions.append(DropFromDevice(victim.entry_id))

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
        elif victim.on_device:  # the disk cannot take it: the device copy is the only one left
            self._update(victim, in_ram=False)
            evictions.append(DropFromRam(victim.entry_id))
        else:  # the disk cannot take it: the entry is lost
            self._remove(victim)
            evictions.append(DropFromRam(victim.entry_id))

    def _evict_from_disk(self, victim: EntryState, evictions: list[Eviction]) -> None:
        self.metrics.disk_evictions += 1
        evictions.append(DeleteFromDisk(victim.entry_id))
        if victim.in_ram or victim.on_device:
            # still readable from RAM or the device; spilled back if evicted there
            self._update(victim, on_disk=False)
        else:
            self._remove(victim)

    # ----- state changes: every flag change goes through here (bytes and policies stay exact) --
    def _update(self, entry: EntryState, **changes: Any) -> None:
        before = {tier: (entry.holds(tier), entry.resident(tier)) for tier in TIERS}
        for name, value in changes.items():
            setattr(entry, name, value)
        for tier, (held, was_resident) in before.items():
            self.used_bytes[tier] += (entry.holds(tier) - held) * entry.size_bytes
            if entry.resident(tier) and not was_resident:
                self._policies[tier].on_insert(entry.entry_id, entry.size_bytes)
            elif was_resident and not entry.resident(tier):
                self._policies[tier].on_remove(entry.entry_id)
        self.metrics.device_bytes = self.used_bytes[Tier.DEVICE]

    def _remove(self, entry: EntryState) -> None:
        self._update(
            entry,
            on_device=False,
            in_ram=False,
            on_disk=False,
            loading=False,
            promoting=False,
            storing=Tier(0),
        )
        del self._entries[entry.entry_id]


def _prefetched(entry: EntryState, tier: Tier) -> bool:
    """Brought into ``tier`` for a queued job that has not looked it up yet."""
    return entry.device_prefetched if tier is Tier.DEVICE else entry.prefetched_at is not None

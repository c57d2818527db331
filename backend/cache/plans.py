"""What the cache manager (``backend.cache.manager``) decides, as data: the tiers, where an entry
can be read from, each entry's state, and the plans and evictions the shell executes. Pure: no
torch, no files, no clocks."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, Flag, auto


class Tier(Flag):
    RAM = auto()
    DISK = auto()
    DEVICE = auto()  # the compute device's memory, above RAM
    BOTH = RAM | DISK  # the tiers a new entry may be stored into


class Residency(Enum):
    DEVICE = "device"  # readable from the compute device's memory (no host read)
    RAM = "ram"  # readable from host memory
    LOADING = "loading"  # on disk, a disk -> RAM load in flight
    DISK = "disk"  # readable from disk only
    MISS = "miss"


@dataclass(frozen=True)
class DropFromRam:
    """Release the entry's host-memory copy (it is on disk or on the device, or is being dropped
    entirely)."""

    entry_id: str


@dataclass(frozen=True)
class SpillToDisk:
    """Write the entry's host-memory copy to disk, then release it from RAM."""

    entry_id: str
    size_bytes: int


@dataclass(frozen=True)
class DeleteFromDisk:
    entry_id: str


@dataclass(frozen=True)
class DropFromDevice:
    """Release the entry's device copy (RAM or disk keeps one, or the entry is dropped
    entirely)."""

    entry_id: str


@dataclass(frozen=True)
class DemoteToRam:
    """Copy the entry's device copy back to host memory, then release it from the device."""

    entry_id: str
    size_bytes: int


Eviction = DropFromRam | SpillToDisk | DeleteFromDisk | DropFromDevice | DemoteToRam


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


@dataclass(frozen=True)
class PromotePlan:
    """A RAM -> device copy: execute ``evictions``, copy the entry's RAM copy to the device, then
    call ``complete_promotion``. The device bytes are reserved and the entry is busy meanwhile."""

    entry_id: str
    size_bytes: int
    evictions: tuple[Eviction, ...] = ()


@dataclass(frozen=True)
class DeviceRelease:
    """Device memory given back under pressure: execute ``evictions``; ``released_bytes`` is the
    size of the device copies they release."""

    released_bytes: int
    evictions: tuple[Eviction, ...] = ()


@dataclass
class EntryState:
    entry_id: str
    size_bytes: int
    in_ram: bool = False
    on_disk: bool = False
    on_device: bool = False
    loading: bool = False  # a disk -> RAM load in flight (RAM reserved)
    promoting: bool = False  # a RAM -> device copy in flight (device memory reserved)
    storing: Tier = Tier(0)  # tiers reserved by an in-flight store
    pins: int = 0
    prefetched_at: float | None = None  # start of a prefetch not yet followed by a lookup
    # promoted to the device for a queued job that has not looked it up yet
    device_prefetched: bool = False

    @property
    def busy(self) -> bool:
        """Not evictable: in use by a row, or with I/O in flight."""
        return self.pins > 0 or self.loading or self.promoting or bool(self.storing)

    def resident(self, tier: Tier) -> bool:
        if tier is Tier.DEVICE:
            return self.on_device
        return self.in_ram if tier is Tier.RAM else self.on_disk

    def holds(self, tier: Tier) -> bool:
        """Counts against ``tier``'s budget (resident, or reserved by a load, copy or store)."""
        reserved = (
            tier in self.storing
            or (tier is Tier.RAM and self.loading)
            or (tier is Tier.DEVICE and self.promoting)
        )
        return self.resident(tier) or reserved

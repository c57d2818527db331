"""The activation cache's counters and gauges (``CacheMetrics``), kept by the cache manager and
exported by the worker: its heartbeat's stats and Prometheus ``maskserve_cache_*``. Pure."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from backend.cache.plans import Residency

LEAD_WINDOW = 1024  # prefetch lead times kept for the snapshot's statistics


@dataclass
class CacheMetrics:
    """Counters since start-up, and gauges of the device tier. A lookup counts once per tier it
    consulted, fastest first: a DEVICE residency is a device hit; any other is a device miss
    (counted only while the device tier is on) and goes on to RAM: a DISK or LOADING residency is
    a RAM miss (and, for DISK, a disk hit); a MISS is a miss in every tier."""

    # the keys of ``snapshot`` that only grow: Prometheus counters (the rates, lead times and
    # device bytes are gauges)
    COUNTERS: ClassVar[frozenset[str]] = frozenset(
        {
            "device_hits",
            "device_misses",
            "ram_hits",
            "ram_misses",
            "disk_hits",
            "disk_misses",
            "load_waits",
            "bytes_loaded",
            "bytes_promoted",
            "bytes_spilled",
            "device_evictions",
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
    # the int keys of ``snapshot`` that are current values, not counts: Prometheus gauges
    GAUGES: ClassVar[frozenset[str]] = frozenset({"device_bytes", "device_budget_bytes"})
    device_hits: int = 0
    device_misses: int = 0
    ram_hits: int = 0
    ram_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    load_waits: int = 0  # lookups that found a load in flight (the caller waits for it)
    bytes_loaded: int = 0  # disk -> RAM
    bytes_promoted: int = 0  # RAM -> device
    bytes_spilled: int = 0
    device_evictions: int = 0  # device copies dropped or demoted to RAM
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
    device_bytes: int = 0  # gauge: device-tier bytes resident or reserved by copies in flight
    device_budget_bytes: int = 0  # gauge: the device tier's budget (0: the tier is off)
    prefetch_lead_s: deque[float] = field(default_factory=lambda: deque(maxlen=LEAD_WINDOW))

    def record_lookup(self, residency: Residency) -> None:
        if residency is Residency.DEVICE:
            self.device_hits += 1
            return
        if self.device_budget_bytes:
            self.device_misses += 1
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
        device_lookups = self.device_hits + self.device_misses
        out["device_hit_rate"] = self.device_hits / device_lookups if device_lookups else 0.0
        lookups = self.ram_hits + self.ram_misses
        # of the lookups that reached RAM (every lookup while the device tier is off)
        out["ram_hit_rate"] = self.ram_hits / lookups if lookups else 0.0
        # of RAM misses, those the disk tier served (read at once, or a prefetch already under way)
        out["disk_hit_rate"] = (
            (self.disk_hits + self.load_waits) / self.ram_misses if self.ram_misses else 0.0
        )
        leads = sorted(self.prefetch_lead_s)
        out["prefetch_lead_s_min"] = leads[0] if leads else None
        out["prefetch_lead_s_p50"] = leads[len(leads) // 2] if leads else None
        out["prefetch_lead_s_mean"] = sum(leads) / len(leads) if leads else None
        return out

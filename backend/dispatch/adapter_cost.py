"""The router's cost of loading a job's LoRA adapters on a worker. Pure Python.

The router's ``adapters`` term (``backend.dispatch.router``): loading job J's LoRA adapters
where worker W does not hold them (Katz / ROCK affinity-aware placement: jobs go where their
adapters are). Each adapter a of A_J (each
sha once) is, on W: ``device`` (nothing to load), ``host`` (a host->device copy,
``bytes * copy_s_per_byte``), ``arriving`` (in neither tier, but a running or
waiting row of W applies it, so its load is under way: the copy plus half a read, the
expected remainder of a read begun at an unknown time) or ``disk`` (only in the shared
registry: a read, ``bytes * read_s_per_byte``, plus the copy). The copy's rate is
the profile's fitted cache-load slope (the same host->device path, ``maskserve profile``)
unless set (``dispatcher.adapter_copy_gbps``; 16 GB/s where the fit is not positive); the
read's is ``disk_read_s_per_byte`` unless set (``dispatcher.adapter_read_gbps``). A worker
reads a queued job's adapters into host RAM while it waits (prefetch) and copies them when
the row asks; a row starts without adapters that are not on the device and takes each at
the first step it is there, blocking only at its join deadline, step
``K = join_deadline(n_J, adapter_join_by)`` (``adapters.join_by``, default 0.2 of its
steps; ``backend.worker.adapter_book``). So J waits only for the part of the load that
neither its time in W's queue nor its first K steps hide:
``adapters = max(0, max(0, reads - (wait + residency)) + copies - K * T(J))``, reads and
copies summed over A_J (one load thread). T(J), J's step alone, is a lower bound of its
steps in any batch, so the hidden part is never overestimated. The quality cost of rows
that take adapters late (steps run without them) is charged nowhere; an adapter of unknown
size (bytes 0) costs nothing; the reads of other waiting rows' adapters queued before J's
are not charged (heartbeats carry no adapter sizes). ``flashps`` and the baselines ignore
adapters; jobs without adapters cost exactly what they did before the term.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from backend.worker.adapter_book import join_deadline

# a host -> device adapter copy where the profile fits no positive cache-load slope: 16 GB/s
# (PCIe Gen4 x16 order of magnitude)
DEFAULT_ADAPTER_COPY_S_PER_BYTE = 1 / 16e9
DEFAULT_ADAPTER_JOIN_BY = 0.2  # as ``AdapterSettings.join_by``: a row's adapters join by 20% of it
ADAPTER_TIERS = ("device", "host", "arriving", "disk")  # cheapest first


@dataclass(frozen=True)
class AdapterNeed:
    """One LoRA adapter a job applies, as the router weighs it: its sha256 (how workers keep it)
    and the bytes of its tensors (0: unknown, charged nothing)."""

    sha256: str
    nbytes: int = 0


@dataclass(frozen=True)
class AdapterResidency:
    """Where worker W holds adapters (sha256 sets): its device and host tiers, and the adapters
    its running and waiting rows apply (their loads are under way)."""

    device: frozenset[str] = frozenset()
    host: frozenset[str] = frozenset()
    in_use: frozenset[str] = frozenset()


@dataclass(frozen=True)
class AdapterLoads:
    """Rates of one worker kind: seconds per byte of a host -> device copy and of a registry
    read, and the join deadline's share of a row's steps."""

    copy_s_per_byte: float
    read_s_per_byte: float
    join_by: float = DEFAULT_ADAPTER_JOIN_BY

    def __post_init__(self) -> None:
        if not 0.0 <= self.join_by <= 1.0:
            raise ValueError(f"adapter_join_by must be in [0, 1], got {self.join_by}")
        for name, rate in (("copy", self.copy_s_per_byte), ("read", self.read_s_per_byte)):
            if not rate >= 0:
                raise ValueError(f"adapter_{name}_s_per_byte must be >= 0, got {rate}")

    @classmethod
    def fitted(
        cls,
        load_slope: float,
        disk_read_s_per_byte: float,
        copy_s_per_byte: float | None = None,
        read_s_per_byte: float | None = None,
        join_by: float = DEFAULT_ADAPTER_JOIN_BY,
    ) -> AdapterLoads:
        """The copy as the profile's fitted cache-load slope (the same host -> device path) unless
        given; the read as the template cache's disk read unless given."""
        fit = load_slope if load_slope > 0 else DEFAULT_ADAPTER_COPY_S_PER_BYTE
        return cls(
            float(fit if copy_s_per_byte is None else copy_s_per_byte),
            float(disk_read_s_per_byte if read_s_per_byte is None else read_s_per_byte),
            float(join_by),
        )

    def tier(self, sha256: str, where: AdapterResidency) -> str:
        """Where adapter ``sha256`` is for a job placed on W: 'device', 'host', 'arriving' (in
        neither tier, but a row already on W applies it: its load is under way) or 'disk' (only
        in the shared registry)."""
        if sha256 in where.device:
            return "device"
        if sha256 in where.host:
            return "host"
        return "arriving" if sha256 in where.in_use else "disk"

    def load_s(self, need: AdapterNeed, tier: str) -> tuple[float, float]:
        """(read, copy) seconds of bringing ``need`` to the device from ``tier``: a read from the
        registry (disk only; half of one when 'arriving') and a host -> device copy (all but
        'device')."""
        nbytes = max(0, need.nbytes)
        copy = 0.0 if tier == "device" else nbytes * self.copy_s_per_byte
        read = nbytes * self.read_s_per_byte
        return (read if tier == "disk" else read / 2 if tier == "arriving" else 0.0), copy

    def cost(
        self,
        needs: Iterable[AdapterNeed],
        where: AdapterResidency,
        queued_s: float,
        step_s: float,
        num_steps: int,
    ) -> float:
        """Seconds the adapters ``needs`` hold a job on W beyond its own work (module
        docstring): the reads not hidden by ``queued_s`` (its time in W's queue) plus the copies,
        less what its first K steps of ``step_s`` each hide."""
        read = copy = 0.0
        seen: set[str] = set()
        for need in needs:
            if need.sha256 in seen:
                continue
            seen.add(need.sha256)
            r, c = self.load_s(need, self.tier(need.sha256, where))
            read, copy = read + r, copy + c
        if read == 0.0 and copy == 0.0:
            return 0.0
        k = join_deadline(num_steps, self.join_by)  # the worker's own deadline
        return max(0.0, max(0.0, read - queued_s) + copy - k * step_s)

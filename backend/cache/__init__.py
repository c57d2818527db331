"""Tiered activation cache: host RAM above the on-disk template caches.

``manager`` and ``policies`` are the pure core (no torch, no I/O); ``store`` is the shell that
executes their decisions on files and tensors. The shell's names are imported on first use so
that importing the core never pulls in torch.
"""

from backend.cache.manager import (
    CacheManager,
    CacheMetrics,
    DeleteFromDisk,
    DropFromRam,
    EntryState,
    Eviction,
    LoadPlan,
    Residency,
    SpillToDisk,
    StorePlan,
    Tier,
)
from backend.cache.policies import POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy, PolicyFactory

_SHELL = ("MemoryTemplateCache", "TieredActivationCache")

__all__ = [
    "CacheManager",
    "CacheMetrics",
    "DeleteFromDisk",
    "DropFromRam",
    "EntryState",
    "Eviction",
    "LoadPlan",
    "Residency",
    "SpillToDisk",
    "StorePlan",
    "Tier",
    "POLICIES",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PolicyFactory",
    *_SHELL,
]


def __getattr__(name: str):
    if name in _SHELL:
        from backend.cache import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Tiered activation cache: device memory above host RAM above the on-disk template caches.

``manager`` and ``policies`` are the pure core (no torch, no I/O), with ``plans`` (what the
manager decides, as data), ``metrics`` (its counters) and ``budgets`` (the tiers' automatic
budgets); ``store`` is the shell that executes their decisions on files and tensors
(``memory_entry``: an entry held in RAM or on the device). The shell's names are imported on first
use so that importing the core never pulls in torch.
"""

from backend.cache.manager import (
    CacheManager,
    CacheMetrics,
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
from backend.cache.policies import POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy, PolicyFactory

# name -> the shell module that defines it
_SHELL = {"MemoryTemplateCache": "memory_entry", "TieredActivationCache": "store"}

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
        import importlib

        return getattr(importlib.import_module(f"backend.cache.{_SHELL[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

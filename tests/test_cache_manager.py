"""The cache manager and its eviction policies: pure bookkeeping, no torch, no files."""

from __future__ import annotations

import random

import pytest

from backend.cache.manager import (
    TIERS,
    CacheManager,
    DeleteFromDisk,
    DemoteToRam,
    DropFromDevice,
    DropFromRam,
    Residency,
    SpillToDisk,
    Tier,
)
from backend.cache.policies import POLICIES, LFUPolicy, LRUPolicy


def _manager(
    ram: int = 100, disk: int = 1000, policy: str = "lru", device: int = 0
) -> CacheManager:
    return CacheManager(ram, disk, POLICIES[policy], device)


def _stored(manager: CacheManager, entry_id: str, size: int, tier: Tier = Tier.DISK):
    plan = manager.prepare_store(entry_id, size, tier)
    assert plan.ok, plan.reason
    manager.complete_store(entry_id, ok=True)
    return plan


def _loaded(manager: CacheManager, entry_id: str):
    plan = manager.prepare_load(entry_id)
    assert plan is not None and plan.ok
    manager.complete_load(entry_id, ok=True)
    return plan


def _promoted(manager: CacheManager, entry_id: str, for_queued_job: bool = False):
    plan = manager.plan_promotion(entry_id, for_queued_job)
    assert plan is not None
    manager.complete_promotion(entry_id, ok=True)
    return plan


def _in_ram(manager: CacheManager, *entry_ids: str, size: int = 60) -> None:
    for entry_id in entry_ids:
        _stored(manager, entry_id, size)
        _loaded(manager, entry_id)


# ----- scenarios ----------------------------------------------------------------------------------
def test_store_then_load_promotes_to_ram_and_counts_hits():
    manager = _manager()
    _stored(manager, "a", 40)
    assert manager.lookup("a") is Residency.DISK
    plan = manager.prepare_load("a")
    assert plan.ok and plan.evictions == () and manager.used_bytes[Tier.RAM] == 40
    assert manager.lookup("a") is Residency.LOADING  # reserved, not yet readable from RAM
    manager.complete_load("a", ok=True)
    assert manager.lookup("a") is Residency.RAM and manager.lookup("zz") is Residency.MISS
    assert manager.resident(Tier.RAM) == ["a"] and manager.resident(Tier.DISK) == ["a"]
    m = manager.metrics
    assert (m.ram_hits, m.ram_misses, m.disk_hits, m.disk_misses, m.load_waits) == (1, 3, 1, 1, 1)
    assert m.bytes_loaded == 40 and manager.prepare_load("a") is None


def test_failed_load_returns_its_reservation():
    manager = _manager()
    _stored(manager, "a", 40)
    manager.prepare_load("a")
    manager.complete_load("a", ok=False)
    assert manager.used_bytes[Tier.RAM] == 0 and manager.lookup("a") is Residency.DISK


def test_ram_eviction_drops_copies_of_disk_entries():
    manager = _manager(ram=100)
    for entry_id in ("a", "b"):
        _stored(manager, entry_id, 60)
    _loaded(manager, "a")
    plan = _loaded(manager, "b")
    assert plan.evictions == (DropFromRam("a"),)
    assert manager.lookup("a") is Residency.DISK and manager.metrics.ram_evictions == 1


def test_ram_only_entry_spills_to_disk_evicting_the_coldest_disk_entry():
    manager = _manager(ram=100, disk=100)
    _stored(manager, "cold", 50, Tier.DISK)
    _stored(manager, "a", 60, Tier.RAM)
    plan = _stored(manager, "b", 60, Tier.RAM)
    assert plan.evictions == (DeleteFromDisk("cold"), SpillToDisk("a", 60))  # deletions run first
    assert manager.lookup("a") is Residency.DISK and manager.lookup("cold") is Residency.MISS
    assert manager.metrics.bytes_spilled == 60 and manager.metrics.disk_evictions == 1


def test_spill_that_cannot_fit_on_disk_drops_the_entry():
    manager = _manager(ram=100, disk=50)
    _stored(manager, "a", 60, Tier.RAM)
    plan = _stored(manager, "b", 60, Tier.RAM)
    assert plan.evictions == (DropFromRam("a"),)
    assert manager.lookup("a") is Residency.MISS


def test_disk_deletion_keeps_ram_copy_which_spills_back_later():
    manager = _manager(ram=200, disk=100)
    _stored(manager, "a", 60, Tier.BOTH)
    plan = _stored(manager, "b", 60, Tier.DISK)
    assert plan.evictions == (DeleteFromDisk("a"),)
    assert manager.lookup("a") is Residency.RAM and manager.resident(Tier.DISK) == ["b"]
    plan = _stored(manager, "c", 150, Tier.RAM)
    assert plan.evictions == (DeleteFromDisk("b"), SpillToDisk("a", 60))
    assert manager.lookup("a") is Residency.DISK


def test_prefetch_lead_time_is_recorded_at_first_lookup():
    manager = _manager()
    _stored(manager, "a", 40)
    manager.prepare_load("a", prefetch_at=10.0)
    manager.complete_load("a", ok=True)
    manager.lookup("a", now=10.5)
    manager.lookup("a", now=12.0)  # only the first use counts
    snapshot = manager.metrics.snapshot()
    assert snapshot["prefetches"] == 1 and snapshot["prefetch_uses"] == 1
    assert (
        snapshot["prefetch_lead_s_p50"] == pytest.approx(0.5) and "prefetch_lead_s" not in snapshot
    )


def test_a_speculative_prefetch_spares_entries_prefetched_for_earlier_jobs():
    manager = _manager(ram=100)
    for entry_id in "abc":
        _stored(manager, entry_id, 50)
    for entry_id, at in (("a", 1.0), ("b", 2.0)):  # prefetched for two queued jobs, not used yet
        manager.prepare_load(entry_id, prefetch_at=at)
        manager.complete_load(entry_id, ok=True)
    assert not manager.prepare_load("c", prefetch_at=3.0, spare_prefetched=True).ok  # a third job's
    assert manager.residency("a") is Residency.RAM and manager.residency("b") is Residency.RAM
    manager.lookup("a", now=4.0)  # a's job ran: a is an ordinary resident now
    plan = manager.prepare_load("c", prefetch_at=5.0, spare_prefetched=True)
    assert plan.ok and plan.evictions == (DropFromRam("a"),)
    manager.complete_load("c", ok=True)
    plan = manager.prepare_load("a", prefetch_at=6.0)  # not speculative (a row's turn): may take b
    assert plan.ok and plan.evictions == (DropFromRam("b"),)


def test_fits_ram_tells_an_entry_that_never_fits_from_one_waiting_for_room():
    manager = _manager(ram=100)
    _stored(manager, "small", 60)
    _stored(manager, "large", 150)
    _loaded(manager, "small")
    manager.pin("small")
    _stored(manager, "other", 60)
    # room once "small" is released
    assert not manager.prepare_load("other").ok and manager.fits_ram("other")
    assert not manager.prepare_load("large").ok and not manager.fits_ram("large")
    assert not manager.fits_ram("unknown")


def test_an_entry_another_process_deleted_from_disk():
    manager = _manager(ram=100, disk=1000)
    for entry_id in ("in_ram", "on_disk", "read_lazily"):
        _stored(manager, entry_id, 40)
    _loaded(manager, "in_ram")
    manager.pin("read_lazily")
    for entry_id in ("in_ram", "on_disk", "read_lazily"):
        manager.disk_gone(entry_id)
    assert manager.residency("in_ram") is Residency.RAM and manager.resident(Tier.DISK) == [
        "read_lazily"
    ]
    assert manager.residency("on_disk") is Residency.MISS and manager.used_bytes[Tier.DISK] == 40
    assert manager.metrics.corrupt_entries == 0  # not damage: nothing to report
    assert manager.prepare_store("on_disk", 40, Tier.DISK).ok  # recorded again from scratch


def test_a_use_by_another_process_ranks_the_entry_as_just_used():
    manager = _manager(disk=100)
    manager.register_disk("a", 50)
    manager.register_disk("b", 50)
    manager.touch("a")  # another worker edited a: b is now the coldest
    assert manager.register_disk("c", 50) == (DeleteFromDisk("b"),)


def test_forget_releases_bytes_pins_and_in_flight_loads():
    manager = _manager()
    _stored(manager, "a", 40)
    manager.pin("a")
    manager.prepare_load("a")
    manager.forget("a", corrupt=True)
    assert set(manager.used_bytes.values()) == {0} and manager.lookup("a") is Residency.MISS
    manager.complete_load("a", ok=True)  # the load finishing later changes nothing
    manager.unpin("a")
    assert manager.entries() == [] and manager.metrics.corrupt_entries == 1


def test_failed_store_leaves_nothing():
    manager = _manager()
    manager.prepare_store("a", 40, Tier.BOTH)
    assert manager.lookup("a") is Residency.MISS  # not readable while being stored
    manager.complete_store("a", ok=False)
    assert manager.entries() == [] and set(manager.used_bytes.values()) == {0}
    assert manager.metrics.store_failures == 1


def test_a_recording_settles_its_reservation_at_its_real_size():
    manager = _manager(disk=100)
    _stored(manager, "old", 30)
    assert manager.prepare_store("rec", 60, Tier.DISK).ok  # an upper bound, before the first byte
    assert manager.storing("rec") and manager.known("rec") and not manager.storing("old")
    shrunk = manager.settle_store("rec", 40)
    assert shrunk.ok and shrunk.evictions == () and manager.used_bytes[Tier.DISK] == 70
    manager.complete_store("rec", ok=True)
    assert sorted(manager.resident(Tier.DISK)) == ["old", "rec"]
    manager.prepare_store("grows", 20, Tier.DISK)
    grown = manager.settle_store("grows", 50)  # larger than reserved: evicts the coldest
    assert grown.ok and grown.evictions == (DeleteFromDisk("old"),)
    manager.prepare_store("huge", 10, Tier.DISK)
    manager.pin("rec")
    refused = manager.settle_store("huge", 60)  # "rec" is in use: nothing makes room
    assert not refused.ok and not manager.known("huge") and manager.used_bytes[Tier.DISK] == 90
    with pytest.raises(ValueError, match="no store in flight"):
        manager.settle_store("rec", 10)


def test_an_abandoned_recording_returns_its_reservation_without_a_failure():
    manager = _manager(disk=100)
    manager.prepare_store("rec", 60, Tier.DISK)
    manager.abandon_store("rec")
    assert manager.entries() == [] and manager.used_bytes[Tier.DISK] == 0
    assert manager.metrics.store_failures == 0
    _stored(manager, "done", 10)
    manager.abandon_store("done")  # not in flight: a no-op
    assert manager.resident(Tier.DISK) == ["done"]


def test_too_big_plans_fail_without_side_effects():
    manager = _manager(ram=100, disk=100)
    _stored(manager, "a", 50, Tier.BOTH)
    plan = manager.prepare_store("big", 101, Tier.DISK)
    assert not plan.ok and "DISK" in plan.reason and plan.evictions == ()
    assert not manager.prepare_store("big", 101, Tier.RAM).ok
    assert manager.resident(Tier.RAM) == ["a"] and manager.used_bytes[Tier.DISK] == 50
    manager = _manager(ram=10, disk=100)
    _stored(manager, "a", 50)
    assert not manager.prepare_load("a").ok and manager.used_bytes[Tier.RAM] == 0


def test_pinned_and_busy_entries_are_never_evicted():
    manager = _manager(ram=100, disk=100)
    _stored(manager, "a", 60, Tier.BOTH)
    manager.pin("a")
    assert not manager.prepare_store("b", 60, Tier.RAM).ok
    assert not manager.prepare_store("b", 60, Tier.DISK).ok
    manager.unpin("a")
    assert manager.prepare_store("b", 60, Tier.RAM).ok  # "b" now reserves RAM while being stored
    assert not manager.prepare_store("c", 60, Tier.RAM).ok


def test_register_disk_keeps_the_budget():
    manager = _manager(disk=100)
    assert manager.register_disk("old", 60) == ()
    assert manager.register_disk("new", 60) == (DeleteFromDisk("old"),)
    assert manager.register_disk("huge", 200) == (DeleteFromDisk("huge"),)
    assert manager.register_disk("new", 60) == ()  # idempotent
    assert manager.resident(Tier.DISK) == ["new"]


def test_misuse_is_reported():
    manager = _manager()
    _stored(manager, "a", 10)
    with pytest.raises(ValueError, match="already exists"):
        manager.prepare_store("a", 10, Tier.DISK)
    with pytest.raises(ValueError, match="not pinned"):
        manager.unpin("a")
    with pytest.raises(KeyError):
        manager.pin("missing")
    with pytest.raises(ValueError):
        CacheManager(-1, 10)


# ----- the device tier ----------------------------------------------------------------------------
def test_a_device_tier_that_is_off_never_promotes_nor_counts():
    manager = _manager()
    _in_ram(manager, "a")
    assert manager.plan_promotion("a") is None and manager.plan_promotion("a", True) is None
    assert manager.lookup("a") is Residency.RAM and manager.release_device(100).released_bytes == 0
    snapshot = manager.metrics.snapshot()
    assert snapshot["device_hits"] == snapshot["device_misses"] == snapshot["device_bytes"] == 0
    assert snapshot["ram_hits"] == 1 and snapshot["ram_hit_rate"] == 1.0


def test_promotion_copies_a_ram_entry_to_the_device_which_then_serves_it():
    manager = _manager(device=100)
    _in_ram(manager, "a")
    assert manager.plan_promotion("missing") is None
    _stored(manager, "on_disk_only", 10)
    assert manager.plan_promotion("on_disk_only") is None  # promotion copies the RAM copy
    plan = manager.plan_promotion("a")
    assert plan is not None and plan.size_bytes == 60 and plan.evictions == ()
    assert manager.used_bytes[Tier.DEVICE] == 60 and manager.metrics.device_bytes == 60
    assert manager.lookup("a") is Residency.RAM  # readable from the device only once copied
    assert manager.plan_promotion("a") is None  # a copy in flight
    manager.complete_promotion("a", ok=True)
    assert manager.lookup("a") is Residency.DEVICE and manager.resident(Tier.DEVICE) == ["a"]
    assert manager.acquirable_now("a") and manager.plan_promotion("a") is None
    assert manager.prepare_load("a") is None and manager.resident(Tier.RAM) == ["a"]
    m = manager.metrics
    assert (m.device_hits, m.device_misses, m.ram_hits, m.bytes_promoted) == (1, 1, 1, 60)
    assert m.snapshot()["device_hit_rate"] == 0.5


def test_a_failed_promotion_returns_its_reservation():
    manager = _manager(device=100)
    _in_ram(manager, "a")
    manager.plan_promotion("a")
    manager.complete_promotion("a", ok=False)
    assert manager.used_bytes[Tier.DEVICE] == 0 and manager.lookup("a") is Residency.RAM
    assert manager.metrics.bytes_promoted == 0


def test_demotion_drops_the_device_copy_while_ram_keeps_one():
    manager = _manager(ram=200, device=100)
    _in_ram(manager, "a", "b")
    _promoted(manager, "a")
    assert _promoted(manager, "b").evictions == (DropFromDevice("a"),)
    assert manager.lookup("a") is Residency.RAM and manager.metrics.device_evictions == 1


def test_ram_drops_its_copy_of_a_device_entry_and_demotion_copies_it_back():
    manager = _manager(ram=100, device=100)
    _in_ram(manager, "a")
    _promoted(manager, "a")
    _stored(manager, "b", 60)
    assert _loaded(manager, "b").evictions == (DropFromRam("a"),)
    assert manager.lookup("a") is Residency.DEVICE and manager.resident(Tier.RAM) == ["b"]
    release = manager.release_device(1)  # under pressure: RAM makes room for it first
    assert release.released_bytes == 60
    assert release.evictions == (DropFromRam("b"), DemoteToRam("a", 60))
    assert manager.lookup("a") is Residency.RAM and manager.budget_bytes[Tier.DEVICE] == 40
    assert manager.metrics.device_budget_bytes == 40 and manager.metrics.device_bytes == 0


def test_demotion_without_room_in_ram_drops_the_copy_of_a_disk_entry():
    manager = _manager(ram=100, device=100)
    _in_ram(manager, "a")
    _promoted(manager, "a")
    _stored(manager, "b", 60)
    _loaded(manager, "b")
    manager.pin("b")  # RAM cannot make room
    assert manager.release_device(60).evictions == (DropFromDevice("a"),)
    assert manager.lookup("a") is Residency.DISK


def test_a_device_only_entry_neither_ram_nor_disk_can_take_is_lost():
    manager = _manager(ram=100, disk=50, device=100)
    _stored(manager, "a", 60, Tier.RAM)  # not on disk
    _promoted(manager, "a")
    # RAM evicts it and the disk cannot take it: the device copy is the only one left
    assert _stored(manager, "b", 60, Tier.RAM).evictions == (DropFromRam("a"),)
    assert manager.lookup("a") is Residency.DEVICE
    manager.pin("b")
    assert manager.release_device(60).evictions == (DropFromDevice("a"),)
    assert manager.lookup("a") is Residency.MISS and manager.entries()[0].entry_id == "b"


def test_a_disk_deletion_keeps_a_device_copy():
    manager = _manager(ram=100, device=100)
    _in_ram(manager, "a")
    _promoted(manager, "a")
    _stored(manager, "b", 60)
    _loaded(manager, "b")  # RAM drops a: on the device and on disk
    manager.disk_gone("a")
    assert manager.lookup("a") is Residency.DEVICE and manager.resident(Tier.DISK) == ["b"]


def test_pinned_and_copying_device_entries_are_never_evicted():
    manager = _manager(ram=200, device=60)
    _in_ram(manager, "a", "b")
    _promoted(manager, "a")
    manager.pin("a")
    assert manager.plan_promotion("b") is None  # the device is full of an entry in use
    assert manager.release_device(60).released_bytes == 0
    manager.unpin("a")
    assert _promoted(manager, "b").evictions == (DropFromDevice("a"),)
    _stored(manager, "c", 10)
    manager.plan_promotion("b")  # no-op: on the device already
    assert manager.release_device(60).evictions == (DropFromDevice("b"),)
    assert manager.budget_bytes[Tier.DEVICE] == 0 and manager.plan_promotion("a") is None


def test_promotions_spare_entries_promoted_for_queued_jobs():
    manager = _manager(ram=300, device=120)
    _in_ram(manager, "a", "b", "c")
    _promoted(manager, "a", for_queued_job=True)
    _promoted(manager, "b", for_queued_job=True)
    assert manager.plan_promotion("c") is None  # both rows still queued: theirs come first
    manager.lookup("a")  # a's row ran: an ordinary resident now
    assert _promoted(manager, "c").evictions == (DropFromDevice("a"),)
    # under pressure an entry promoted for a queued job is given back too
    assert manager.release_device(120).released_bytes == 120


def _hot_then_cold_on_the_device(policy: str) -> CacheManager:
    manager = _manager(ram=1000, device=60, policy=policy)
    for entry_id in ("hot", "cold1", "cold2", "new"):
        _in_ram(manager, entry_id, size=20)
    _promoted(manager, "hot")
    for _ in range(5):
        manager.lookup("hot")
    for entry_id in ("cold1", "cold2"):
        _promoted(manager, entry_id)
    return manager


@pytest.mark.parametrize(("policy", "victim"), [("lru", "hot"), ("lfu", "cold1")])
def test_the_device_tier_evicts_in_its_policys_order(policy, victim):
    manager = _hot_then_cold_on_the_device(policy)
    assert _promoted(manager, "new").evictions == (DropFromDevice(victim),)


def test_the_device_tier_is_filled_by_promotion_only():
    with pytest.raises(ValueError, match="promotion"):
        _manager(device=100).prepare_store("a", 10, Tier.DEVICE)
    with pytest.raises(ValueError):
        CacheManager(10, 10, device_budget_bytes=-1)


# ----- invariants under random operation sequences ------------------------------------------------
class _Shell:
    """A model shell: executes plans on two sets, asserting every action is valid when it runs."""

    def __init__(self, manager: CacheManager):
        self.manager, self.ram, self.disk, self.device = manager, set(), set(), set()
        self.pins: dict[str, int] = {}
        self.loads: set[str] = set()
        self.promotions: set[str] = set()
        self.stores: dict[str, Tier] = {}

    def execute(self, evictions, busy_before: set[str]) -> None:
        for action in evictions:
            assert action.entry_id not in busy_before, f"evicted a busy entry: {action}"
            if isinstance(action, DeleteFromDisk):
                self.disk.remove(action.entry_id)
            elif isinstance(action, DropFromRam):
                self.ram.remove(action.entry_id)
            elif isinstance(action, DropFromDevice):
                self.device.remove(action.entry_id)
            elif isinstance(action, DemoteToRam):
                self.device.remove(action.entry_id)
                assert action.entry_id not in self.ram
                self.ram.add(action.entry_id)
            else:
                self.ram.remove(action.entry_id)
                self.disk.add(action.entry_id)

    def forget(self, entry_id: str) -> None:
        self.manager.forget(entry_id)
        self.ram.discard(entry_id)
        self.disk.discard(entry_id)
        self.device.discard(entry_id)
        self.pins.pop(entry_id, None)
        self.loads.discard(entry_id)
        self.promotions.discard(entry_id)
        self.stores.pop(entry_id, None)


def _busy(manager: CacheManager) -> set[str]:
    return {e.entry_id for e in manager.entries() if e.busy}


def _random_op(shell: _Shell, rng: random.Random) -> None:
    manager, ids = shell.manager, [f"e{i}" for i in range(12)]
    entry_id, busy = rng.choice(ids), _busy(manager)
    op = rng.choice(
        [
            "store",
            "lookup",
            "load",
            "finish_load",
            "finish_store",
            "settle_store",
            "abandon_store",
            "pin",
            "unpin",
            "forget",
            "touch",
            "disk_gone",
            "promote",
            "finish_promotion",
            "release_device",
        ]
    )
    residency = manager.residency(entry_id)
    if op == "store" and entry_id not in {e.entry_id for e in manager.entries()}:
        tier = rng.choice([Tier.RAM, Tier.DISK, Tier.BOTH])
        plan = manager.prepare_store(entry_id, rng.randint(1, 120), tier)
        if plan.ok:
            shell.execute(plan.evictions, busy)
            shell.stores[entry_id] = tier
    elif op == "lookup":
        manager.lookup(entry_id, now=rng.random())
    elif op == "load":
        plan = manager.prepare_load(
            entry_id, prefetch_at=rng.choice([None, 0.0]), spare_prefetched=rng.random() < 0.5
        )
        if plan is not None and plan.ok:
            shell.execute(plan.evictions, busy)
            shell.loads.add(entry_id)
    elif op == "finish_load" and shell.loads:
        done = rng.choice(sorted(shell.loads))
        ok = rng.random() < 0.8
        manager.complete_load(done, ok)
        shell.loads.discard(done)
        if ok:
            shell.ram.add(done)
    elif op == "finish_store" and shell.stores:
        done = rng.choice(sorted(shell.stores))
        tier, ok = shell.stores.pop(done), rng.random() < 0.8
        manager.complete_store(done, ok)
        if ok:
            shell.ram |= {done} if Tier.RAM in tier else set()
            shell.disk |= {done} if Tier.DISK in tier else set()
    elif op == "settle_store" and shell.stores:  # a recording learns its real size
        done = rng.choice(sorted(shell.stores))
        plan = manager.settle_store(done, rng.randint(1, 120))
        if plan.ok:
            shell.execute(plan.evictions, busy)
        else:
            shell.stores.pop(done)
    elif op == "abandon_store" and shell.stores:  # a recording aborted
        done = rng.choice(sorted(shell.stores))
        manager.abandon_store(done)
        shell.stores.pop(done)
    elif op == "pin" and residency is not Residency.MISS:
        manager.pin(entry_id)
        shell.pins[entry_id] = shell.pins.get(entry_id, 0) + 1
    elif op == "unpin" and shell.pins.get(entry_id):
        manager.unpin(entry_id)
        shell.pins[entry_id] -= 1
    elif op == "forget" and rng.random() < 0.3:
        shell.forget(entry_id)
    elif op == "promote":
        promotion = manager.plan_promotion(entry_id, for_queued_job=rng.random() < 0.3)
        if promotion is not None:
            assert entry_id in shell.ram and entry_id not in shell.device
            shell.execute(promotion.evictions, busy)
            shell.promotions.add(entry_id)
    elif op == "finish_promotion" and shell.promotions:
        done = rng.choice(sorted(shell.promotions))
        ok = rng.random() < 0.9
        manager.complete_promotion(done, ok)
        shell.promotions.discard(done)
        if ok:
            shell.device.add(done)
    elif op == "release_device" and rng.random() < 0.05:  # device memory pressure
        budget = manager.budget_bytes[Tier.DEVICE]
        release = manager.release_device(rng.randint(1, 80))
        shell.execute(release.evictions, busy)
        assert manager.budget_bytes[Tier.DEVICE] == budget - release.released_bytes
    elif op == "touch":  # another process sharing the disk tier used it
        manager.touch(entry_id)
    # another process deleted it
    elif op == "disk_gone" and entry_id in shell.disk and rng.random() < 0.05:
        held, busy = entry_id in shell.ram or entry_id in shell.device, entry_id in busy
        manager.disk_gone(entry_id)
        if held or not busy:  # a busy disk-only entry is left to its reader
            shell.disk.discard(entry_id)


def _check_invariants(shell: _Shell) -> None:
    manager = shell.manager
    entries = manager.entries()
    for tier in TIERS:
        held = sum(e.size_bytes for e in entries if e.holds(tier))
        assert manager.used_bytes[tier] == held <= manager.budget_bytes[tier]
        # each tier's policy tracks exactly its residents: it picks a victim among them only
        residents = manager.resident(tier)
        if residents:
            assert manager._policies[tier].choose_victim(residents) in residents
    assert set(manager.resident(Tier.RAM)) == shell.ram
    assert set(manager.resident(Tier.DISK)) == shell.disk
    assert set(manager.resident(Tier.DEVICE)) == shell.device
    assert manager.metrics.device_bytes == manager.used_bytes[Tier.DEVICE]
    for entry in entries:
        assert entry.pins == shell.pins.get(entry.entry_id, 0)
        if entry.storing:
            assert manager.residency(entry.entry_id) is Residency.MISS
        if entry.loading:
            assert manager.residency(entry.entry_id) is Residency.LOADING
        if entry.promoting:  # readable from RAM until its copy completed
            assert manager.residency(entry.entry_id) is Residency.RAM


@pytest.mark.parametrize("device_tier", [False, True])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(4))
def test_random_walk_keeps_every_invariant(policy, seed, device_tier):
    rng = random.Random(seed)
    ram, disk = rng.randint(100, 300), rng.randint(150, 400)
    device = rng.randint(150, 300) if device_tier else 0
    shell = _Shell(CacheManager(ram, disk, POLICIES[policy], device))
    for _ in range(3000):
        _random_op(shell, rng)
        _check_invariants(shell)
    metrics = shell.manager.metrics
    # the walk did exercise eviction
    assert metrics.ram_evictions > 0 and metrics.disk_evictions > 0
    if device_tier:
        assert metrics.device_evictions > 0 and metrics.device_hits > 0
    else:  # the tier off: the two-tier cache it was
        assert shell.device == set() and metrics.device_misses == metrics.bytes_promoted == 0


# ----- policy contract: every policy, same expectations -------------------------------------------
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policy_chooses_only_tracked_candidates(policy):
    ranking = POLICIES[policy]()
    for entry_id in "abcd":
        ranking.on_insert(entry_id, 10)
    ranking.on_access("c")
    ranking.on_remove("a")
    seen = set()
    for _ in range(3):
        victim = ranking.choose_victim(["a", "b", "c", "d"][1:])
        assert victim in {"b", "c", "d"}
        ranking.on_remove(victim)
        seen.add(victim)
    assert seen == {"b", "c", "d"}
    with pytest.raises(ValueError):
        ranking.choose_victim(["a"])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_frees_enough_and_spares_pinned(policy):
    manager = _manager(ram=100, disk=1000, policy=policy)
    for entry_id in "abcde":
        _stored(manager, entry_id, 20, Tier.BOTH)
        manager.lookup(entry_id)
    manager.pin("a")
    plan = _stored(manager, "big", 60, Tier.RAM)
    assert len(plan.evictions) == 3 and DropFromRam("a") not in plan.evictions
    assert manager.used_bytes[Tier.RAM] <= 100 and manager.lookup("a") is Residency.RAM


# ----- policy specifics ---------------------------------------------------------------------------
def test_lru_evicts_least_recently_used():
    ranking = LRUPolicy()
    for entry_id in "abc":
        ranking.on_insert(entry_id, 1)
    ranking.on_access("a")
    assert ranking.choose_victim("abc") == "b"
    assert ranking.choose_victim("ac") == "c"


def _hot_then_cold(policy: str) -> CacheManager:
    manager = _manager(ram=60, disk=1000, policy=policy)
    _stored(manager, "hot", 20, Tier.BOTH)
    for _ in range(5):
        manager.lookup("hot")
    for entry_id in ("cold1", "cold2"):
        _stored(manager, entry_id, 20, Tier.BOTH)
    return manager


def test_frequency_aware_policy_keeps_a_hot_entry_that_lru_evicts():
    assert _stored(_hot_then_cold("lru"), "new", 20, Tier.RAM).evictions == (DropFromRam("hot"),)
    assert _stored(_hot_then_cold("lfu"), "new", 20, Tier.RAM).evictions == (DropFromRam("cold1"),)


def test_lfu_ages_out_an_entry_that_stopped_being_used():
    ranking = LFUPolicy()
    ranking.on_insert("hot", 1)
    for _ in range(3):
        ranking.on_access("hot")
    for round_ in range(10):
        ranking.on_insert(f"new{round_}", 1)
        victim = ranking.choose_victim(["hot", f"new{round_}"])
        ranking.on_remove(victim)
        if victim == "hot":
            break
    else:
        pytest.fail("a formerly hot entry was never evicted: no aging")

"""The tiered cache's device tier over real entries, with CPU tensors standing in for the device:
promotion on a hit and on a queued job's prefetch, steps that read a resident template's cache
without touching host memory, demotion, and memory given back under pressure."""

from __future__ import annotations

import pytest
import torch

from backend.cache import MemoryTemplateCache, Tier, TieredActivationCache
from backend.cache.budgets import batch_activation_bytes, choose_device_budget
from backend.config import load_settings
from backend.costmodel.costs import UnitShape
from backend.engine.feeder import BatchCacheFeeder, RowCacheRef
from backend.worker.cache_budget import device_cache_budget
from tests.test_cache_store import NUM_UNITS, _key, _record, _same_tensors

CPU = torch.device("cpu")
GB = 1 << 30


@pytest.fixture
def entry_bytes(tmp_path_factory) -> int:
    return _record(tmp_path_factory.mktemp("probe"), 0).bytes_total


def _open(root, entry_bytes: int, device_entries: float, ram_entries: float = 4):
    return TieredActivationCache(
        root,
        int(ram_entries * entry_bytes),
        1 << 30,
        device_budget_bytes=int(device_entries * entry_bytes),
        device=CPU,
    )


def _promoted(cache: TieredActivationCache, n: int) -> MemoryTemplateCache:
    """Acquire ``n`` once (a hit in RAM starts its promotion), then the device copy."""
    cache.acquire(_key(n))
    cache.release(_key(n))
    cache.wait_for_loads()
    handle = cache.acquire(_key(n))
    assert handle is not None and handle.device == CPU, "not promoted"
    return handle


def _feed(handle, step: int = 1) -> tuple[BatchCacheFeeder, list[torch.Tensor]]:
    """One step's reads of every unit's K and V of ``handle``, as the engine makes them."""
    feeder = BatchCacheFeeder([RowCacheRef(handle, step, 0)], range(NUM_UNITS), "kv", CPU)
    return feeder, [feeder.rows_tensor(u, n, (0, 1)) for u in range(NUM_UNITS) for n in "kv"]


def test_a_step_of_a_device_resident_template_reads_no_host_memory(
    tmp_path, entry_bytes, monkeypatch
):
    disk = _record(tmp_path, 1)
    cache = _open(tmp_path, entry_bytes, device_entries=2)
    in_ram = cache.acquire(_key(1))  # read from disk into RAM; the promotion starts behind it
    cache.release(_key(1))
    cache.wait_for_loads()
    assert in_ram.device is None and cache.resident(Tier.DEVICE) == [_key(1).digest()]
    on_device = cache.acquire(_key(1))
    assert on_device is not in_ram and _same_tensors(on_device, disk)

    host_feeder, host_reads = _feed(in_ram)
    assert host_feeder.bytes_loaded > 0  # a host copy is copied to the device every step

    def host_read(*args):
        raise AssertionError("a step of a device-resident template read the host copy")

    monkeypatch.setattr(in_ram, "step_tensor", host_read)
    monkeypatch.setattr(in_ram, "trajectory", host_read)
    feeder, reads = _feed(on_device)
    assert feeder.bytes_loaded == 0 and all(map(torch.equal, reads, host_reads))
    m = cache.metrics
    assert (m.device_hits, m.device_misses, m.bytes_promoted) == (1, 1, disk.bytes_total)
    assert m.device_bytes == disk.bytes_total


def test_device_copies_are_copies_of_their_own(tmp_path, entry_bytes):
    _record(tmp_path, 1)
    cache = _open(tmp_path, entry_bytes, device_entries=1)
    in_ram = cache.acquire(_key(1))
    cache.release(_key(1))
    on_device = _promoted(cache, 1)
    # the device tier's bytes are real: no tensor shares the RAM copy's storage
    assert on_device.step_tensor(0, 0, "k").data_ptr() != in_ram.step_tensor(0, 0, "k").data_ptr()


def test_a_queued_jobs_prefetch_promotes_its_template(tmp_path, entry_bytes):
    for n in (1, 2):
        _record(tmp_path, n)
    cache = _open(tmp_path, entry_bytes, device_entries=2)
    cache.prefetch(_key(1))  # on disk: read into RAM, then copied to the device
    cache.acquire(_key(2))  # in RAM now, not yet on the device
    cache.release(_key(2))
    cache.wait_for_loads()
    cache.prefetch(_key(2))  # in RAM: copied to the device at once
    cache.wait_for_loads()
    assert sorted(cache.resident(Tier.DEVICE)) == sorted([_key(1).digest(), _key(2).digest()])
    assert cache.ready(_key(1)) and cache.acquire(_key(1)).device == CPU


def test_the_device_budget_demotes_the_coldest_template(tmp_path, entry_bytes):
    for n in (1, 2):
        _record(tmp_path, n)
    cache = _open(tmp_path, entry_bytes, device_entries=1.5)
    _promoted(cache, 1)
    cache.release(_key(1))
    _promoted(cache, 2)
    assert cache.resident(Tier.DEVICE) == [_key(2).digest()]
    assert cache.acquire(_key(1)).device is None  # back to its RAM copy
    assert cache.metrics.device_evictions == 1


def test_release_device_bytes_gives_memory_back_and_keeps_entries_readable(tmp_path, entry_bytes):
    disk = {n: _record(tmp_path, n) for n in (1, 2)}
    cache = _open(tmp_path, entry_bytes, device_entries=2, ram_entries=1)
    for n in (1, 2):
        _promoted(cache, n)
        cache.release(_key(n))
    # RAM holds one entry: it dropped its copy of 1, which the device keeps
    assert cache.resident(Tier.RAM) == [_key(2).digest()] and len(cache.resident(Tier.DEVICE)) == 2
    # the coldest, 1, is demoted: copied back to RAM, which drops its copy of 2 (on the device)
    assert cache.release_device_bytes(1) == entry_bytes
    assert cache.resident(Tier.DEVICE) == [_key(2).digest()]
    assert cache.resident(Tier.RAM) == [_key(1).digest()]
    assert cache.acquire(_key(2)).device == CPU  # pinned: nothing left to give back
    assert cache.release_device_bytes(entry_bytes) == 0
    assert cache.metrics.device_budget_bytes == entry_bytes  # the memory given back stays so
    handle = cache.acquire(_key(1))  # no room on the device while 2 is in use: read from RAM
    cache.wait_for_loads()
    assert handle.device is None and _same_tensors(handle, disk[1])
    assert cache.resident(Tier.DEVICE) == [_key(2).digest()]


def test_without_a_device_budget_nothing_is_promoted(tmp_path, entry_bytes):
    _record(tmp_path, 1)
    cache = _open(tmp_path, entry_bytes, device_entries=0)
    for _ in range(2):
        assert cache.acquire(_key(1)).device is None
        cache.release(_key(1))
        cache.wait_for_loads()
    cache.prefetch(_key(1))
    cache.wait_for_loads()
    assert cache.resident(Tier.DEVICE) == [] and cache.metrics.device_misses == 0


# ----- the device tier's budget ------------------------------------------------------------------
def test_the_device_budget_is_what_the_model_and_a_full_batch_leave_less_a_margin():
    auto = choose_device_budget(
        None, free_bytes=60 * GB, total_bytes=80 * GB, batch_bytes=10 * GB, margin_share=0.1
    )
    assert auto.budget_bytes == 42 * GB and auto.reason.startswith("auto")
    assert choose_device_budget(None, 5 * GB, 80 * GB, 10 * GB, 0.1).budget_bytes == 0
    assert choose_device_budget(None, None, 0, 0, 0.1).budget_bytes == 0  # a device that won't say
    assert choose_device_budget(7, 60 * GB, 80 * GB, 0, 0.1).budget_bytes == 7
    with pytest.raises(ValueError):
        choose_device_budget(None, 1, 1, 0, 1.0)


def test_a_full_batchs_activations_grow_with_the_batch_and_the_widest_unit():
    units = [
        UnitShape("a", 0, num_tokens=64, hidden_dim=32, num_text_tokens=8, cache_bytes_per_token=4),
        UnitShape("b", 1, num_tokens=16, hidden_dim=64, cache_bytes_per_token=2),
    ]
    one = batch_activation_bytes(units, requests=1, rows_per_request=2, element_bytes=2)
    assert one == 2 * (64 + 8) * 32 * 8 * 2 + (64 * 4 + 16 * 2)
    assert batch_activation_bytes(units, 4, 2, 2) == 4 * one
    assert batch_activation_bytes([], 4, 2, 2) == 0


def test_a_worker_sizes_its_device_tier_from_the_settings_and_the_device(monkeypatch):
    cpu = load_settings({})
    assert cpu.cache.device_budget_mb is None and device_cache_budget(cpu).budget_bytes == 0
    configured = load_settings({"MASKSERVE_DEVICE_CACHE_MB": "512"})
    assert device_cache_budget(configured).budget_bytes == 512 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GB, 80 * GB))
    cuda = load_settings({}, engine={"device": "cuda"}, worker={"max_batch": 4})
    budget = device_cache_budget(cuda)
    assert 0 < budget.budget_bytes <= 52 * GB and "auto" in budget.reason


def test_a_resident_steps_tensors_are_views_of_one_block(tmp_path):
    """A memory entry lays each step's tensors out in one block (and keeps them so on the
    device): the feeder gathers a batch's rows of every unit with one concatenation per step."""
    disk = _record(tmp_path, 1)
    entry = MemoryTemplateCache.load(disk.path).to_device(torch.device("cpu"))
    assert _same_tensors(entry, disk)
    block = entry.step_block(0)
    start = block.block.data_ptr()
    stop = start + block.block.numel() * block.block.element_size()
    for unit in range(NUM_UNITS):
        tensor = entry.step_tensor(0, unit, "k")
        assert start <= tensor.data_ptr() < stop
    feeder = BatchCacheFeeder([RowCacheRef(entry, 0, 0), RowCacheRef(entry, 0, 1)], [], "kv", "cpu")
    rows = [feeder.rows_tensor(unit, "k", (0, 2)) for unit in range(NUM_UNITS)]
    assert all(torch.equal(r, disk.step_tensor(0, u, "k")) for u, r in enumerate(rows))
    assert len({r.untyped_storage().data_ptr() for r in rows}) == 1  # views of one batch block

"""The tiered activation cache over real ``cache_store`` entries built directly (no model)."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from backend.cache import MemoryTemplateCache, Tier, TieredActivationCache
from backend.engine import cache_store
from backend.engine.cache_store import CacheKey, CacheMismatchError, CacheWriter, TemplateCache
from tests.factories import cache_key

NUM_STEPS, NUM_UNITS = 2, 2
LATENT_BYTES = 4 * 2 * 2 * 4  # one step's latents in the trajectory (``_fill``): 4x2x2 float32


def _key(n: int) -> CacheKey:
    return cache_key(n, NUM_STEPS)


def _fill(writer: CacheWriter, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for step in range(NUM_STEPS):
        writer.write_step(
            step,
            {
                (u, n): torch.randn(2, 8, 4, generator=generator)
                for u in range(NUM_UNITS)
                for n in ("k", "v")
            },
        )
    writer.write_trajectory({"latents": torch.randn(NUM_STEPS + 1, 4, 2, 2, generator=generator)})


def _record(root, n: int) -> TemplateCache:
    """An entry written straight to disk, as a previous run would have left it."""
    writer = CacheWriter(root, _key(n), NUM_UNITS, 2, torch.float32)
    _fill(writer, seed=n)
    return writer.commit()


def _writer(cache: TieredActivationCache, n: int) -> CacheWriter | None:
    return cache.writer(_key(n), NUM_UNITS, 2, torch.float32, NUM_STEPS, LATENT_BYTES)


def _record_through(cache: TieredActivationCache, n: int):
    writer = _writer(cache, n)
    _fill(writer, seed=n)
    handle = cache.commit(writer)
    cache.wait_for_loads()
    return handle


@pytest.fixture
def entry_bytes(tmp_path_factory) -> int:
    return _record(tmp_path_factory.mktemp("probe"), 0).bytes_total


def _open(
    root, ram_entries: float, disk_entries: float, entry_bytes: int, **kwargs
) -> TieredActivationCache:
    return TieredActivationCache(
        root, int(ram_entries * entry_bytes), int(disk_entries * entry_bytes), **kwargs
    )


def _same_tensors(a, b) -> bool:
    steps = all(
        torch.equal(a.step_tensor(s, u, n), b.step_tensor(s, u, n))
        for s in range(NUM_STEPS)
        for u in range(NUM_UNITS)
        for n in ("k", "v")
    )
    return steps and torch.equal(a.trajectory("latents"), b.trajectory("latents"))


def test_acquire_loads_a_disk_entry_into_ram_with_the_same_tensors(tmp_path, entry_bytes):
    disk = _record(tmp_path, 1)
    cache = _open(tmp_path, 2, 4, entry_bytes)
    handle = cache.acquire(_key(1))
    assert isinstance(handle, MemoryTemplateCache) and _same_tensors(handle, disk)
    assert (handle.num_steps, handle.num_units) == (disk.num_steps, disk.num_units)
    assert handle.bytes_total == disk.bytes_total
    assert (
        handle.unit_bytes(1) == disk.unit_bytes(1)
        and handle.has(1, 0, "v")
        and not handle.has(1, 0, "out")
    )
    assert cache.resident(Tier.RAM) == [_key(1).digest()]
    cache.release(_key(1))
    assert cache.acquire(_key(1)) is handle and cache.acquire(_key(2)) is None
    m = cache.metrics
    assert (m.disk_hits, m.ram_hits, m.disk_misses, m.bytes_loaded) == (1, 1, 1, disk.bytes_total)


def test_ram_budget_evicts_to_disk_and_reloads(tmp_path, entry_bytes):
    for n in (1, 2):
        _record(tmp_path, n)
    cache = _open(tmp_path, 1.5, 4, entry_bytes)
    for n in (1, 2):
        assert isinstance(cache.acquire(_key(n)), MemoryTemplateCache)
        cache.release(_key(n))
    assert cache.resident(Tier.RAM) == [_key(2).digest()] and len(cache.resident(Tier.DISK)) == 2
    assert isinstance(cache.acquire(_key(1)), MemoryTemplateCache)
    assert cache.metrics.disk_hits == 3 and cache.metrics.ram_evictions == 2


def test_pinned_entry_stays_and_a_second_is_read_from_disk(tmp_path, entry_bytes):
    for n in (1, 2):
        _record(tmp_path, n)
    cache = _open(tmp_path, 1.5, 4, entry_bytes)
    first = cache.acquire(_key(1))
    second = cache.acquire(_key(2))  # no RAM left: the pinned entry is not evicted
    assert isinstance(first, MemoryTemplateCache) and type(second) is TemplateCache
    assert _same_tensors(second, TemplateCache.open(tmp_path / _key(2).digest()))
    assert cache.resident(Tier.RAM) == [_key(1).digest()]


def test_disk_budget_deletes_the_coldest_directory(tmp_path, entry_bytes):
    cache = _open(tmp_path, 0, 2.5, entry_bytes)  # no RAM: acquire reads from disk
    for n in (1, 2):
        _record_through(cache, n)
    assert type(cache.acquire(_key(1))) is TemplateCache  # entry 1 is now used more recently than 2
    cache.release(_key(1))
    assert _record_through(cache, 3) is not None
    assert not (tmp_path / _key(2).digest()).exists() and cache.acquire(_key(2)) is None
    assert sorted(cache.resident(Tier.DISK)) == sorted([_key(1).digest(), _key(3).digest()])


def test_disk_deletion_of_a_ram_entry_spills_it_back_intact(tmp_path, entry_bytes):
    root = tmp_path / "cache"
    cache = _open(root, 2.5, 2.5, entry_bytes)
    expected = {n: MemoryTemplateCache.load(_record(tmp_path / "ref", n).path) for n in (1, 2, 3)}
    for n in (1, 2, 3):
        _record_through(cache, n)  # 3 deletes 1 from disk (still in RAM); promoting 3 spills 1 back
    assert cache.metrics.bytes_spilled > 0
    for n in (1, 2, 3):  # each load evicts a RAM-only entry, which spills again
        handle = cache.acquire(_key(n))
        assert isinstance(handle, MemoryTemplateCache) and _same_tensors(handle, expected[n])
        cache.release(_key(n))
    on_disk = {p.name for p in root.iterdir() if (p / cache_store.MANIFEST).exists()}
    assert on_disk == set(cache.resident(Tier.DISK))
    for entry_id in on_disk:
        assert TemplateCache.open(root / entry_id).key.digest() == entry_id


def test_prefetch_then_acquire_is_a_ram_hit_with_a_lead_time(tmp_path, entry_bytes):
    _record(tmp_path, 1)
    cache = _open(tmp_path, 2, 4, entry_bytes)
    cache.prefetch(_key(1))
    cache.wait_for_loads()
    cache.prefetch(_key(1))  # already in RAM: a no-op
    cache.prefetch(_key(9))  # unknown: a no-op
    assert isinstance(cache.acquire(_key(1)), MemoryTemplateCache)
    snapshot = cache.metrics.snapshot()
    assert (
        snapshot["ram_hits"] == 1 and snapshot["prefetches"] == 1 and snapshot["prefetch_uses"] == 1
    )
    assert snapshot["prefetch_lead_s_min"] >= 0.0
    cache.close()


def _block_loads_of(monkeypatch, entry_id: str) -> tuple[threading.Event, threading.Event]:
    """Loads of ``entry_id`` start, signal ``started`` and wait for ``go``."""
    started, go, load = threading.Event(), threading.Event(), MemoryTemplateCache.load

    def blocking_load(path, pin_memory=False):
        if path.name == entry_id:
            started.set()
            assert go.wait(10)
        return load(path, pin_memory)

    monkeypatch.setattr(MemoryTemplateCache, "load", staticmethod(blocking_load))
    return started, go


def test_acquire_waits_for_a_running_prefetch(tmp_path, entry_bytes, monkeypatch):
    _record(tmp_path, 1)
    cache = _open(tmp_path, 2, 4, entry_bytes)
    started, go = _block_loads_of(monkeypatch, _key(1).digest())
    cache.prefetch(_key(1))
    assert started.wait(10)
    threading.Timer(0.05, go.set).start()
    assert isinstance(cache.acquire(_key(1)), MemoryTemplateCache)
    # loaded once
    assert cache.metrics.load_waits == 1 and cache.metrics.bytes_loaded == entry_bytes


def test_acquire_does_not_queue_behind_other_prefetches(tmp_path, entry_bytes, monkeypatch):
    for n in (1, 2):
        _record(tmp_path, n)
    cache = _open(tmp_path, 3, 4, entry_bytes, prefetch_threads=1)
    started, go = _block_loads_of(monkeypatch, _key(1).digest())
    cache.prefetch(_key(1))  # occupies the only prefetch thread
    assert started.wait(10)
    cache.prefetch(_key(2))  # queued behind it
    assert isinstance(cache.acquire(_key(2)), MemoryTemplateCache)  # loaded by this thread instead
    assert not go.is_set()
    go.set()
    cache.close()
    assert sorted(cache.resident(Tier.RAM)) == sorted([_key(1).digest(), _key(2).digest()])


def test_new_recordings_are_promoted_to_ram(tmp_path, entry_bytes):
    cache = _open(tmp_path, 2, 4, entry_bytes)
    disk = _record_through(cache, 1)
    assert type(disk) is TemplateCache and cache.resident(Tier.RAM) == [_key(1).digest()]
    assert _record_through(cache, 1) is None  # already cached: the new recording is discarded
    assert [p.name for p in tmp_path.iterdir()] == [_key(1).digest()]


@pytest.mark.parametrize("damage", ["flip", "unlink"])
def test_corrupt_entry_is_deleted_and_reads_as_a_miss(tmp_path, entry_bytes, damage):
    path = _record(tmp_path, 1).path / "step_001.safetensors"
    cache = _open(tmp_path, 2, 4, entry_bytes)
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    assert cache.acquire(_key(1)) is None
    assert not path.parent.exists() and cache.metrics.corrupt_entries == 1
    assert cache.acquire(_key(1)) is None and cache.resident(Tier.DISK) == []


def test_swapped_entry_raises_a_mismatch(tmp_path, entry_bytes):
    _record(tmp_path, 1)
    cache = _open(tmp_path, 2, 4, entry_bytes)
    other = _record(tmp_path / "other", 2).path
    shutil.rmtree(tmp_path / _key(1).digest())
    shutil.copytree(other, tmp_path / _key(1).digest())
    with pytest.raises(CacheMismatchError, match="image_sha256"):
        cache.acquire(_key(1))


def test_entry_larger_than_the_disk_budget_is_not_recorded(tmp_path, entry_bytes):
    cache = _open(tmp_path, 2, 0.5, entry_bytes)
    assert _record_through(cache, 1) is None and list(tmp_path.iterdir()) == []
    assert (cache.metrics.records_skipped, cache.metrics.record_failures) == (1, 0)


def test_start_up_registers_entries_and_trims_the_oldest(tmp_path, entry_bytes):
    for age, n in enumerate((3, 1, 2)):  # entry 3 is the oldest
        manifest = _record(tmp_path, n).path / cache_store.MANIFEST
        os.utime(manifest, (1000 + age, 1000 + age))
    (tmp_path / "junk").mkdir()  # not an entry: ignored
    cache = _open(tmp_path, 1, 2.5, entry_bytes)
    assert sorted(cache.resident(Tier.DISK)) == sorted([_key(1).digest(), _key(2).digest()])
    assert not (tmp_path / _key(3).digest()).exists() and (tmp_path / "junk").exists()


def test_concurrent_acquire_and_prefetch_keep_budgets(tmp_path, entry_bytes):
    for n in range(4):
        _record(tmp_path, n)
    cache = _open(tmp_path, 2.5, 5, entry_bytes, prefetch_threads=2)
    errors = []

    def worker(offset: int) -> None:
        try:
            for i in range(40):
                key = _key((i + offset) % 4)
                cache.prefetch(_key((i + offset + 1) % 4))
                handle = cache.acquire(key)
                assert handle is not None and handle.key == key
                cache.release(key)
        # surfaced below: a thread's assert does not fail the test by itself
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cache.close()
    assert errors == []
    manager = cache._manager
    assert manager.used_bytes[Tier.RAM] <= manager.budget_bytes[Tier.RAM]
    assert all(e.pins == 0 and not e.loading for e in manager.entries())


@pytest.mark.gpu
def test_pin_memory_pins_resident_tensors(tmp_path, entry_bytes):
    _record(tmp_path, 1)
    handle = _open(tmp_path, 2, 4, entry_bytes, pin_memory=True).acquire(_key(1))
    assert handle.step_tensor(0, 0, "k").is_pinned()


@pytest.mark.parametrize("damage", ["unlink", "unlink-trajectory"])
def test_start_up_deletes_an_entry_with_a_file_missing(tmp_path, entry_bytes, damage):
    broken = _record(tmp_path, 1).path
    _record(tmp_path, 2)
    (broken / ("step_001.safetensors" if damage == "unlink" else cache_store.TRAJECTORY)).unlink()
    cache = _open(tmp_path, 2, 4, entry_bytes)
    assert cache.resident(Tier.DISK) == [_key(2).digest()]
    assert not broken.exists() and cache.metrics.corrupt_entries == 1
    assert cache.acquire(_key(1)) is None


def test_ready_is_false_while_a_read_is_in_flight_and_starts_one_for_a_disk_entry(
    tmp_path, entry_bytes, monkeypatch
):
    _record(tmp_path, 1)
    cache = _open(tmp_path, 2, 4, entry_bytes)
    assert cache.ready(_key(9)) and cache.acquire(_key(9)) is None  # a miss: nothing to wait for
    started, go = _block_loads_of(monkeypatch, _key(1).digest())
    assert not cache.ready(_key(1))  # on disk only: ready() starts its read
    assert started.wait(10) and not cache.ready(_key(1))  # in flight
    go.set()
    cache.wait_for_loads(10)
    assert cache.ready(_key(1)) and isinstance(cache.acquire(_key(1)), MemoryTemplateCache)
    assert cache.metrics.load_waits == 0 and cache.metrics.bytes_loaded == entry_bytes
    cache.close()
    (tmp_path / "big").mkdir()
    _record(tmp_path / "big", 2)  # larger than the RAM budget: read lazily from disk, never waits
    big = _open(tmp_path / "big", 0.5, 4, entry_bytes)
    assert big.ready(_key(2)) and type(big.acquire(_key(2))) is TemplateCache
    big.close()


def test_ready_holds_a_row_while_ram_is_full_of_entries_in_use(tmp_path, entry_bytes):
    for n in (1, 2):
        _record(tmp_path, n)
    cache = _open(tmp_path, 1.5, 4, entry_bytes)  # RAM for one entry
    cache.prefetch(_key(1))
    cache.wait_for_loads(10)
    # pinned: running
    assert cache.ready(_key(1)) and isinstance(cache.acquire(_key(1)), MemoryTemplateCache)
    cache.prefetch(_key(2))  # the next job arrives: no room, nothing evicted
    # would fit once entry 1 is released: held, not read file by file
    assert not cache.ready(_key(2))
    assert cache.resident(Tier.RAM) == [_key(1).digest()]
    cache.release(_key(1))  # its row finished
    assert not cache.ready(_key(2))  # its read starts now
    cache.wait_for_loads(10)
    assert cache.ready(_key(2)) and isinstance(cache.acquire(_key(2)), MemoryTemplateCache)
    assert cache.metrics.ram_misses == 0 and cache.metrics.load_waits == 0
    cache.close()


def test_a_queued_jobs_prefetch_does_not_evict_the_entry_of_a_job_queued_before_it(
    tmp_path, entry_bytes
):
    for n in (1, 2):
        _record(tmp_path, n)
    cache = _open(tmp_path, 1.5, 4, entry_bytes)
    cache.prefetch(_key(1))  # job A queued
    cache.wait_for_loads(10)
    cache.prefetch(_key(2))  # job B queued behind A: must not throw A's entry out again
    cache.wait_for_loads(10)
    assert cache.resident(Tier.RAM) == [_key(1).digest()]
    assert cache.ready(_key(1)) and isinstance(cache.acquire(_key(1)), MemoryTemplateCache)
    cache.release(_key(1))  # A ran: B's turn, its read may now take A's room
    assert not cache.ready(_key(2))
    cache.wait_for_loads(10)
    assert cache.ready(_key(2)) and cache.resident(Tier.RAM) == [_key(2).digest()]
    assert cache.metrics.bytes_loaded == 2 * entry_bytes  # each entry read once
    cache.close()


def test_a_recording_published_by_another_worker_on_the_same_directory_is_found(
    tmp_path, entry_bytes
):
    # two workers, one directory
    a, b = _open(tmp_path, 2, 4, entry_bytes), _open(tmp_path, 2, 4, entry_bytes)
    assert b.ready(_key(3)) and b.acquire(_key(3)) is None  # a miss for b
    _record_through(a, 3)  # worker a records and publishes the template after b started
    assert not b.ready(_key(3))  # b finds it on disk and starts reading it
    b.wait_for_loads(10)
    assert b.ready(_key(3)) and _same_tensors(b.acquire(_key(3)), a.acquire(_key(3)))
    b.release(_key(3))
    # b's own recording of a key a has published meanwhile is dropped; a's entry stays as it was
    c = _open(tmp_path, 2, 4, entry_bytes)
    _record_through(a, 4)
    writer = _writer(c, 4)
    _fill(writer, seed=99)
    assert c.commit(writer) is None
    assert _same_tensors(TemplateCache.open(tmp_path / _key(4).digest()), a.acquire(_key(4)))
    for cache in (a, b, c):
        cache.close()


def test_workers_sharing_a_directory_keep_the_template_another_worker_uses(tmp_path, entry_bytes):
    # one host, two workers
    a, b = _open(tmp_path, 0, 2.5, entry_bytes), _open(tmp_path, 0, 2.5, entry_bytes)
    for n in (1, 2):
        _record_through(a, n)  # in a's own view entry 1 is now the coldest
    assert type(b.acquire(_key(1))) is TemplateCache  # but b edits template 1
    b.release(_key(1))
    _record_through(a, 3)  # a makes room: it must drop 2, which nobody used since it was recorded
    assert (tmp_path / _key(1).digest()).exists() and not (tmp_path / _key(2).digest()).exists()
    for cache in (a, b):
        cache.close()


def test_workers_sharing_a_directory_keep_it_within_one_budget(tmp_path, entry_bytes):
    a, b = _open(tmp_path, 0, 2.5, entry_bytes), _open(tmp_path, 0, 2.5, entry_bytes)
    for n in (1, 2):
        _record_through(a, n)
    _record_through(b, 3)  # b counts a's two entries too: the coldest of them goes
    entries = {p.name for p in tmp_path.iterdir() if (p / cache_store.MANIFEST).exists()}
    assert entries == {_key(2).digest(), _key(3).digest()}
    # a has not looked since: entry 1, deleted by b, reads as a miss, not as a damaged entry
    assert a.acquire(_key(1)) is None and a.metrics.corrupt_entries == 0
    for cache in (a, b):
        cache.close()


def test_a_ram_copy_outlives_its_directory_deleted_by_another_worker(tmp_path, entry_bytes):
    a, b = _open(tmp_path, 2.5, 2.5, entry_bytes), _open(tmp_path, 0, 1.5, entry_bytes)
    _record_through(a, 1)  # in a's RAM and on disk
    _record_through(b, 2)  # b's budget holds one entry: it deletes a's directory of entry 1
    assert not (tmp_path / _key(1).digest()).exists()
    _record_through(a, 3)  # a folds the deletion in: entry 1 is RAM-only now, still served from RAM
    assert isinstance(a.acquire(_key(1)), MemoryTemplateCache) and a.metrics.corrupt_entries == 0
    assert _key(1).digest() in a.resident(Tier.RAM) and _key(1).digest() not in a.resident(
        Tier.DISK
    )
    for cache in (a, b):
        cache.close()

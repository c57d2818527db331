"""Contract suites: every way of writing the on-disk cache format, read back by every reader.

Writers: ``CacheWriter`` as the engine uses it, as the tiered cache uses it (stopping at the first
disk error), and the spill of a RAM entry (``MemoryTemplateCache.save``, through the same writer).
Readers (the ``TemplateCache`` read API): the lazy disk ``TemplateCache``, ``MemoryTemplateCache``,
and the handles ``TieredActivationCache.acquire`` returns from its device tier (CPU tensors standing
in for the device), from RAM and, for an entry too large for RAM, from disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from backend.cache import MemoryTemplateCache, TieredActivationCache
from backend.engine import cache_store
from backend.engine.cache_store import (
    DISK_ERRORS,
    MANIFEST,
    CacheCorruptError,
    CacheKey,
    CacheMismatchError,
    CacheWriter,
    TemplateCache,
    WriteBudget,
)
from tests.factories import cache_key
from tests.test_cache_disk_full import file_size_limit

NUM_STEPS, NUM_UNITS, HALVES = 3, 2, 2


def make_key(mode: str = "kv") -> CacheKey:
    return cache_key(0xCD, NUM_STEPS, mode)


def recorded_tensors() -> tuple[list[dict[tuple[int, str], torch.Tensor]], torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    steps = [
        {
            (u, n): torch.randn(HALVES, 8, 4, generator=generator)
            for u in range(NUM_UNITS)
            for n in "kv"
        }
        for _ in range(NUM_STEPS)
    ]
    return steps, torch.randn(NUM_STEPS + 1, 4, 2, 2, generator=generator)


def fill(writer: CacheWriter) -> None:
    steps, latents = recorded_tensors()
    for step, recorded in enumerate(steps):
        writer.write_step(step, recorded)
    writer.write_trajectory({"latents": latents})


def write_plain(root: Path) -> Path:
    writer = CacheWriter(root, make_key(), NUM_UNITS, HALVES, torch.float32)
    fill(writer)
    return writer.commit().path


def write_through_the_tiered_cache(root: Path) -> Path:
    tiered = TieredActivationCache(root, 1 << 30, 1 << 30)
    latent_bytes = 4 * 2 * 2 * 4  # one step's latents (``recorded_tensors``): 4x2x2 float32
    writer = tiered.writer(make_key(), NUM_UNITS, HALVES, torch.float32, NUM_STEPS, latent_bytes)
    fill(writer)
    entry = tiered.commit(writer)
    tiered.close()
    return entry.path


def write_by_spilling(root: Path) -> Path:
    """A RAM entry written back to disk (the tiered cache's spill), from an entry elsewhere."""
    source = write_plain(root.parent / f"{root.name}-source")
    MemoryTemplateCache.load(source).save(root)
    return root / make_key().digest()


WRITERS = {
    "plain": write_plain,
    "tiered": write_through_the_tiered_cache,
    "spill": write_by_spilling,
}


def read_from_disk(path: Path):
    return TemplateCache.open(path, make_key())


def read_into_memory(path: Path):
    return MemoryTemplateCache.load(path)


def read_through_the_tiered_cache(path: Path, ram_bytes: int = 1 << 30):
    tiered = TieredActivationCache(path.parent, ram_bytes, 1 << 30)
    handle = tiered.acquire(make_key())
    tiered.close()
    return handle


def read_from_the_device_tier(path: Path):
    """The device copy ``acquire`` returns once a hit in RAM promoted the entry."""
    tiered = TieredActivationCache(
        path.parent, 1 << 30, 1 << 30, device_budget_bytes=1 << 30, device="cpu"
    )
    tiered.acquire(make_key())
    tiered.release(make_key())
    tiered.wait_for_loads()
    handle = tiered.acquire(make_key())
    tiered.close()
    assert handle is None or handle.device == torch.device("cpu")  # None: unusable, a miss
    return handle


READERS = {
    "disk": read_from_disk,
    "memory": read_into_memory,
    "tiered-ram": read_through_the_tiered_cache,
    "tiered-device": read_from_the_device_tier,
    "tiered-disk": lambda path: read_through_the_tiered_cache(path, ram_bytes=1),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_publishes_a_complete_entry_with_its_manifest_last(writer, tmp_path):
    root = tmp_path / "cache"
    path = WRITERS[writer](root)
    assert path == root / make_key().digest()
    assert [p.name for p in root.iterdir()] == [path.name]  # no temporary directory left
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format_version"] == cache_store.FORMAT_VERSION
    assert CacheKey(**manifest["key"]) == make_key() and manifest["key_digest"] == path.name
    assert (manifest["num_steps"], manifest["num_units"], manifest["halves"]) == (
        NUM_STEPS,
        NUM_UNITS,
        HALVES,
    )
    files = {p.name for p in path.iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == set(manifest["tensors"]) == files
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest
    assert manifest["bytes_total"] == sum((path / name).stat().st_size for name in files)


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_reader_returns_what_every_writer_wrote(writer, reader, tmp_path):
    cache = READERS[reader](WRITERS[writer](tmp_path / "cache"))
    steps, latents = recorded_tensors()
    assert cache.key == make_key()
    assert (cache.num_steps, cache.num_units) == (NUM_STEPS, NUM_UNITS)
    for step, recorded in enumerate(steps):
        for (unit, name), tensor in recorded.items():
            assert cache.has(step, unit, name) and torch.equal(
                cache.step_tensor(step, unit, name), tensor
            )
    assert not cache.has(0, 0, "out") and not cache.has(NUM_STEPS, 0, "k")
    assert torch.equal(cache.trajectory("latents"), latents)
    assert cache.unit_bytes(1) == sum(t.numel() * 4 for (u, _), t in steps[0].items() if u == 1)
    with pytest.raises(CacheMismatchError):
        cache.step_tensor(NUM_STEPS, 0, "k")


@pytest.mark.parametrize("reader", ["disk", "memory"])
def test_a_reader_refuses_a_file_that_fails_its_checksum_naming_the_entry(reader, tmp_path):
    path = write_plain(tmp_path / "cache")
    damaged = path / cache_store.step_file(1)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError) as caught:
        cache = READERS[reader](path)
        cache.step_tensor(1, 0, "k")
    assert caught.value.entry_path == path


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_missing_file_makes_the_entry_unreadable(reader, tmp_path):
    path = write_plain(tmp_path / "cache")
    (path / cache_store.TRAJECTORY).unlink()
    if reader.startswith("tiered"):  # the tiered cache reads an unusable entry as a miss
        assert READERS[reader](path) is None
        return
    with pytest.raises(CacheCorruptError):
        READERS[reader](path)


@pytest.mark.parametrize("with_budget", [False, True])
def test_a_disk_error_while_writing_is_raised_or_ends_the_recording(with_budget, tmp_path):
    """A real failing write (the kernel's EFBIG past RLIMIT_FSIZE): raised by a plain writer; with
    a budget it ends the recording, which releases the budget once with the error."""
    released: list[Exception | None] = []
    budget = WriteBudget(NUM_STEPS, 64, reserve=lambda size: True, release=released.append)
    writer = CacheWriter(
        tmp_path, make_key(), NUM_UNITS, HALVES, torch.float32, budget if with_budget else None
    )
    with file_size_limit(64):  # every step file is larger
        if not with_budget:
            with pytest.raises(DISK_ERRORS, match="too large"):
                fill(writer)
            writer.abort()
        else:
            fill(writer)  # every later write is skipped
    if with_budget:
        assert isinstance(writer.failed, DISK_ERRORS) and "too large" in str(writer.failed)
        assert released == [writer.failed]
    assert list(tmp_path.iterdir()) == []  # the partial directory is gone either way


def test_a_recording_that_misses_what_its_mode_reads_is_refused(tmp_path):
    writer = CacheWriter(tmp_path, make_key(mode="hidden"), NUM_UNITS, HALVES, torch.float32)
    fill(writer)  # K and V, but hidden mode reads each unit's output
    with pytest.raises(cache_store.CacheError, match="incomplete"):
        writer.commit()
    writer.abort()

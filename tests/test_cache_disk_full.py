"""A cache disk that cannot fill, and a write that fails anyway, never fails an edit.

The failing file system is real: ``file_size_limit`` lowers this process's RLIMIT_FSIZE, so the
kernel fails any write past the limit with EFBIG, as a full disk fails with ENOSPC (no root, no
mount, no mock). A killed worker is a real process killed with SIGKILL mid-recording.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from backend.blobs import BlobStore
from backend.cache import Tier, TieredActivationCache
from backend.cache.budgets import choose_disk_budget
from backend.cache.disk import partial_is_stale
from backend.engine.cache_store import MANIFEST, CacheKey, CacheWriter, WriteBudget, step_file
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from tests.factories import (
    cache_key,
    make_engine,
    make_params,
    make_prepared_job,
    make_template,
    rect_mask,
)
from tests.test_worker import TOL, final_latents, run_until_idle

MB = 1 << 20
NUM_STEPS, NUM_UNITS, HALVES = 2, 2, 2
LATENT_BYTES = 4 * 2 * 2 * 4  # one step's latents (``fill``): 4x2x2 float32


@contextlib.contextmanager
def file_size_limit(max_bytes: int):
    """Inside, no file of this process grows past ``max_bytes``: the write fails with EFBIG
    (SIGXFSZ ignored, so the write returns the error instead of killing the process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def key(n: int) -> CacheKey:
    return cache_key(n, NUM_STEPS)


def step_tensors(seed: int) -> dict[tuple[int, str], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        (u, n): torch.randn(HALVES, 64, 8, generator=generator)
        for u in range(NUM_UNITS)
        for n in "kv"
    }


def fill(writer: CacheWriter, seed: int, from_step: int = 0) -> None:
    for step in range(from_step, NUM_STEPS):
        writer.write_step(step, step_tensors(seed + step))
    writer.write_trajectory({"latents": torch.randn(NUM_STEPS + 1, 4, 2, 2)})


def start(cache: TieredActivationCache, n: int) -> CacheWriter:
    writer = cache.writer(key(n), NUM_UNITS, HALVES, torch.float32, NUM_STEPS, LATENT_BYTES)
    assert writer is not None
    return writer


def record(cache: TieredActivationCache, n: int):
    writer = start(cache, n)
    fill(writer, seed=n)
    return cache.commit(writer)


def partials(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.fixture
def sizes(tmp_path_factory) -> tuple[int, int]:
    """(bytes of one committed entry, bytes a recording of one reserves)."""
    probe = TieredActivationCache(tmp_path_factory.mktemp("probe"), 0, 1 << 30)
    entry = record(probe, 0).bytes_total
    budget = WriteBudget(NUM_STEPS, LATENT_BYTES, lambda size: True, lambda error: None)
    stored = {f"u{u:03d}.{n}": t for (u, n), t in step_tensors(0).items()}
    probe.close()
    return entry, budget.entry_bound(stored)


# ----- the budget (pure) -----------------------------------------------------------------------
def test_the_automatic_budget_is_a_share_of_the_free_space_plus_what_the_cache_holds():
    auto = choose_disk_budget(None, 0.5, free_bytes=300 * MB, held_bytes=100 * MB)
    assert auto.budget_bytes == 200 * MB and "auto: 0.5 of" in auto.reason
    # a full disk: the budget is what the entries hold, shared
    assert choose_disk_budget(None, 0.5, 0, 100 * MB).budget_bytes == 50 * MB
    assert choose_disk_budget(None, 1.0, 0, 0).budget_bytes == 0  # nothing records, nothing fails
    explicit = choose_disk_budget(64 * MB, 0.5, free_bytes=300 * MB, held_bytes=0)
    assert explicit.budget_bytes == 64 * MB and "above" not in explicit.reason
    too_big = choose_disk_budget(65536 * MB, 0.5, free_bytes=300 * MB, held_bytes=0)
    assert too_big.budget_bytes == 65536 * MB and "above the" in too_big.reason
    with pytest.raises(ValueError, match="disk_free_share"):
        choose_disk_budget(None, 0.0, 1, 1)


def test_a_cache_opened_without_a_budget_takes_a_share_of_its_file_system(tmp_path, sizes, caplog):
    record(TieredActivationCache(tmp_path, 0, 1 << 30), 1)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with caplog.at_level(logging.INFO, logger="backend.cache.store"):
        cache = TieredActivationCache(tmp_path, 0, disk_free_share=0.25)
    budget = cache._manager.budget_bytes[Tier.DISK]
    # the free space moves a little under other tests: within 1 %
    assert abs(budget - 0.25 * (free + sizes[0])) <= 0.01 * budget
    assert "cache disk budget" in caplog.text and "auto: 0.25 of" in caplog.text
    cache.close()


def test_a_partial_is_removed_only_when_its_owner_is_gone():
    assert partial_is_stale(None, None, modified_at=100.0)  # an older build's: no owner in the name
    assert partial_is_stale(42, None, modified_at=100.0)  # no process has the pid
    assert not partial_is_stale(42, owner_started_at=50.0, modified_at=100.0)  # its live writer
    assert partial_is_stale(42, owner_started_at=500.0, modified_at=100.0)  # the pid was reused


# ----- evict before write ---------------------------------------------------------------------
def test_a_recording_evicts_the_oldest_entry_before_its_first_byte(tmp_path, sizes):
    entry, bound = sizes
    cache = TieredActivationCache(tmp_path, 0, entry + bound + entry // 2)
    for n in (1, 2):
        record(cache, n)  # two entries fit, but not two and a recording
    assert sorted(cache.resident(Tier.DISK)) == sorted([key(1).digest(), key(2).digest()])
    writer = start(cache, 3)
    writer.write_step(0, step_tensors(3))  # reserves the whole entry first: 1 is evicted now
    assert not (tmp_path / key(1).digest()).exists() and (tmp_path / key(2).digest()).exists()
    assert cache.metrics.disk_evictions == 1 and len(partials(tmp_path)) == 1
    fill(writer, seed=3, from_step=1)
    assert cache.commit(writer).bytes_total <= bound  # the reservation was an upper bound
    assert sorted(cache.resident(Tier.DISK)) == sorted([key(2).digest(), key(3).digest()])
    assert cache._manager.used_bytes[Tier.DISK] == 2 * entry and partials(tmp_path) == []
    cache.close()


def test_a_recording_that_cannot_fit_does_not_record_and_spares_entries_in_use(tmp_path, sizes):
    entry, bound = sizes
    cache = TieredActivationCache(tmp_path, 0, entry + bound - 1)
    record(cache, 1)
    assert cache.acquire(key(1)) is not None  # in use: pinned, never evicted
    writer = start(cache, 2)
    fill(writer, seed=2)  # refused room at its first write: nothing is written
    assert cache.commit(writer) is None and partials(tmp_path) == []
    assert not (tmp_path / key(2).digest()).exists() and (tmp_path / key(1).digest()).exists()
    assert (cache.metrics.records_skipped, cache.metrics.record_failures) == (1, 0)
    cache.release(key(1))
    assert record(cache, 2) is not None  # once 1 is not in use, it makes room
    assert cache.resident(Tier.DISK) == [key(2).digest()]
    cache.close()


# ----- a write that fails anyway ---------------------------------------------------------------
def test_a_write_failing_mid_recording_ends_that_recording_only(tmp_path, sizes, caplog):
    entry, _ = sizes
    cache = TieredActivationCache(tmp_path, 0, 1 << 30)
    record(cache, 1)
    writer = start(cache, 2)
    writer.write_step(0, step_tensors(2))
    with caplog.at_level(logging.WARNING), file_size_limit(1024):  # step files are larger
        fill(writer, seed=2, from_step=1)
    assert cache.commit(writer) is None
    assert partials(tmp_path) == [] and not (tmp_path / key(2).digest()).exists()
    assert cache.metrics.record_failures == 1 and caplog.text.count("recording failed") == 1
    assert cache._manager.used_bytes[Tier.DISK] == entry  # the reservation was returned
    assert record(cache, 2) is not None  # no sticky failure once writes succeed again
    assert cache.acquire(key(1)) is not None  # the other entry was never touched
    cache.close()


def test_a_cache_directory_gone_before_the_first_write_ends_that_recording_only(tmp_path, caplog):
    """A recording started, then the cache directory was replaced (a dead mount, a file in its
    place): reserving room for the first step cannot list the directory; the recording ends, the
    step does not raise, and recordings work again once the directory is back."""
    root = tmp_path / "cache"
    cache = TieredActivationCache(root, 0, 1 << 30)
    writer = start(cache, 1)
    root.rename(tmp_path / "held")
    root.write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        writer.write_step(0, step_tensors(1))  # no exception: the row goes on without the cache
    assert writer.failed is not None and cache.commit(writer) is None
    assert cache.metrics.record_failures == 1 and caplog.text.count("recording failed") == 1
    root.unlink()
    (tmp_path / "held").rename(root)
    # the partial it had opened lay in the directory moved aside, out of the abort's reach: it is
    # removed at the next start-up once this process is gone (see the killed-worker test)
    assert record(cache, 2) is not None
    cache.close()


def test_a_commit_failing_on_the_disk_is_not_raised(tmp_path):
    cache = TieredActivationCache(tmp_path, 0, 1 << 30)
    writer = start(cache, 1)
    fill(writer, seed=1)
    with file_size_limit(64):  # the manifest is larger
        assert cache.commit(writer) is None
    assert list(tmp_path.iterdir()) == [] and cache.metrics.record_failures == 1
    assert cache._manager.used_bytes[Tier.DISK] == 0
    cache.close()


def test_closing_the_cache_removes_the_recordings_still_open(tmp_path):
    cache = TieredActivationCache(tmp_path, 0, 1 << 30)
    writer = start(cache, 1)
    writer.write_step(0, step_tensors(1))
    assert len(partials(tmp_path)) == 1
    cache.close()  # a stopping worker (SIGTERM) closes its cache
    assert partials(tmp_path) == [] and writer.failed is None


# ----- partial recordings at start-up -------------------------------------------------------------
KILLED_MID_RECORDING = textwrap.dedent(
    """
    import sys, time, torch
    from backend.cache import TieredActivationCache
    from backend.engine.cache_store import CacheKey
    cache = TieredActivationCache(sys.argv[1], 0, 1 << 30)
    key = CacheKey("07" * 32, "m", "r", 64, 64, 2, "s", 1.0, 0, "kv")
    writer = cache.writer(key, 1, 2, torch.float32, 2, 64)
    writer.write_step(0, {(0, "k"): torch.zeros(2, 64, 8), (0, "v"): torch.zeros(2, 64, 8)})
    print("recording", flush=True)
    time.sleep(600)
    """
)


def test_start_up_removes_partials_of_killed_workers_and_keeps_live_ones(tmp_path, caplog):
    root = tmp_path / "cache"
    root.mkdir()
    older_build = root / f".{key(8).digest()}.k2j4_x"  # a partial without an owner pid
    older_build.mkdir()
    (older_build / step_file(0)).write_bytes(b"x" * 1000)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    worker = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_RECORDING, str(root)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
    )
    try:
        assert worker.stdout.readline().strip() == "recording"
        live = [p for p in partials(root) if p != older_build.name]
        assert len(live) == 1 and f".{worker.pid}." in live[0]
        held = sum(f.stat().st_size for f in (root / live[0]).iterdir())
        # another worker starting beside it: only the older build's partial goes
        TieredActivationCache(root, 0, 1 << 30).close()
        assert partials(root) == live
    finally:
        worker.kill()
        worker.wait()
    with caplog.at_level(logging.INFO, logger="backend.cache.store"):
        cache = TieredActivationCache(root, 0, 1 << 30)
    assert partials(root) == [] and list(root.iterdir()) == []
    assert (cache.metrics.partials_removed, cache.metrics.partial_bytes_removed) == (1, held)
    assert f"partials_removed=1 partial_bytes_removed={held}" in caplog.text
    cache.close()


# ----- in the worker: the row computes without the cache, its batch-mates never notice ------------
STEPS = 4
BOX = (0, 0, 64, 64)


@pytest.fixture(scope="module")
def engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("disk-full"))


def submit(engine, worker, blobs, job_id, template, seed):
    params = make_params(engine, steps=STEPS)
    worker.inbox.put(
        make_prepared_job(engine, blobs, job_id, template, rect_mask(BOX), seed, params)
    )


def test_a_row_whose_recording_fails_finishes_densely_beside_a_cached_row(engine, tmp_path):
    engine.cache_root = tmp_path / "cache"
    cached, fresh = make_template(seed=61), make_template(seed=62)
    params = make_params(engine, steps=STEPS)
    step_bytes = (engine.prepare_template(cached, params).path / step_file(0)).stat().st_size
    expected = engine.edit(cached, rect_mask(BOX), "a blue vase", 1, params).latents
    # the same request on the fresh template, computed without any cache
    dense_blobs, dense_sink = BlobStore(tmp_path / "dense"), LocalSink()
    dense = EngineWorker(engine, dense_blobs, LocalInbox(), dense_sink)
    submit(engine, dense, dense_blobs, "fresh", fresh, seed=2)
    run_until_idle(dense)

    caches = TieredActivationCache(engine.cache_root, 1 << 30, 1 << 30)
    blobs, sink = BlobStore(tmp_path / "blobs"), LocalSink()
    worker = EngineWorker(engine, blobs, LocalInbox(), sink, caches=caches)
    submit(engine, worker, blobs, "cached", cached, seed=1)
    submit(engine, worker, blobs, "fresh", fresh, seed=2)
    worker.iterate()  # both admitted; the fresh row recorded its step 0
    assert len(partials(engine.cache_root)) == 1
    # the latents handed on at the end (a few KiB) still fit: only step files fail
    with file_size_limit(step_bytes // 2):
        run_until_idle(worker)

    assert [e for e in sink.events if e.status == "failed"] == []
    assert {j.job_id: j.used_cache for j in sink.denoised_jobs} == {"cached": True, "fresh": False}
    assert (final_latents(blobs, sink, "cached") - expected).abs().max().item() <= TOL
    difference = final_latents(blobs, sink, "fresh") - final_latents(
        dense_blobs, dense_sink, "fresh"
    )
    assert difference.abs().max().item() <= TOL
    assert caches.metrics.record_failures == 1 and partials(engine.cache_root) == []
    fresh_entry = engine.cache_root / engine.cache_key(fresh, params).digest()
    assert not fresh_entry.exists()

    # space is back: the next edit of the fresh template records it, the one after reads it
    submit(engine, worker, blobs, "again", fresh, seed=3)
    run_until_idle(worker)
    assert (fresh_entry / MANIFEST).is_file()
    submit(engine, worker, blobs, "cached-now", fresh, seed=4)
    run_until_idle(worker)
    assert {j.job_id: j.used_cache for j in sink.denoised_jobs[2:]} == {
        "again": False,
        "cached-now": True,
    }
    caches.close()


def test_a_prepare_job_without_room_is_done_and_says_the_cache_was_not_recorded(engine, tmp_path):
    engine.cache_root = tmp_path / "cache"
    caches = TieredActivationCache(engine.cache_root, 1 << 30, 1)  # room for nothing
    blobs, sink = BlobStore(tmp_path / "blobs"), LocalSink()
    worker = EngineWorker(engine, blobs, LocalInbox(), sink, caches=caches)
    template = make_template(seed=63)
    job = make_prepared_job(
        engine, blobs, "prep", template, rect_mask(BOX), 0, make_params(engine, steps=STEPS)
    )
    worker.inbox.put(dataclasses.replace(job, prepare=True))
    run_until_idle(worker)
    done = [e for e in sink.events if e.status == "done"]
    assert len(done) == 1 and done[0].message.startswith("cache not recorded")
    assert caches.metrics.records_skipped == 1 and list(engine.cache_root.iterdir()) == []
    caches.close()

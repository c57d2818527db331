"""Prefetch-gated admission in the real worker loop (tiny sd2 on the CPU): a row whose template
cache is still being read from disk, or is being recorded by another row of the worker, waits in
the queue while the running batch keeps stepping; no acquire ever waits for a read."""

from __future__ import annotations

import threading

import pytest

from backend.blobs import BlobStore
from backend.cache import MemoryTemplateCache, TieredActivationCache
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from tests.factories import make_engine, make_params, make_prepared_job, make_template, rect_mask

STEPS = 4


@pytest.fixture(scope="module")
def engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("admission-cache"))


def make_worker(engine, tmp_path):
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    caches = TieredActivationCache(engine.cache_root, 1 << 30, 1 << 32)
    return EngineWorker(engine, blobs, inbox, sink, caches=caches), caches, inbox, sink, blobs


def drain(worker, caches, limit=200):
    """Iterate until idle; when no step ran (rows held on a read), let the reads land first."""
    for _ in range(limit):
        if not worker.iterate():
            caches.wait_for_loads(10)
        if worker.scheduler.idle:
            return
    raise AssertionError("worker did not drain its queue")


def running_steps(sink, job_id):
    return [e.step for e in sink.events if e.job_id == job_id and e.status == "running"]


def test_a_row_whose_cache_is_still_being_read_waits_while_the_batch_runs(
    engine, tmp_path, monkeypatch
):
    engine.cache_root = tmp_path / "cache"
    params = make_params(engine, steps=STEPS)
    warm, cold = make_template(seed=41), make_template(seed=42)
    for template in (warm, cold):
        engine.prepare_template(template, params)  # both on disk when the worker starts
    worker, caches, inbox, sink, blobs = make_worker(engine, tmp_path)
    inbox.put(make_prepared_job(engine, blobs, "first", warm, rect_mask((0, 0, 64, 64)), 1, params))
    for _ in range(20):  # "first" is held until its own prefetch lands, then runs
        if worker.iterate():
            break
        caches.wait_for_loads(10)
    assert running_steps(sink, "first")[-1] == 1

    started, go, load = threading.Event(), threading.Event(), MemoryTemplateCache.load

    def slow_load(path, pin_memory=False):  # the read of "cold" takes until the test says go
        started.set()
        assert go.wait(10)
        return load(path, pin_memory)

    monkeypatch.setattr(MemoryTemplateCache, "load", staticmethod(slow_load))
    inbox.put(
        make_prepared_job(engine, blobs, "second", cold, rect_mask((64, 64, 128, 128)), 2, params)
    )
    assert worker.iterate()  # "first" steps; "second" arrives, its prefetch starts, it is held
    assert started.wait(10)
    assert worker.iterate()  # still in flight: "first" steps again, "second" still waits
    assert running_steps(sink, "first")[-1] == 3
    assert "running" not in sink.statuses("second") and list(worker.scheduler.waiting) == ["second"]
    held = worker.stats.snapshot()
    assert held["held_rows"] == 1 and held["held_row_schedules_total"] >= 2  # what /metrics reports
    go.set()
    drain(worker, caches)
    assert {j.job_id: j.used_cache for j in sink.denoised_jobs} == {"first": True, "second": True}
    # no acquire ever waited for a read: the batch never stalled
    assert caches.metrics.load_waits == 0
    assert worker.stats.snapshot()["held_rows"] == 0
    caches.close()


def test_a_row_waits_for_the_recording_of_its_template_and_then_reads_it(engine, tmp_path):
    engine.cache_root = tmp_path / "fresh-cache"
    params = make_params(engine, steps=STEPS)
    template = make_template(seed=43)
    worker, caches, inbox, sink, blobs = make_worker(engine, tmp_path)
    # arrive together: the first records, the second must not compute densely
    for index in range(2):
        inbox.put(
            make_prepared_job(
                engine, blobs, f"e{index}", template, rect_mask((0, 0, 64, 64)), index, params
            )
        )
    drain(worker, caches)
    assert {j.job_id: j.used_cache for j in sink.denoised_jobs} == {"e0": False, "e1": True}
    first_done = next(i for i, e in enumerate(sink.events) if e.job_id == "e0" and e.step == STEPS)
    second_runs = next(
        i for i, e in enumerate(sink.events) if e.job_id == "e1" and e.status == "running"
    )
    assert second_runs > first_done  # admitted only after the recording was committed
    assert caches.metrics.load_waits == 0
    caches.close()


def test_a_row_waits_for_ram_held_by_running_rows_instead_of_reading_from_disk(engine, tmp_path):
    engine.cache_root = tmp_path / "tight-cache"
    params = make_params(engine, steps=STEPS)
    templates = [make_template(seed=44), make_template(seed=45)]
    entry_bytes = max(engine.prepare_template(t, params).bytes_total for t in templates)
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    # RAM for one entry
    caches = TieredActivationCache(engine.cache_root, int(1.5 * entry_bytes), 1 << 32)
    worker = EngineWorker(engine, blobs, inbox, sink, caches=caches)
    for index, template in enumerate(templates):
        inbox.put(
            make_prepared_job(
                engine, blobs, f"r{index}", template, rect_mask((0, 0, 64, 64)), index, params
            )
        )
    drain(worker, caches)
    assert {j.job_id: j.used_cache for j in sink.denoised_jobs} == {"r0": True, "r1": True}
    first_done = next(i for i, e in enumerate(sink.events) if e.job_id == "r0" and e.step == STEPS)
    second_runs = next(
        i for i, e in enumerate(sink.events) if e.job_id == "r1" and e.status == "running"
    )
    assert second_runs > first_done  # held until r0 released the RAM, then read into it
    # never read file by file
    assert caches.metrics.ram_misses == 0 and caches.metrics.load_waits == 0
    caches.close()

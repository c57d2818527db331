"""A broken template cache never fails an edit: a step file deleted or corrupted on disk (or the
trajectory) makes the row compute densely, with the result of an edit without cache; the entry
is dropped, recorded again on the way, and the next edit reads it. Tiny sd2 model on the CPU."""

from __future__ import annotations

import logging

import pytest

from backend.blobs import BlobStore
from backend.cache import MemoryTemplateCache, TieredActivationCache
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from tests.factories import make_engine, make_params, make_prepared_job, make_template, rect_mask
from tests.test_worker import TOL, final_latents, run_until_idle

STEPS = 4
MASK_BOX = (0, 0, 64, 64)
WHOLE_RAM = 1 << 30  # the entry is loaded into RAM (and verified whole) when acquired
NO_RAM = 0  # the entry is read lazily from disk, each file verified on its first read


@pytest.fixture(scope="module")
def engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("fallback-cache"))


def damage(path, how: str) -> None:
    if how == "unlink":
        path.unlink()
    else:  # a flipped byte in the tensor data: the file is still there, its checksum fails
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))


def run_job(engine, tmp_path, job_id, template, seed, caches=None, box=MASK_BOX):
    """(worker, sink, blobs) after one edit ran to its end."""
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    worker = EngineWorker(engine, blobs, inbox, sink, caches=caches)
    inbox.put(
        make_prepared_job(
            engine, blobs, job_id, template, rect_mask(box), seed, make_params(engine, steps=STEPS)
        )
    )
    run_until_idle(worker)
    return worker, sink, blobs


# (file, damage, RAM budget) -> where the worker meets it
CASES = {
    # opening the entry: a miss
    "deleted-step-read-from-disk": ("step_001.safetensors", "unlink", NO_RAM),
    # at step 1: restart densely
    "corrupt-step-read-from-disk": ("step_001.safetensors", "flip", NO_RAM),
    "corrupt-trajectory-read-from-disk": ("trajectory.safetensors", "flip", NO_RAM),  # at admission
    # loading it: a miss
    "deleted-step-loaded-into-ram": ("step_001.safetensors", "unlink", WHOLE_RAM),
    "corrupt-step-loaded-into-ram": ("step_001.safetensors", "flip", WHOLE_RAM),
}


@pytest.mark.parametrize("file_name, how, ram_bytes", CASES.values(), ids=CASES.keys())
def test_broken_cache_file_falls_back_to_dense_and_is_recorded_again(
    engine, tmp_path, caplog, file_name, how, ram_bytes
):
    engine.cache_root = tmp_path / "cache"
    template = make_template(seed=41)
    entry = engine.prepare_template(template, make_params(engine, steps=STEPS)).path
    # no cache at all
    _, dense_sink, dense_blobs = run_job(engine, tmp_path / "dense", "dense", template, seed=5)
    caches = TieredActivationCache(engine.cache_root, ram_bytes, 1 << 32)  # the worker is up...
    damage(entry / file_name, how)  # ...when the file goes bad
    with caplog.at_level(logging.WARNING):
        worker, sink, blobs = run_job(
            engine, tmp_path / "edit", "edit", template, seed=5, caches=caches
        )
    caches.wait_for_loads()

    assert "failed" not in sink.statuses("edit") and [j.used_cache for j in sink.denoised_jobs] == [
        False
    ]
    difference = (
        (final_latents(blobs, sink, "edit") - final_latents(dense_blobs, dense_sink, "dense"))
        .abs()
        .max()
    )
    assert difference.item() <= TOL
    assert caches.metrics.corrupt_entries == 1 and "unusable" in caplog.text
    # a lazily read file is verified on first read only
    met_midway = how == "flip" and ram_bytes == NO_RAM
    assert worker.stats.snapshot()["cache_fallbacks_total"] == int(met_midway)
    restarted = [e for e in sink.events if e.message.startswith("template cache unusable")]
    assert [(e.status, e.step) for e in restarted] == (
        [("running", 0)] if met_midway and "step" in file_name else []
    )
    MemoryTemplateCache.load(entry)  # recorded again: every file there and passing its checksum
    _, again, _ = run_job(engine, tmp_path / "again", "again", template, seed=6, caches=caches)
    assert [j.used_cache for j in again.denoised_jobs] == [True]
    caches.close()


def test_a_row_on_a_healthy_cache_keeps_its_result_beside_a_restarted_one(engine, tmp_path):
    """One forward holds a row reading a healthy cache and a row whose cache fails at step 1: the
    broken row restarts densely, the healthy one just steps at the next iteration."""
    engine.cache_root = tmp_path / "cache"
    healthy, broken = make_template(seed=51), make_template(seed=52)
    params = make_params(engine, steps=STEPS)
    engine.prepare_template(healthy, params)
    broken_entry = engine.prepare_template(broken, params).path
    expected = engine.edit(healthy, rect_mask(MASK_BOX), "a blue vase", 1, params).latents
    _, dense_sink, dense_blobs = run_job(engine, tmp_path / "dense", "dense", broken, seed=2)
    caches = TieredActivationCache(engine.cache_root, NO_RAM, 1 << 32)
    damage(broken_entry / "step_001.safetensors", "flip")
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    worker = EngineWorker(engine, blobs, inbox, sink, caches=caches)
    inbox.put(make_prepared_job(engine, blobs, "healthy", healthy, rect_mask(MASK_BOX), 1, params))
    inbox.put(make_prepared_job(engine, blobs, "broken", broken, rect_mask(MASK_BOX), 2, params))
    run_until_idle(worker)

    assert [e for e in sink.events if e.status == "failed"] == []
    assert {j.job_id: j.used_cache for j in sink.denoised_jobs} == {
        "healthy": True,
        "broken": False,
    }
    assert (final_latents(blobs, sink, "healthy") - expected).abs().max().item() <= TOL
    dense = final_latents(dense_blobs, dense_sink, "dense")
    assert (final_latents(blobs, sink, "broken") - dense).abs().max().item() <= TOL
    assert worker.stats.snapshot()["cache_fallbacks_total"] == 1
    MemoryTemplateCache.load(broken_entry)
    caches.close()

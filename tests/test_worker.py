"""The engine worker on the real tiny models: batched == one at a time, admission per mode, cancel,
recording on the first edit, and clean failures."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from backend.blobs import BlobStore
from backend.cache import TieredActivationCache
from backend.protocol import CancelJob
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from tests.factories import (
    FAMILIES,
    make_engine,
    make_params,
    make_prepared_job,
    make_template,
    rect_mask,
)

TOL = 1e-4  # fp32: a batched matmul may sum in another order than a single row's
STEPS = 4
JOBS = (  # (template seed, mask box, request seed): two templates, three masks
    (7, (32, 40, 96, 80), 1),
    (11, (8, 8, 56, 40), 2),
    (7, (64, 64, 120, 120), 3),
)


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, models_dir, tmp_path_factory):
    return make_engine(
        request.param, models_dir, tmp_path_factory.mktemp(f"worker-cache-{request.param}")
    )


@pytest.fixture(scope="module")
def sd2_engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("worker-cache-sd2"))


def make_worker(engine, tmp_path, mode="continuous", max_batch=8, with_cache=True):
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    caches = TieredActivationCache(engine.cache_root, 1 << 30, 1 << 32) if with_cache else None
    worker = EngineWorker(engine, blobs, inbox, sink, mode=mode, max_batch=max_batch, caches=caches)
    return worker, inbox, sink, blobs


def run_until_idle(worker, limit=200):
    for _ in range(limit):
        if not worker.iterate() and worker.caches is not None:
            worker.caches.wait_for_loads(10)  # rows held until their prefetch lands
        if worker.scheduler.idle:
            return
    raise AssertionError("worker did not drain its queue")


def step_until_running(worker, job_id, limit=50):
    """Iterate until ``job_id`` runs: admission waits for its cache's prefetch to land
    (prefetch-gated admission), so let the reads finish between iterations."""
    for _ in range(limit):
        worker.iterate()
        if job_id in worker.scheduler.running or job_id not in worker.jobs:
            return
        if worker.caches is not None:
            worker.caches.wait_for_loads(10)
    raise AssertionError(f"{job_id} was never admitted")


def final_latents(blobs, sink, job_id):
    (job,) = [j for j in sink.denoised_jobs if j.job_id == job_id]
    return load_file(str(blobs.local_path(job.latents_ref)))["latents"]


def test_batched_rows_at_different_steps_equal_one_at_a_time(engine, tmp_path):
    params = make_params(engine, steps=STEPS)
    for template_seed in {t for t, _, _ in JOBS}:
        if engine.lookup(make_template(template_seed), params) is None:
            engine.prepare_template(make_template(template_seed), params)
    alone = [
        engine.edit(make_template(t), rect_mask(box), "a blue vase", seed, params).latents
        for t, box, seed in JOBS
    ]
    worker, inbox, sink, blobs = make_worker(engine, tmp_path)
    # staggered: rows sit at different steps
    for index, (template_seed, box, seed) in enumerate(JOBS):
        inbox.put(
            make_prepared_job(
                engine,
                blobs,
                f"job{index}",
                make_template(template_seed),
                rect_mask(box),
                seed,
                params,
            )
        )
        step_until_running(worker, f"job{index}")
    run_until_idle(worker)
    assert worker.stats.max_rows == len(JOBS)  # all three ran in one forward pass
    for index, expected in enumerate(alone):
        batched = final_latents(blobs, sink, f"job{index}")
        assert (batched - expected).abs().max().item() <= TOL
    assert all(j.used_cache for j in sink.denoised_jobs)
    assert sorted(inbox.acked) == [f"job{i}" for i in range(len(JOBS))]


@pytest.mark.parametrize("mode,joins_at_once", [("continuous", True), ("static", False)])
def test_admission_of_a_new_row(sd2_engine, tmp_path, mode, joins_at_once):
    params = make_params(sd2_engine, steps=STEPS)
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path, mode=mode)
    inbox.put(
        make_prepared_job(
            sd2_engine, blobs, "first", make_template(), rect_mask((0, 0, 64, 64)), 1, params
        )
    )
    step_until_running(worker, "first")
    # another template: one that "first" may be recording would hold "second" until the commit
    inbox.put(
        make_prepared_job(
            sd2_engine,
            blobs,
            "second",
            make_template(seed=8),
            rect_mask((64, 64, 128, 128)),
            2,
            params,
        )
    )
    worker.iterate()
    stepped = [e.step for e in sink.events if e.job_id == "second" and e.status == "running"]
    assert (1 in stepped) is joins_at_once
    run_until_idle(worker)
    assert {j.job_id for j in sink.denoised_jobs} == {"first", "second"}


def test_cancel_removes_the_row_at_the_next_step(sd2_engine, tmp_path):
    params = make_params(sd2_engine, steps=STEPS)
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path)
    inbox.put(
        make_prepared_job(
            sd2_engine, blobs, "doomed", make_template(), rect_mask((0, 0, 64, 64)), 1, params
        )
    )
    step_until_running(worker, "doomed")
    inbox.put(CancelJob(job_id="doomed"))
    inbox.put(CancelJob(job_id="early"))  # cancelled before it reached the worker
    worker.iterate()
    inbox.put(
        make_prepared_job(
            sd2_engine, blobs, "early", make_template(), rect_mask((0, 0, 64, 64)), 1, params
        )
    )
    run_until_idle(worker)
    assert sink.statuses("doomed")[-1] == "cancelled"
    assert max(e.step for e in sink.events if e.job_id == "doomed") == 1
    assert sink.statuses("early") == ["cancelled"]
    assert sink.denoised_jobs == [] and sorted(inbox.acked) == ["doomed", "early"]
    assert worker.jobs == {}


def test_first_edit_records_the_cache_and_the_second_reuses_it(sd2_engine, tmp_path):
    sd2_engine.cache_root = tmp_path / "fresh-cache"
    params = make_params(sd2_engine, steps=STEPS)
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path)
    template = make_template(seed=23)
    for index in range(2):
        inbox.put(
            make_prepared_job(
                sd2_engine, blobs, f"e{index}", template, rect_mask((0, 0, 64, 64)), index, params
            )
        )
        run_until_idle(worker)
    first, second = sink.denoised_jobs
    assert not first.used_cache and second.used_cache
    assert sd2_engine.lookup(template, params) is not None


def test_a_recording_row_beside_cached_rows_records_a_complete_cache(sd2_engine, tmp_path):
    """A first edit (recording) admitted while rows read other templates' caches: the recording
    must hold every unit's K/V (a mixed forward would skip them) and the next edit must read it."""
    sd2_engine.cache_root = tmp_path / "mixed-cache"
    params = make_params(sd2_engine, steps=STEPS)
    warm, cold = make_template(seed=31), make_template(seed=32)
    sd2_engine.prepare_template(warm, params)
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path)
    inbox.put(
        make_prepared_job(sd2_engine, blobs, "cached", warm, rect_mask((0, 0, 64, 64)), 1, params)
    )
    inbox.put(
        make_prepared_job(sd2_engine, blobs, "records", cold, rect_mask((0, 0, 64, 64)), 2, params)
    )
    run_until_idle(worker)
    inbox.put(
        make_prepared_job(
            sd2_engine, blobs, "reads", cold, rect_mask((64, 64, 128, 128)), 3, params
        )
    )
    run_until_idle(worker)
    assert [e.status for e in sink.events if e.status == "failed"] == []
    assert {j.job_id: j.used_cache for j in sink.denoised_jobs} == {
        "cached": True,
        "records": False,
        "reads": True,
    }


def test_unreadable_prepared_request_fails_that_job_only(sd2_engine, tmp_path):
    params = make_params(sd2_engine, steps=STEPS)
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path, with_cache=False)
    good = make_prepared_job(
        sd2_engine, blobs, "good", make_template(), rect_mask((0, 0, 64, 64)), 1, params
    )
    bad = make_prepared_job(
        sd2_engine, blobs, "bad", make_template(), rect_mask((0, 0, 64, 64)), 1, params
    )
    blobs.local_path(bad.prepared_ref).write_bytes(b"not a safetensors file")
    inbox.put(bad)
    inbox.put(good)
    run_until_idle(worker)
    assert sink.statuses("bad") == ["failed"] and "unreadable" in sink.events[0].message
    assert [j.job_id for j in sink.denoised_jobs] == ["good"]
    assert torch.isfinite(final_latents(blobs, sink, "good")).all()

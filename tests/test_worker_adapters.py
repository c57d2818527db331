"""LoRA adapters through the engine worker on the tiny SD2 model: tiers, late joining at the first
ready step, blocking at the deadline, failures that leave the rest of the batch running."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from backend.adapters.files import NormalizedMeta, read_for_model, save_normalized
from backend.blobs import BlobStore
from backend.protocol import AdapterUse
from backend.worker.adapter_book import AdapterBook
from backend.worker.adapter_tiers import AdapterTiers, RowAdapters, store_loader
from backend.worker.baseline_adapters import ADAPTER_PHASES
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from tests.adapter_factory import make_adapter_file
from tests.factories import make_engine, make_params, make_prepared_job, make_template, rect_mask
from tests.test_worker import final_latents

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "tiny-sd2-inpaint"
STEPS = 5
TOL = 1e-4
MASK = rect_mask((32, 40, 96, 80))
MB = 1 << 20


@pytest.fixture(scope="module")
def engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("adapter-worker-cache"))


@pytest.fixture(scope="module")
def content(tmp_path_factory):
    """A store's content folder with two normalized adapters, named by a content id."""
    folder = tmp_path_factory.mktemp("adapter-content")
    for seed, sha in ((1, "a" * 64), (2, "b" * 64)):
        source = make_adapter_file(MODEL, folder / f"source-{seed}.safetensors", seed=seed)
        read = read_for_model(source, MODEL, max_rank=64)
        save_normalized(
            read.adapter,
            NormalizedMeta("sd2-inpaint", MODEL, "peft"),
            folder / f"{sha}.safetensors",
        )
    return folder


class GatedLoader:
    """``store_loader`` that waits for ``gate`` before each read (a slow disk)."""

    def __init__(self, folder):
        self.read = store_loader(lambda sha: folder / f"{sha}.safetensors")
        self.gate = threading.Event()

    def __call__(self, sha):
        self.gate.wait(30)
        return self.read(sha)


def make_worker(engine, tmp_path, loader, join_by=0.2):
    for sha in engine.adapters.ids():  # each test starts with nothing on the device
        engine.adapters.drop(sha)
    book = AdapterBook(device_bytes=64 * MB, host_bytes=64 * MB)
    rows = RowAdapters(AdapterTiers(engine.adapters, book, loader), join_by)
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    worker = EngineWorker(engine, blobs, inbox, sink, adapters=rows)
    return worker, inbox, sink, blobs


def submit(engine, worker, inbox, blobs, job_id, seed, uses):
    params = make_params(engine, steps=STEPS, use_cache=False)
    job = make_prepared_job(engine, blobs, job_id, make_template(), MASK, seed, params)
    inbox.put(replace(job, adapters=list(uses)))
    return params


def reference(engine, seed, adapters):
    """The same edit run by the engine alone with ``adapters`` from step 0."""
    params = make_params(engine, steps=STEPS, use_cache=False)
    state = engine.start(make_template(), MASK, "a blue vase", seed, params, adapters=adapters)
    while not state.done:
        engine.step([state], params.mode)
    return state.latents


def drain(worker, limit=100):
    for _ in range(limit):
        worker.iterate()
        if worker.scheduler.idle:
            return
    raise AssertionError("worker did not drain")


def done_job(sink, job_id):
    (job,) = [j for j in sink.denoised_jobs if j.job_id == job_id]
    return job


USE_A = AdapterUse("rec-a", "a" * 64, 0.8)
USE_B = AdapterUse("rec-b", "b" * 64, 1.3)


def test_prefetched_adapters_join_at_step_zero_and_match_the_engine(engine, content, tmp_path):
    loader = GatedLoader(content)
    loader.gate.set()
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, loader)
    submit(engine, worker, inbox, blobs, "j1", 3, [USE_A, USE_B])
    submit(engine, worker, inbox, blobs, "j2", 4, [])
    for sha in (USE_A.sha256, USE_B.sha256):
        worker.adapters.tiers.prefetch(sha)
        worker.adapters.tiers.wait(sha)
        worker.adapters.tiers.unpin([sha])
    drain(worker)
    assert done_job(sink, "j1").adapter_steps == {"rec-a": 0, "rec-b": 0}
    assert done_job(sink, "j2").adapter_steps == {}
    expected = reference(engine, 3, (("a" * 64, 0.8), ("b" * 64, 1.3)))
    assert (final_latents(blobs, sink, "j1") - expected).abs().max().item() <= TOL
    assert (final_latents(blobs, sink, "j2") - reference(engine, 4, ())).abs().max().item() <= TOL
    counters = worker.adapters.tiers.book.counters
    assert counters.rows_blocked == 0 and counters.rows_with_adapters == 1
    assert counters.hits["device"] == 2


def test_an_adapter_still_loading_joins_later_without_blocking(engine, content, tmp_path):
    loader = GatedLoader(content)
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, loader, join_by=1.0)
    submit(engine, worker, inbox, blobs, "late", 3, [USE_A])
    worker.iterate()
    worker.iterate()  # two steps without the adapter: its file is still being read
    assert worker.jobs["late"].state.step == 2 and worker.jobs["late"].state.adapters == ()
    loader.gate.set()
    worker.adapters.tiers.wait_on_host(USE_A.sha256, 30)
    drain(worker)
    joined = done_job(sink, "late").adapter_steps["rec-a"]
    assert joined == 2
    assert worker.adapters.tiers.book.counters.rows_blocked == 0
    # it is a different edit from one with the adapter from step 0, and from one without it
    latents = final_latents(blobs, sink, "late")
    assert (latents - reference(engine, 3, (("a" * 64, 0.8),))).abs().max().item() > TOL
    assert (latents - reference(engine, 3, ())).abs().max().item() > TOL


def test_a_row_at_its_deadline_blocks_until_its_adapter_arrives(engine, content, tmp_path):
    loader = GatedLoader(content)
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, loader, join_by=0.0)
    submit(engine, worker, inbox, blobs, "blocked", 3, [USE_A])
    threading.Timer(0.3, loader.gate.set).start()
    drain(worker)
    assert done_job(sink, "blocked").adapter_steps == {"rec-a": 0}
    assert worker.adapters.tiers.book.counters.rows_blocked == 1
    expected = reference(engine, 3, (("a" * 64, 0.8),))
    assert (final_latents(blobs, sink, "blocked") - expected).abs().max().item() <= TOL


def test_an_adapter_that_cannot_be_loaded_fails_its_row_only(engine, content, tmp_path):
    loader = GatedLoader(content)
    loader.gate.set()
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, loader, join_by=0.0)
    missing = AdapterUse("rec-gone", "c" * 64, 1.0)
    submit(engine, worker, inbox, blobs, "bad", 3, [missing])
    submit(engine, worker, inbox, blobs, "good", 4, [])
    drain(worker)
    failed = [e for e in sink.events if e.job_id == "bad" and e.status == "failed"]
    assert failed and "adapter rec-gone could not be loaded" in failed[0].message
    assert done_job(sink, "good").adapter_steps == {}
    assert not worker.adapters.tiers.book.pins  # nothing left pinned


def test_the_heartbeat_rows_name_their_adapters(engine, content, tmp_path):
    loader = GatedLoader(content)
    loader.gate.set()
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, loader)
    submit(engine, worker, inbox, blobs, "hb", 3, [USE_B])
    worker.iterate()
    live = worker.scheduler.live_state(time.time())
    (row,) = live["running"] + live["waiting"]
    assert row.adapters == [USE_B.sha256]
    drain(worker)
    assert not worker.adapters.tiers.book.pins


def test_a_row_with_adapters_never_records_the_template_cache(engine, content, tmp_path):
    from backend.cache import Tier, TieredActivationCache

    loader = GatedLoader(content)
    loader.gate.set()
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, loader)
    worker.caches = TieredActivationCache(tmp_path / "cache", 1 << 30, 1 << 32)
    params = make_params(engine, steps=STEPS, template_seed=91)
    template = make_template(seed=91)
    job = make_prepared_job(engine, blobs, "adapted", template, MASK, 3, params)
    inbox.put(replace(job, adapters=[USE_A]))
    drain(worker)
    assert done_job(sink, "adapted").adapter_steps["rec-a"] <= 1  # by its deadline
    # nothing recorded: a template cache is the base model's
    assert worker.caches.resident(Tier.RAM) == worker.caches.resident(Tier.DISK) == []


def test_the_baseline_worker_fuses_a_calls_adapters_like_diffusers(engine, content, tmp_path):
    """The baseline loads the request's adapter files with diffusers, fuses, runs, unfuses: its
    result is the engine's with the same adapters (a full mask: the ordinary computation)."""
    from backend.worker.baseline import BaselineWorker
    from tests.factories import full_mask

    sources = {}
    for seed, sha in ((1, "a" * 64), (2, "b" * 64)):
        sources[sha] = make_adapter_file(MODEL, tmp_path / f"src-{seed}.safetensors", seed=seed)
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    worker = BaselineWorker(
        engine, blobs, inbox, sink, max_batch=1, adapter_files=sources.__getitem__
    )
    params = make_params(engine, steps=STEPS, use_cache=False)
    job = make_prepared_job(engine, blobs, "base", make_template(), full_mask(), 3, params)
    inbox.put(replace(job, adapters=[USE_A, USE_B]))
    inbox.put(replace(job, job_id="plain"))
    drain(worker)
    for sha in engine.adapters.ids():
        engine.adapters.drop(sha)
    read = store_loader(lambda sha: content / f"{sha}.safetensors")
    for sha in ("a" * 64, "b" * 64):
        engine.adapters.put(read(sha))
    state = engine.start(
        make_template(),
        full_mask(),
        "a blue vase",
        3,
        params,
        adapters=(("a" * 64, 0.8), ("b" * 64, 1.3)),
    )
    while not state.done:
        engine.step([state], params.mode)
    assert (final_latents(blobs, sink, "base") - state.latents).abs().max().item() <= TOL
    plain = engine.start(make_template(), full_mask(), "a blue vase", 3, params)
    while not plain.done:
        engine.step([plain], params.mode)
    # unfused and unloaded after its call: the next call runs the base model
    assert (final_latents(blobs, sink, "plain") - plain.latents).abs().max().item() <= TOL
    # what the adapters cost the baseline is timed per phase, inside the call's denoise time
    timings = {job.job_id: job.timings for job in sink.denoised_jobs}
    phases = [timings["base"][name] for name in ADAPTER_PHASES]
    assert all(seconds > 0 for seconds in phases)
    assert sum(phases) < timings["base"]["denoise_s"]
    assert not set(ADAPTER_PHASES) & set(timings["plain"])


def test_a_cache_pinned_to_an_adapter_set_is_recorded_then_read_by_exactly_that_set(
    engine, content, tmp_path, models_dir
):
    """A prepare job with adapters (as pre-processing makes it) records the cache pinned to its
    adapter set, applying them from step 0; an edit naming that set reads it, another set reads
    the base cache."""
    from backend.cache import Tier, TieredActivationCache
    from backend.cache.key import pinned_key
    from backend.config import load_settings
    from backend.protocol import EditJob
    from backend.tasks.core import CpuStages
    from tests.test_api import png

    loader = GatedLoader(content)
    loader.gate.set()
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, loader)
    worker.caches = TieredActivationCache(tmp_path / "cache", 1 << 30, 1 << 32)
    settings = load_settings(
        env={}, paths={"data_dir": str(tmp_path), "models_dir": str(models_dir)}
    )
    stages = CpuStages(settings, engine, blobs=blobs)
    template_ref = blobs.put("uploads", "t.png", png(make_template(seed=95)))
    mask_ref = blobs.put("uploads", "m.png", png(MASK))
    common = dict(model_id=MODEL, template_ref=template_ref, seed=3, steps=STEPS, guidance=7.5)
    prepare = EditJob(
        job_id="pin", mask_ref="", prompt="", prepare=True, adapters=[USE_A], **common
    )
    recording = stages.preprocess(prepare)
    inbox.put(recording)
    drain(worker)
    (done,) = [e for e in sink.events if e.job_id == "pin" and e.status == "done"]
    assert done.message == "cache recorded"
    pinned = recording.cache_digest
    edits = {}
    for job_id, uses in (("same", [USE_A]), ("other", [replace(USE_A, scale=0.5)])):
        job = EditJob(job_id=job_id, mask_ref=mask_ref, prompt="a cat", adapters=uses, **common)
        inbox.put(stages.preprocess(job))
        worker.iterate()
        edits[job_id] = worker.jobs[job_id].prepared.cache_key
    drain(worker)
    base = edits["other"]
    assert edits["same"].digest() == pinned and base.adapters == ""
    assert pinned_key(base, [(USE_A.sha256, USE_A.scale)]).digest() == pinned
    assert {j.job_id for j in sink.denoised_jobs} == {"same", "other"}
    # only the pinned cache exists: neither edit recorded the base one
    held = worker.caches.resident(Tier.RAM) + worker.caches.resident(Tier.DISK)
    assert pinned in held and base.digest() not in held


def test_a_cache_pinned_to_the_adapters_is_read_when_only_the_device_tier_holds_it():
    """RAM may drop its copy of an entry the device holds: the pinned cache is still there."""
    from backend.cache import Tier
    from backend.cache.key import pinned_key
    from backend.protocol import PreparedJob
    from tests.factories import cache_key

    base = cache_key(1)
    pinned = pinned_key(base, [(USE_A.sha256, USE_A.scale)])

    class DeviceOnly:
        def resident(self, tier: Tier) -> list[str]:
            return [pinned.digest()] if tier is Tier.DEVICE else []

    job = PreparedJob("j", MODEL, "p", "t", STEPS, 0.2, base.digest(), adapters=[USE_A])
    rows = RowAdapters(None, 0.0)  # cache_key reads no adapter tier
    assert rows.cache_key(job, base, DeviceOnly()) == pinned
    assert rows.cache_key(job, base, None) == base


@pytest.mark.gpu
def test_host_to_device_copies_run_on_a_side_stream_on_cuda(models_dir, content, tmp_path):
    """On CUDA an adapter on the host is copied on a side stream: not resident until its event
    completed, then resident (and pinned) without the compute stream having waited."""
    import torch

    from backend.engine.editor import MaskAwareEngine
    from backend.models import load_pipeline, resolve_model

    pipe = load_pipeline(MODEL, models_dir).to("cuda")
    cuda_engine = MaskAwareEngine(pipe, resolve_model(MODEL), tmp_path / "cache")
    tiers = AdapterTiers(
        cuda_engine.adapters,
        AdapterBook(64 * MB, 64 * MB),
        store_loader(lambda s: content / f"{s}.safetensors"),
    )
    sha = USE_A.sha256
    tiers.prefetch(sha)
    tiers.wait_on_host(sha, 30)
    assert tiers.take([sha]) == []  # the copy starts on the side stream
    tiers.wait(sha)
    assert sha in cuda_engine.adapters and tiers.book.pins[sha] == 1
    params = make_params(cuda_engine, steps=STEPS, use_cache=False)
    state = cuda_engine.start(
        make_template(), MASK, "a blue vase", 3, params, adapters=((sha, 0.8),)
    )
    while not state.done:
        cuda_engine.step([state], params.mode)
    assert state.latents.is_cuda and torch.isfinite(state.latents).all()

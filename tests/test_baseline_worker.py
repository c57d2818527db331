"""The ``baseline`` worker on the real tiny models: each row of one ordinary pipeline call equals
the ordinary pipeline run alone; only rows of one key share a call, at most ``max_batch``; cancels
during and before a call; recordings; failures that stay with their rows; the service path."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file

from backend import protocol
from backend.blobs import BlobStore
from backend.config import load_settings
from backend.engine.editor import EditParams
from backend.engine.ordinary import run_ordinary
from backend.engine.prepared import PreparedRequest
from backend.imaging.uploads import fit_to_bucket
from backend.jobstate import JobStateStore
from backend.protocol import CancelJob, EditJob, WorkerHeartbeat
from backend.protocol.keys import heartbeat_key
from backend.tasks.core import CpuStages
from backend.worker.baseline import NO_CACHE, BaselineWorker
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.redis_inbox import send_to_inbox
from backend.worker.service import Heartbeat
from tests.factories import (
    FAMILIES,
    MASK,
    built_worker,
    make_engine,
    make_params,
    make_prepared_job,
    make_template,
    queued_tasks,
    rect_mask,
)

TOL = 1e-4  # fp32: a batched matmul may sum in another order than a single row's
STEPS = 3
ROWS = (  # (template seed, mask box, request seed, prompt, negative prompt)
    (7, (32, 40, 96, 80), 1, "a blue vase", ""),
    (11, (8, 8, 56, 40), 2, "a red cat", "blurry"),
    (7, (64, 64, 120, 120), 3, "", ""),
)


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, models_dir, tmp_path_factory):
    return make_engine(
        request.param, models_dir, tmp_path_factory.mktemp(f"baseline-{request.param}")
    )


@pytest.fixture(scope="module")
def sd2_engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("baseline-sd2"))


class CancellingSink(LocalSink):
    """A sink that, like a user watching the progress, cancels job ``j`` once a call reports
    step ``cancels[j]``: the cancel reaches the inbox while the pipeline call runs."""

    def __init__(self, inbox: LocalInbox, cancels: dict[str, int]):
        super().__init__()
        self.inbox, self.cancels = inbox, dict(cancels)

    def step_events(self, events):
        super().step_events(events)
        for job_id, step in list(self.cancels.items()):
            if any(event.step == step for event in events):
                del self.cancels[job_id]
                self.inbox.put(CancelJob(job_id=job_id))


def make_worker(engine, tmp_path, max_batch=8, cancels=None):
    blobs, inbox = BlobStore(tmp_path / "blobs"), LocalInbox()
    sink = CancellingSink(inbox, cancels or {})
    return BaselineWorker(engine, blobs, inbox, sink, max_batch=max_batch), inbox, sink, blobs


def run_until_idle(worker, limit=50):
    for _ in range(limit):
        worker.iterate()
        if worker.scheduler.idle:
            return
    raise AssertionError("worker did not drain its queue")


def final_latents(blobs, sink, job_id):
    (job,) = [j for j in sink.denoised_jobs if j.job_id == job_id]
    return load_file(str(blobs.local_path(job.latents_ref)))["latents"]


def put(engine, inbox, blobs, job_id, params, template_seed=7, box=(32, 40, 96, 80), seed=1):
    size = params.size[0]
    template = make_template(template_seed, size=size)
    mask = rect_mask(tuple(v * size // 128 for v in box), size=size)
    job = make_prepared_job(engine, blobs, job_id, template, mask, seed, params)
    inbox.put(job)
    return job


def test_each_row_of_one_call_equals_the_ordinary_pipeline_alone(engine, tmp_path):
    worker, inbox, sink, blobs = make_worker(engine, tmp_path)
    alone = []
    for index, (template_seed, box, seed, prompt, negative) in enumerate(ROWS):
        params = make_params(engine, steps=STEPS, negative_prompt=negative)
        template, mask = make_template(template_seed), rect_mask(box)
        job = make_prepared_job(engine, blobs, f"row{index}", template, mask, seed, params, prompt)
        inbox.put(job)
        alone.append(
            run_ordinary(
                engine.pipe, engine.spec, template, mask, prompt, seed, params, output_type="latent"
            )
        )
    run_until_idle(worker)
    assert worker.stats.steps == STEPS and worker.stats.max_rows == len(ROWS)  # one call
    for index, expected in enumerate(alone):
        assert (final_latents(blobs, sink, f"row{index}") - expected).abs().max().item() <= TOL
        events = [e for e in sink.events if e.job_id == f"row{index}"]
        assert [e.status for e in events] == ["waiting"] + ["running"] * (STEPS + 1)
        assert [e.step for e in events[1:]] == list(range(STEPS + 1))  # admitted, every step
    assert not any(j.used_cache for j in sink.denoised_jobs)
    assert all({"wait_s", "denoise_s"} <= set(j.timings) for j in sink.denoised_jobs)
    assert sorted(inbox.acked) == [f"row{i}" for i in range(len(ROWS))] and worker.jobs == {}


def test_rows_of_other_steps_or_sizes_never_share_a_call(sd2_engine, tmp_path):
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path)
    three, four = make_params(sd2_engine, steps=3), make_params(sd2_engine, steps=4)
    small = make_params(sd2_engine, steps=3, size=(64, 64))
    for job_id, params in (("a", three), ("b", four), ("c", small), ("d", three)):
        put(sd2_engine, inbox, blobs, job_id, params)
    run_until_idle(worker)
    # calls: (a, d) 3 steps of 2 rows, (b) 4 steps, (c) 3 steps
    assert worker.stats.steps == 3 + 4 + 3 and worker.stats.rows_total == 2 * 3 + 4 + 3
    assert [j.job_id for j in sink.denoised_jobs] == ["a", "d", "b", "c"]
    assert final_latents(blobs, sink, "c").shape[-1] == 64 // 8


def test_max_batch_is_honoured(sd2_engine, tmp_path):
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path, max_batch=2)
    params = make_params(sd2_engine, steps=STEPS)
    for index in range(3):
        put(sd2_engine, inbox, blobs, f"j{index}", params, seed=index)
    run_until_idle(worker)
    assert worker.stats.max_rows == 2 and worker.stats.steps == 2 * STEPS
    assert len(sink.denoised_jobs) == 3


def test_a_row_cancelled_during_the_call_is_not_handed_on(sd2_engine, tmp_path):
    worker, inbox, sink, blobs = make_worker(
        sd2_engine, tmp_path, cancels={"doomed": 1, "waiting": 1}
    )
    params = make_params(sd2_engine, steps=STEPS)
    put(sd2_engine, inbox, blobs, "doomed", params, seed=1)
    put(sd2_engine, inbox, blobs, "kept", params, template_seed=11, box=(8, 8, 56, 40), seed=2)
    # another key: waits behind the call, cancelled while it runs
    put(sd2_engine, inbox, blobs, "waiting", make_params(sd2_engine, steps=STEPS + 1))
    worker.iterate()
    assert sink.statuses("doomed")[-1] == "cancelled" and sink.statuses("waiting") == [
        "waiting",
        "cancelled",
    ]
    assert max(e.step for e in sink.events if e.job_id == "doomed") == 1
    assert [j.job_id for j in sink.denoised_jobs] == ["kept"]
    expected = run_ordinary(
        sd2_engine.pipe,
        sd2_engine.spec,
        make_template(11),
        rect_mask((8, 8, 56, 40)),
        "a blue vase",
        2,
        params,
        output_type="latent",
    )
    assert (final_latents(blobs, sink, "kept") - expected).abs().max().item() <= TOL
    assert sorted(inbox.acked) == ["doomed", "kept", "waiting"] and worker.scheduler.idle


def test_a_call_whose_every_row_was_cancelled_stops_and_the_worker_goes_on(sd2_engine, tmp_path):
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path, cancels={"only": 1})
    params = make_params(sd2_engine, steps=STEPS)
    put(sd2_engine, inbox, blobs, "only", params)
    worker.iterate()
    assert sink.statuses("only")[-1] == "cancelled" and worker.stats.steps == 1  # interrupted
    put(sd2_engine, inbox, blobs, "next", params)
    run_until_idle(worker)
    assert [j.job_id for j in sink.denoised_jobs] == ["next"]


def test_a_waiting_row_cancelled_before_its_call_never_runs(sd2_engine, tmp_path):
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path)
    params = make_params(sd2_engine, steps=STEPS)
    put(sd2_engine, inbox, blobs, "gone", params)
    inbox.put(CancelJob(job_id="gone"))
    inbox.put(CancelJob(job_id="early"))  # before it reached the worker
    run_until_idle(worker)
    put(sd2_engine, inbox, blobs, "early", params)
    run_until_idle(worker)
    assert sink.statuses("gone") == ["waiting", "cancelled"] and sink.statuses("early") == [
        "cancelled"
    ]
    assert worker.stats.steps == 0 and sink.denoised_jobs == []
    assert sorted(inbox.acked) == ["early", "gone"]


def test_a_recording_ends_done_without_running(sd2_engine, tmp_path):
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path)
    params = make_params(sd2_engine, steps=STEPS)
    job = make_prepared_job(
        sd2_engine, blobs, "rec", make_template(), rect_mask((0, 0, 64, 64)), 0, params
    )
    inbox.put(replace(job, prepare=True))
    run_until_idle(worker)
    (done,) = [e for e in sink.events if e.status == "done"]
    assert done.job_id == "rec" and done.message == NO_CACHE and "wait_s" in done.timings
    assert worker.stats.steps == 0 and sink.denoised_jobs == [] and inbox.acked == ["rec"]


def test_failures_stay_with_their_rows(sd2_engine, tmp_path):
    """A call the pipeline refuses (a size it cannot run) fails its rows; a row whose template is
    gone fails alone and its call runs without it; the worker goes on."""
    worker, inbox, sink, blobs = make_worker(sd2_engine, tmp_path)
    params = make_params(sd2_engine, steps=STEPS)
    bad = make_prepared_job(
        sd2_engine, blobs, "bad", make_template(), rect_mask((0, 0, 64, 64)), 1, params
    )
    prepared = PreparedRequest.load(blobs.local_path(bad.prepared_ref))
    prepared.params = EditParams.from_dict({**prepared.params, "size": (124, 124)}).to_dict()
    # a size not a multiple of 8: diffusers raises
    prepared.save(blobs.local_path(bad.prepared_ref))
    inbox.put(bad)
    lost = put(sd2_engine, inbox, blobs, "lost", params)
    blobs.local_path(lost.template_ref).unlink()
    put(sd2_engine, inbox, blobs, "good", params, seed=4)
    run_until_idle(worker)
    failed = {e.job_id: e.message for e in sink.events if e.status == "failed"}
    assert set(failed) == {"bad", "lost"}
    assert failed["bad"].startswith("denoising failed") and "could not start" in failed["lost"]
    assert [j.job_id for j in sink.denoised_jobs] == ["good"]
    assert sorted(inbox.acked) == ["bad", "good", "lost"] and worker.jobs == {}


def test_pre_processed_crop_goes_through_the_call_and_is_pasted_back(sd2_engine, tmp_path):
    """An upload of its own size, a masked-area crop: the call runs on the template fit through
    the crop box with the prepared mask and the job's prompt (what the ordinary pipeline gives for
    them), and post-processing keeps every pixel outside the mask. Pre-processing for a baseline
    stack encodes nothing: the pipeline encodes the prompt and the image itself."""
    settings = load_settings(
        env={"MASKSERVE_BATCHING": "baseline"},
        paths={"data_dir": str(tmp_path), "models_dir": str(tmp_path / "models")},
    )
    blobs = BlobStore(tmp_path / "blobs")
    stages = CpuStages(settings, sd2_engine, blobs=blobs)
    template = make_template(5, size=200).crop((0, 0, 200, 150))
    mask = np.zeros((150, 200), dtype=np.uint8)
    mask[40:100, 60:130] = 255
    job = EditJob(
        job_id="crop",
        model_id=sd2_engine.spec.model_id,
        template_ref=blobs.put("uploads", "t.png", _png(template)),
        mask_ref=blobs.put("uploads", "m.png", _png(Image.fromarray(mask))),
        prompt="a green lamp",
        seed=6,
        steps=STEPS,
        guidance=7.5,
        resolution=128,
        inpaint_area="masked",
    )
    prepared_job = stages.preprocess(job)
    assert prepared_job.prompt == "a green lamp"
    prepared = PreparedRequest.load(blobs.local_path(prepared_job.prepared_ref))
    assert prepared.init_latents.numel() == 0 and not prepared.conditioning
    params = EditParams.from_dict(prepared.params)
    expected = run_ordinary(
        sd2_engine.pipe,
        sd2_engine.spec,
        fit_to_bucket(template, params.size, tuple(prepared_job.paste.crop_box)),
        Image.fromarray(prepared.pixels.astype(np.uint8) * 255),
        "a green lamp",
        6,
        params,
        output_type="latent",
    )
    inbox, sink = LocalInbox(), LocalSink()
    worker = BaselineWorker(sd2_engine, blobs, inbox, sink)
    inbox.put(prepared_job)
    run_until_idle(worker)
    assert (final_latents(blobs, sink, "crop") - expected).abs().max().item() <= TOL
    done = stages.postprocess(sink.denoised_jobs[0])
    result = np.asarray(Image.open(io.BytesIO(blobs.get(done.result_ref))).convert("RGB"))
    outside = mask == 0
    assert np.array_equal(result[outside], np.asarray(template)[outside])


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_service_builds_a_baseline_worker_that_serves_its_inbox(
    redis_url, redis_client, models_dir, tmp_path
):
    env = {"MASKSERVE_BATCHING": "baseline"}
    with built_worker(redis_url, redis_client, models_dir, tmp_path, "w-base", env) as built:
        settings, worker, caches = built
        assert isinstance(worker, BaselineWorker) and worker.caches is None
        params = make_params(worker.engine, size=(worker.engine.spec.default_resolution,) * 2)
        template = make_template(size=params.size[0])
        blobs = BlobStore(settings.paths.data_dir / "blobs")
        job = make_prepared_job(
            worker.engine, blobs, "svc-b", template, MASK.resize(template.size), 4, params
        )
        jobstate = JobStateStore(redis_client)
        jobstate.create("svc-b")
        send_to_inbox(redis_client, "w-base", job)
        for _ in range(200):
            worker.iterate(0.01)
            if queued_tasks(redis_client, settings.celery.post_queue):
                break
        assert len(queued_tasks(redis_client, settings.celery.post_queue)) == 1
        assert worker.inbox.pending() == 0  # acked once handed on
        record = jobstate.get("svc-b")
        assert record["status"] == "running" and record["step"] == record["num_steps"]
        Heartbeat(redis_client, worker, caches, settings).refresh(force=True)
        beat = protocol.decode(redis_client.get(heartbeat_key("w-base")))
        assert isinstance(beat, WorkerHeartbeat) and beat.batching == "baseline"
        assert beat.resident_ram == beat.resident_disk == []

"""Live previews while denoising (``backend.engine.previews``): the real worker on the tiny models
of every family emits one on the running events that are due, each a small PNG data URL whose
pixels outside the mask are the template's and never change; the latent -> RGB map fitted on the
demo model's VAE tracks what the VAE decodes; previews ride the job's event stream (and the API's
server-sent events), never its record, and leave the stream when the job leaves ``running``."""

from __future__ import annotations

import base64
import io
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from PIL import Image

from backend.api.app import create_app
from backend.blobs import BlobStore
from backend.config import load_settings
from backend.engine import previews as pv
from backend.engine.editor import MaskAwareEngine
from backend.jobstate import JobStateStore
from backend.models import load_pipeline, resolve_model
from backend.models.registry import model_revision
from backend.protocol import JobEvent, decode, encode, event_fields, event_payload
from backend.protocol.keys import job_events_key, job_key
from backend.training.scenes import make_scene
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from tests.factories import (
    FAMILIES,
    SIZE,
    make_engine,
    make_params,
    make_prepared_job,
    make_template,
    rect_mask,
)
from tests.test_api import KEY, make_settings, sse_events, submit

STEPS = 4
BOX = (16, 24, 72, 64)  # the painted area (x0, y0, x1, y1) of a SIZE x SIZE template


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, models_dir, tmp_path_factory):
    return make_engine(
        request.param, models_dir, tmp_path_factory.mktemp(f"preview-cache-{request.param}")
    )


def decode_png(url: str) -> Image.Image:
    assert url.startswith(pv.PNG_PREFIX)
    image = Image.open(io.BytesIO(base64.b64decode(url[len(pv.PNG_PREFIX) :], validate=True)))
    assert image.format == "PNG"
    return image.convert("RGB")


def run_job(engine, models_dir, tmp_path, every: int | None, budget: float = 0.0):
    """One edit run by the real worker loop, with previews every ``every`` steps (None: off) and
    a time budget (0: none); returns its events, its prepared request and the map."""
    latent_map = pv.latent_rgb_map(engine, models_dir)
    previews = None if every is None else pv.Previews(latent_map, every, budget=budget)
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    worker = EngineWorker(engine, blobs, inbox, sink, previews=previews)
    params = make_params(engine, steps=STEPS, use_cache=False)
    message = make_prepared_job(engine, blobs, "job-1", make_template(7), rect_mask(BOX), 3, params)
    inbox.put(message)
    for _ in range(50):
        worker.iterate()
        if worker.scheduler.idle and sink.denoised_jobs:
            break
    assert [j.job_id for j in sink.denoised_jobs] == ["job-1"]
    from backend.engine.prepared import PreparedRequest

    prepared = PreparedRequest.load(blobs.local_path(message.prepared_ref))
    running = [e for e in sink.events if e.status == "running"]
    return running, prepared, latent_map


def latent_box(box, factor: int, margin: int = 1):
    """Latent-pixel bounds (x0, y0, x1, y1) of a pixel box, grown by ``margin`` latent pixels."""
    x0, y0, x1, y1 = box
    return (
        max(0, x0 // factor - margin),
        max(0, y0 // factor - margin),
        -(-x1 // factor) + margin,
        -(-y1 // factor) + margin,
    )


@pytest.mark.parametrize("every", [1, 2])
def test_the_worker_emits_a_preview_on_the_running_events_due(engine, models_dir, tmp_path, every):
    running, _, _ = run_job(engine, models_dir, tmp_path, every)
    assert [e.step for e in running] == [0, 1, 2, 3, 4]
    latent_side = SIZE // engine.pipe.vae_scale_factor
    expected = pv.preview_size((latent_side, latent_side), pv.DEFAULT_PREVIEW_PX)
    assert expected == (64, 64)  # a 16 x 16 latent image, upscaled 4x
    for event in running:
        due = event.step > 0 and event.step % every == 0
        assert bool(event.preview) == due, (event.step, every)
        if due:
            assert decode_png(event.preview).size == expected
            assert len(event.preview) < 40_000  # a few KB (noise-like latents of random weights)


def test_previews_stay_within_their_time_budget(engine, models_dir, tmp_path):
    """A budget next to nothing: the first preview is made (no debt yet), then none until the
    steps have earned what it took."""
    running, _, _ = run_job(engine, models_dir, tmp_path, 1, budget=1e-9)
    assert [e.step for e in running if e.preview] == [1]


def test_the_budget_is_a_token_bucket():
    previews = pv.Previews(pv.LatentRgbMap(np.zeros((5, 3), np.float32)), every=2, budget=0.1)
    assert not previews.due(1) and previews.due(2)  # every other step
    previews.spend(0.003)  # a frame took 3 ms: 30 ms of denoising pays it back
    previews.earn(0.02)
    assert not previews.due(2)
    previews.earn(0.011)
    assert previews.due(2) and not previews.due(3)
    previews.earn(10.0)  # saved-up credit is capped: no burst
    assert previews.credit_s == pv.CREDIT_CAP_S
    with pytest.raises(ValueError):
        pv.Previews(previews.latent_map, every=0)


def test_no_previews_with_preview_every_zero(engine, models_dir, tmp_path):
    settings = load_settings({}, worker={"preview_every": 0})
    assert pv.worker_previews(settings, engine) is None
    running, _, _ = run_job(engine, models_dir, tmp_path, None)
    assert len(running) == STEPS + 1 and not any(e.preview for e in running)


def test_outside_the_mask_the_preview_is_the_templates_and_stable(engine, models_dir, tmp_path):
    running, prepared, latent_map = run_job(engine, models_dir, tmp_path, 1)
    frames = [np.asarray(decode_png(e.preview), dtype=np.int16) for e in running if e.preview]
    factor = frames[0].shape[0] // (SIZE // engine.pipe.vae_scale_factor)  # preview px per latent
    # the template's known latents (what the request is conditioned on outside its mask), mapped
    known = pv.known_latents(engine, prepared.extra_channels, latent_map.channels, (SIZE, SIZE))
    template = np.asarray(decode_png(pv.encode_png(latent_map.rgb(known), 64)), dtype=np.int16)
    outside = np.ones(frames[0].shape[:2], dtype=bool)
    # latent pixels under the mask, one more for the bilinear upscale's reach
    x0, y0, x1, y1 = latent_box(BOX, engine.pipe.vae_scale_factor)
    outside[y0 * factor : y1 * factor, x0 * factor : x1 * factor] = False
    assert outside.mean() > 0.4
    for frame in frames:
        assert np.array_equal(frame[outside], frames[0][outside])  # stable across steps
        assert np.abs(frame[outside] - template[outside]).max() <= 1  # the template's colours
    # and the painted area does change while denoising
    assert any(np.abs(f[~outside] - frames[0][~outside]).mean() > 0.5 for f in frames[1:])


def test_the_clean_estimate_is_the_schedulers_own(engine):
    """x0 from the step's two sides equals diffusers' ``pred_original_sample`` (Euler) or
    ``sample - sigma * v`` (flow matching)."""
    scheduler, timesteps = engine.adapter.schedule(STEPS, 1.0, (SIZE, SIZE))
    generator = torch.Generator().manual_seed(0)
    shape = (1, 4, 16, 16) if engine.spec.family != pv.FLUX else (1, 64, 64)
    sample = torch.randn(shape, generator=generator)
    output = torch.randn(shape, generator=generator)
    for t in timesteps[:2]:
        index = scheduler.step_index or 0
        sigma = float(scheduler.sigmas[index])
        step = scheduler.step(output, t, sample)
        estimate = pv.clean_estimate(scheduler, sample, step.prev_sample)
        reference = getattr(step, "pred_original_sample", None)
        if reference is None:  # flow matching: x_t = (1 - sigma) x0 + sigma noise, v = noise - x0
            reference = sample - sigma * output
        torch.testing.assert_close(estimate, reference, rtol=1e-4, atol=1e-4)
        sample = step.prev_sample


def test_the_map_is_persisted_by_fingerprint_and_fitted_without_a_loaded_vae(
    models_dir, tmp_path, monkeypatch
):
    model_id = "tiny-sd2-inpaint"
    denoiser_only = load_pipeline(model_id, models_dir, components={"unet", "scheduler"})
    worker_engine = MaskAwareEngine(denoiser_only, resolve_model(model_id), tmp_path / "cache")
    assert worker_engine.pipe.vae is None
    monkeypatch.setattr(pv, "_MAPS", {})
    fitted = pv.latent_rgb_map(worker_engine, tmp_path / "models")  # loads the VAE alone
    full = load_pipeline(model_id, models_dir)
    np.testing.assert_allclose(fitted.weights, pv.fit_latent_rgb(full.vae, "sd2-inpaint").weights)
    (path,) = (tmp_path / "models" / ".latent-rgb").glob("*.json")
    assert path == pv.map_path(tmp_path / "models", model_id, model_revision(worker_engine.spec))
    monkeypatch.setattr(pv, "_MAPS", {})  # a new process: read from disk, nothing fitted

    def no_fit(*args, **kwargs):
        raise AssertionError("fitted again")

    monkeypatch.setattr(pv, "fit_latent_rgb", no_fit)
    np.testing.assert_array_equal(
        pv.latent_rgb_map(worker_engine, tmp_path / "models").weights, fitted.weights
    )


@pytest.mark.model
def test_the_demo_models_map_tracks_what_its_vae_decodes():
    """On the trained demo VAE the linear map reproduces the decoded image of latents it was not
    fitted on (held-out scenes past the fitting seeds) with a correlation above 0.8."""
    spec = resolve_model("demo-sd2-inpaint")
    with tempfile.TemporaryDirectory() as root:
        pipe = load_pipeline(spec.model_id, Path(root))
        engine = MaskAwareEngine(pipe, spec, Path(root))
        latent_map = pv.latent_rgb_map(engine, Path(root))
    vae = pipe.vae
    seeds = range(100, 104)
    images = np.stack([np.asarray(make_scene(s, "heldout", 128).image) for s in seeds])
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    with torch.no_grad():
        latents = pv.engine_latents(vae, pixels, spec.family)
        decoded = vae.decode(latents / vae.config.scaling_factor).sample
    decoded = F.avg_pool2d((decoded.clamp(-1, 1) + 1) / 2, pipe.vae_scale_factor)
    mapped = np.stack([latent_map.rgb(latent) for latent in latents])
    truth = decoded.permute(0, 2, 3, 1).numpy()
    correlation = np.corrcoef(mapped.ravel(), truth.ravel())[0, 1]
    assert correlation > 0.8, correlation
    per_channel = [
        np.corrcoef(mapped[..., c].ravel(), truth[..., c].ravel())[0, 1] for c in (0, 1, 2)
    ]
    assert min(per_channel) > 0.6, per_channel


# ----- on the wire ------------------------------------------------------------------------------
PREVIEW = pv.encode_png(np.full((4, 4, 3), 0.5, dtype=np.float32), 16)


def test_preview_rides_the_event_payload_never_the_record():
    event = JobEvent(job_id="j", status="running", at=1.0, step=2, num_steps=4, preview=PREVIEW)
    assert decode(encode(event)) == event
    assert event_payload(event)["preview"] == PREVIEW
    assert "preview" not in event_fields(event)
    assert PREVIEW not in json.dumps(event_fields(event))
    # an old message (no preview) still reads; a preview on another status, or one that is not a
    # PNG data URL, is not carried
    old = json.loads(encode(event))
    del old["preview"]
    assert decode(json.dumps(old)).preview == ""
    for other in (
        JobEvent(job_id="j", status="done", at=1.0, preview=PREVIEW),
        JobEvent(job_id="j", status="running", at=1.0, preview='data:image/png;base64,"x"'),
    ):
        assert "preview" not in event_payload(other)


@pytest.fixture
def api(redis_url, redis_client, tmp_path):
    settings = make_settings(redis_url, tmp_path)
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as client:
        yield client


@pytest.mark.redis
def test_previews_on_the_sse_stream_not_in_the_job_and_gone_once_it_leaves_running(
    api, redis_client
):
    job_id = submit(api).json()["job_id"]
    store = JobStateStore(redis_client)
    frames = [pv.encode_png(np.full((8, 8, 3), step / 4, dtype=np.float32), 32) for step in (1, 2)]
    for step, frame in enumerate(frames, start=1):
        assert store.record_event(
            JobEvent(
                job_id=job_id,
                status="running",
                at=time.time(),
                step=step,
                num_steps=2,
                worker_id="w",
                preview=frame,
            )
        )
    record = api.get(f"/v1/jobs/{job_id}")
    assert record.status_code == 200 and "preview" not in record.text
    assert not any(b"data:image" in v for v in redis_client.hgetall(job_key(job_id)).values())

    def move_on():
        time.sleep(0.5)  # the client has read the running events by now
        store.record_event(JobEvent(job_id=job_id, status="postprocessing", at=time.time()))
        store.record_event(JobEvent(job_id=job_id, status="done", at=time.time()))

    thread = threading.Thread(target=move_on)
    thread.start()
    live = sse_events(api.get(f"/v1/jobs/{job_id}/events").text)
    thread.join()
    assert [e["status"] for e in live] == ["running", "running", "postprocessing", "done"]
    assert [e.get("preview") for e in live] == [*frames, None, None]
    # once the job left running its stream keeps every event, under the same ids, without images
    replayed = sse_events(api.get(f"/v1/jobs/{job_id}/events").text)
    assert [e["id"] for e in replayed] == [e["id"] for e in live]
    assert [{k: v for k, v in e.items() if k != "preview"} for e in live] == replayed
    stored = [json.loads(f[b"event"]) for _, f in redis_client.xrange(job_events_key(job_id))]
    assert [e.get("step") for e in stored] == [1, 2, None, None]
    assert not any("preview" in e for e in stored)

"""Pre/post-processing on the real tiny model, in process: upload -> bucket -> worker -> result at
the upload's own size with the template's pixels outside the mask; bad uploads fail before any
model."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from backend.blobs import BlobStore
from backend.config import load_settings
from backend.imaging.masks import MaskError
from backend.imaging.uploads import UploadError
from backend.protocol import EditJob, MaskOps
from backend.tasks.core import CpuStages
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from templates_store.samples import sample_template
from tests.factories import make_engine

WIDTH, HEIGHT = 200, 150  # not square, not a bucket size: exercises crop, resize and paste-back
BOX = (60, 40, 130, 100)  # x0, y0, x1, y1 of the painted area, in upload pixels


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def painted_mask(box=BOX, size=(WIDTH, HEIGHT)) -> Image.Image:
    pixels = np.zeros(size[::-1], dtype=np.uint8)
    x0, y0, x1, y1 = box
    pixels[y0:y1, x0:x1] = 255
    return Image.fromarray(pixels)


def assert_edited_inside_only(
    result_png: bytes, template: Image.Image, box=BOX, reach: int = 0
) -> None:
    """The result has the template's size, its pixels outside ``box`` grown by ``reach`` are the
    template's own, and the painted area changed."""
    result = np.asarray(Image.open(io.BytesIO(result_png)).convert("RGB"))
    before = np.asarray(template.convert("RGB"))
    x0, y0, x1, y1 = box
    outside = np.ones(before.shape[:2], dtype=bool)
    outside[max(0, y0 - reach) : y1 + reach, max(0, x0 - reach) : x1 + reach] = False
    assert result.shape == before.shape and np.array_equal(result[outside], before[outside])
    assert np.abs(result[y0:y1, x0:x1].astype(int) - before[y0:y1, x0:x1]).mean() > 1.0


@pytest.fixture(scope="module")
def stages(models_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    settings = load_settings(env={}, paths={"data_dir": str(root), "models_dir": str(models_dir)})
    engine = make_engine("sd2-inpaint", models_dir, root / "cache")
    return CpuStages(settings, engine, blobs=BlobStore(root / "blobs"))


def edit_job(stages, job_id, template_bytes, mask_bytes, **fields) -> EditJob:
    blobs = stages.blobs
    values = dict(
        job_id=job_id,
        model_id=stages.engine.spec.model_id,
        template_ref=blobs.put("uploads", f"{job_id}-template.png", template_bytes),
        mask_ref=blobs.put("uploads", f"{job_id}-mask.png", mask_bytes),
        prompt="a blue vase",
        seed=3,
        steps=3,
        guidance=7.5,
        resolution=128,
    )
    values.update(fields)
    return EditJob(**values)


def run_worker(stages, prepared):
    inbox, sink = LocalInbox(), LocalSink()
    worker = EngineWorker(stages.engine, stages.blobs, inbox, sink)
    inbox.put(prepared)
    for _ in range(50):
        worker.iterate()
        if sink.denoised_jobs:
            return sink.denoised_jobs[0]
    raise AssertionError("the worker did not finish the job")


def test_an_upload_goes_through_pre_worker_and_post_to_a_result_at_its_own_size(stages):
    template = sample_template(WIDTH, HEIGHT, seed=4)
    job = edit_job(
        stages, "e2e", png(template), png(painted_mask()), mask_ops=MaskOps(feather_px=3)
    )
    prepared = stages.preprocess(job)
    assert prepared.template_ref == job.template_ref and 0.0 < prepared.mask_ratio < 0.5
    assert prepared.timings["pre_s"] > 0 and stages.blobs.exists(prepared.prepared_ref)
    denoised = run_worker(stages, prepared)
    event = stages.postprocess(denoised)
    assert event.status == "done" and set(event.timings) >= {
        "pre_s",
        "wait_s",
        "denoise_s",
        "post_s",
    }
    # the feather's reach
    assert_edited_inside_only(stages.blobs.get(event.result_ref), template, reach=4)
    thumb = Image.open(io.BytesIO(stages.blobs.get(event.thumbnail_ref)))
    assert max(thumb.size) <= 256
    # intermediates are gone once the result is stored
    assert not stages.blobs.exists(denoised.latents_ref) and not stages.blobs.exists(
        denoised.prepared_ref
    )


def test_pre_processing_is_deterministic(stages):
    template = png(sample_template(WIDTH, HEIGHT, seed=5))
    first = stages.preprocess(edit_job(stages, "det-a", template, png(painted_mask())))
    second = stages.preprocess(edit_job(stages, "det-b", template, png(painted_mask())))
    assert first.cache_digest == second.cache_digest and first.mask_ratio == second.mask_ratio
    assert stages.blobs.get(first.prepared_ref) == stages.blobs.get(second.prepared_ref)


@pytest.mark.parametrize(
    "template_bytes, mask_bytes, error, words",
    [
        (b"not an image", None, UploadError, "not an image"),
        (b"", None, UploadError, "empty"),
        (None, png(Image.new("L", (WIDTH, HEIGHT), 0)), MaskError, "empty"),
        (None, png(Image.new("L", (64, 64), 255)), MaskError, "does not match"),
    ],
)
def test_bad_uploads_fail_with_a_message_before_any_model_runs(
    stages, template_bytes, mask_bytes, error, words
):
    template_bytes = (
        png(sample_template(WIDTH, HEIGHT, seed=6)) if template_bytes is None else template_bytes
    )
    mask_bytes = png(painted_mask()) if mask_bytes is None else mask_bytes
    with pytest.raises(error, match=words):
        stages.preprocess(edit_job(stages, "bad", template_bytes, mask_bytes))


def test_a_job_for_another_model_is_refused(stages):
    job = edit_job(
        stages,
        "other",
        png(sample_template(WIDTH, HEIGHT)),
        png(painted_mask()),
        model_id="tiny-flux-fill",
    )
    with pytest.raises(ValueError, match="this CPU worker serves tiny-sd2-inpaint"):
        stages.preprocess(job)


def test_an_upload_over_the_pixel_limit_is_refused(stages, monkeypatch):
    job = edit_job(stages, "big", png(sample_template(WIDTH, HEIGHT)), png(painted_mask()))
    small = load_settings(env={}, celery={"max_upload_pixels": 64 * 64})
    monkeypatch.setattr(stages, "settings", small)
    with pytest.raises(UploadError, match="limit"):
        stages.preprocess(job)


def test_a_prepare_job_records_the_templates_cache_once(stages, tmp_path):
    from backend.cache import TieredActivationCache
    from backend.imaging.uploads import fit_to_bucket

    template = sample_template(WIDTH, HEIGHT, seed=8)
    job = edit_job(stages, "prep-1", png(template), b"", prepare=True)
    prepared = stages.preprocess(job)
    assert prepared.prepare and prepared.mask_ratio == 1.0 and prepared.cache_digest
    caches = TieredActivationCache(stages.engine.cache_root, 1 << 30, 1 << 32)
    inbox, sink = LocalInbox(), LocalSink()
    worker = EngineWorker(stages.engine, stages.blobs, inbox, sink, caches=caches)
    inbox.put(prepared)
    for _ in range(50):
        worker.iterate()
        if inbox.acked:
            break
    # no image, no post-processing
    assert sink.statuses("prep-1")[-1] == "done" and sink.denoised_jobs == []
    assert sink.events[-1].message == "cache recorded"
    params = stages._params(job, (128, 128))
    cache = stages.engine.lookup(fit_to_bucket(template, (128, 128)), params)
    assert cache is not None and cache.key.digest() == prepared.cache_digest
    # an edit of that template now reads the cache
    edit = stages.preprocess(edit_job(stages, "after-prep", png(template), png(painted_mask())))
    assert edit.cache_digest == prepared.cache_digest
    inbox.put(stages.preprocess(edit_job(stages, "prep-2", png(template), b"", prepare=True)))
    for _ in range(10):
        worker.iterate()
    assert (
        sink.statuses("prep-2") == ["waiting", "done"]
        and sink.events[-1].message == "already prepared"
    )
    caches.close()

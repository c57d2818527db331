"""Pre- and post-processing: the CPU work around a denoise, shared by the Celery tasks, the
worker's ``inline`` mode and the worker benchmark (one implementation, three callers).

pre:  template + mask files -> validated images -> resolution bucket -> mask ops -> the crop
      (the bucket's centre crop, or with ``inpaint_area="masked"`` a padded box around the mask)
      -> text encoders and VAE encode -> a ``PreparedRequest`` file + a ``PreparedJob`` message
      (by reference).
post: final latents -> VAE decode -> paste-back into the crop box at the upload's own resolution
      -> PNG result, WebP thumbnail -> the job marked done.
erase: an ``EditJob`` of mode ``erase`` is finished by pre-processing itself (``erase_job``):
      template + mask -> mask ops -> OpenCV inpainting (Telea) -> the result written and the job
      marked done by the same ``store_result`` as post; no model, no worker.

Invariants:
* the result has the uploaded template's size, and every pixel outside the (processed) mask is the
  template's own pixel, bit for bit; generated pixels only land inside the mask;
* both stages are idempotent: outputs are written atomically under names derived from the job id,
  a stage re-run for a job that already moved past it does nothing, and a finished job is never
  finished twice (the job state store keeps the first terminal status);
* a bad input raises ``UploadError``/``MaskError`` (the user's to fix) before any model runs.
"""

from __future__ import annotations

import io
import logging
import time

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from backend.blobs import BlobStore, job_blob_name
from backend.blobs.factory import open_blob_store
from backend.cache.key import pinned_key
from backend.config import Settings
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.factory import edit_params
from backend.engine.prepared import PreparedRequest
from backend.imaging.erase import erase
from backend.imaging.masks import feather, feather_support, paste_back
from backend.imaging.uploads import (
    crop_box_for,
    decode_image,
    encode_image,
    fit_to_bucket,
    mask_to_bucket,
    masked_crop_box,
    process_mask,
    resolution_bucket,
    thumbnail,
    validate_inpaint_area,
)
from backend.protocol import DenoisedJob, EditJob, JobEvent, PastePlan, PreparedJob

log = logging.getLogger(__name__)

THUMBNAIL_SIDE = 256


class CpuStages:
    """Pre/post-processing for one model. ``engine`` needs the text encoders and the VAE only: a
    CPU worker's holds no denoiser (``build_engine(role=CPU_STAGES)``), an ``inline`` engine
    worker passes its whole engine. ``jobstate`` (a ``JobStateStore``) is optional: without it
    (benchmarks) nothing is reported."""

    def __init__(
        self,
        settings: Settings,
        engine: MaskAwareEngine,
        jobstate=None,
        blobs: BlobStore | None = None,
    ):
        self.settings, self.engine, self.jobstate = settings, engine, jobstate
        self.blobs = blobs or open_blob_store(settings)
        self._publish_key_basis()

    # ----- pre ----------------------------------------------------------------------------------
    def preprocess(self, job: EditJob) -> PreparedJob:
        if job.mode == "erase":
            raise ValueError(
                "an erase job is finished in pre-processing (erase_job), not prepared for a worker"
            )
        started = time.time()
        self._event(job.job_id, "preprocessing")
        if job.model_id != self.engine.spec.model_id:
            raise ValueError(
                f"job is for model {job.model_id}, this CPU worker serves "
                f"{self.engine.spec.model_id}"
            )
        limit = self.settings.celery.max_upload_pixels
        template = decode_image(self.blobs.get(job.template_ref), limit, what="template")
        size_hw = resolution_bucket(
            template.width,
            template.height,
            job.resolution or self.engine.spec.default_resolution,
            self.engine.size_multiple,
        )
        params = self._params(job, size_hw)
        if job.prepare:
            return self._prepare_recording(job, template, size_hw, params, started)
        mask_image = decode_image(self.blobs.get(job.mask_ref), limit, what="mask")
        full_mask = process_mask(mask_image, template.size, job.mask_ops)
        # the model repaints every pixel the feathered paste-back takes (alpha > 0), so the token
        # mask computed from these pixels covers them all (backend.imaging.masks, module notes)
        support = feather_support(full_mask, job.mask_ops.feather_px)
        validate_inpaint_area(job.inpaint_area, job.crop_padding_px)
        if job.inpaint_area == "masked":  # a padded crop around the mask (docs/design/crop.md)
            box = masked_crop_box(support, size_hw, job.crop_padding_px)
        else:
            box = crop_box_for(template.size, size_hw)
        pixels = mask_to_bucket(support, size_hw, box)
        if self.settings.worker.batching == "baseline":
            prepared = self._baseline_request(job, params, pixels)
        else:
            prepared = self.engine.encode(
                fit_to_bucket(template, size_hw, box),
                None,
                job.prompt,
                job.seed,
                params,
                pixels=pixels,
            )
        prepared_ref = self._save_prepared(job.job_id, prepared)
        self._publish_key_basis()
        mask_ref = self.blobs.put(
            "masks",
            job_blob_name("masks", job.job_id),
            encode_image(Image.fromarray(full_mask.astype(np.uint8) * 255)),
        )
        timings = {
            "queue_s": max(0.0, started - job.submitted_at) if job.submitted_at else 0.0,
            "pre_s": time.time() - started,
        }
        return PreparedJob(
            job_id=job.job_id,
            model_id=job.model_id,
            prepared_ref=prepared_ref,
            template_ref=job.template_ref,
            num_steps=len(self._timesteps(params)),
            mask_ratio=float(pixels.mean()),
            cache_digest=prepared.cache_key.digest() if prepared.cache_key else "",
            paste=PastePlan(
                mask_ref=mask_ref, crop_box=list(box), feather_px=job.mask_ops.feather_px
            ),
            submitted_at=job.submitted_at,
            timings=timings,
            prompt=job.prompt,
            adapters=job.adapters,
            service=job.service,
            batch_id=job.batch_id,
        )

    def _baseline_request(
        self, job: EditJob, params: EditParams, pixels: np.ndarray
    ) -> PreparedRequest:
        """What a ``baseline`` worker reads: the mask, seed and settings, no tensors. Its ordinary
        pipeline encodes the prompt and the image itself, as a user's would, so encoding them here
        too would bill the baseline twice."""
        empty = torch.zeros(0)
        return PreparedRequest(
            model_id=job.model_id,
            params=params.to_dict(),
            seed=job.seed,
            pixels=pixels,
            init_latents=empty,
            conditioning={},
            extra_channels=empty,
            halves=1,
            guidance=params.guidance,
        )

    def _prepare_recording(
        self, job: EditJob, template, size_hw, params: EditParams, started: float
    ) -> PreparedJob:
        """A cache recording: the ordinary computation over the whole template with the template
        seed, as ``MaskAwareEngine.prepare_template`` runs it (nothing masked, no prompt)."""
        pixels = np.zeros(size_hw, dtype=bool)
        prepared = self.engine.encode(
            fit_to_bucket(template, size_hw),
            None,
            "",
            params.template_seed,
            params,
            pixels=pixels,
            record=True,
        )
        if job.adapters:  # a cache pinned to the job's adapter set
            pairs = [(use.sha256, use.scale) for use in job.adapters]
            prepared.cache_key = pinned_key(prepared.cache_key, pairs)
        prepared_ref = self._save_prepared(job.job_id, prepared)
        self._publish_key_basis()
        return PreparedJob(
            job_id=job.job_id,
            model_id=job.model_id,
            prepared_ref=prepared_ref,
            template_ref=job.template_ref,
            num_steps=len(self._timesteps(params)),
            mask_ratio=1.0,
            cache_digest=prepared.cache_key.digest(),
            submitted_at=job.submitted_at,
            timings={"pre_s": time.time() - started},
            prepare=True,
            adapters=job.adapters,
            service=job.service,
        )

    def _save_prepared(self, job_id: str, prepared: PreparedRequest) -> str:
        with self.blobs.writing("prepared", job_blob_name("prepared", job_id)) as (ref, path):
            prepared.save(path)
        return ref

    def _publish_key_basis(self) -> None:
        """What this model contributes to cache keys, for the cache status (which builds a
        template's key without loading the model): when the stages start, and again with every
        job, so a Redis that lost it learns it back."""
        if self.jobstate is not None:
            from backend.cachestatus import publish_key_basis

            publish_key_basis(self.jobstate.client, self.engine.key_basis())

    def _params(self, job: EditJob, size_hw: tuple[int, int]) -> EditParams:
        return edit_params(
            self.engine.spec,
            self.settings,
            steps=job.steps,
            guidance=job.guidance,
            size=size_hw,
            strength=job.strength,
            negative_prompt=job.negative_prompt,
            use_cache=job.use_cache,
        )  # no feather_px: the mask handed over is its support already, pasted back in post

    def _timesteps(self, params: EditParams):
        return self.engine.adapter.schedule(params.steps, params.strength, params.size)[1]

    # ----- post ---------------------------------------------------------------------------------
    def postprocess(self, job: DenoisedJob) -> JobEvent | None:
        """Decode, paste back, store the result; returns the ``done`` event (None if already
        done)."""
        if self.jobstate is not None and self.jobstate.status(job.job_id) in (
            "done",
            "failed",
            "cancelled",
        ):
            log.info("post-processing of %s skipped: the job already finished", job.job_id)
            return None
        started = time.time()
        self._event(job.job_id, "postprocessing")
        with self.blobs.reading(job.prepared_ref) as path:
            prepared = PreparedRequest.load(path)
        params = EditParams.from_dict(prepared.params)
        with self.blobs.reading(job.latents_ref) as path:
            latents = load_file(str(path))["latents"].to(self.engine.adapter.device)
        with torch.no_grad():
            generated = self.engine.decode(latents, params)
        template = decode_image(
            self.blobs.get(job.template_ref),
            self.settings.celery.max_upload_pixels,
            what="template",
        )
        result = self._paste(generated, template, prepared, params, job.paste)
        event = store_result(
            self.blobs,
            self.jobstate,
            job.job_id,
            result,
            {**job.timings, "post_s": time.time() - started},
            job.submitted_at,
            job.adapter_steps,
        )
        for ref in (job.latents_ref, job.prepared_ref):  # intermediates: the result is stored now
            self.blobs.delete(ref)
        return event

    def _paste(
        self,
        generated: Image.Image,
        template: Image.Image,
        prepared: PreparedRequest,
        params: EditParams,
        paste: PastePlan | None,
    ) -> Image.Image:
        if not paste:  # a job prepared at the model resolution (no bucket crop): paste back there
            return self.engine.compose(generated, template, prepared.pixels, params)
        left, top, right, bottom = paste.crop_box
        mask = np.asarray(Image.open(io.BytesIO(self.blobs.get(paste.mask_ref))).convert("L")) > 127
        inside = np.zeros_like(mask)
        inside[top:bottom, left:right] = True  # the bucket crop's margins were never generated
        alpha = feather(mask & inside, paste.feather_px) * inside
        canvas = template.copy()
        canvas.paste(generated.resize((right - left, bottom - top), Image.LANCZOS), (left, top))
        return paste_back(canvas, template, alpha)

    def _event(self, job_id: str, status: str) -> None:
        if self.jobstate is not None:
            self.jobstate.record_event(JobEvent(job_id=job_id, status=status, at=time.time()))


def store_result(
    blobs: BlobStore,
    jobstate,
    job_id: str,
    result: Image.Image,
    timings: dict[str, float],
    submitted_at: float,
    adapter_steps: dict[str, int] | None = None,
) -> JobEvent:
    """Write a finished job's result (PNG) and thumbnail (WebP) under names derived from its id,
    add ``total_s`` to its timings and mark it done (``jobstate`` None: nothing is reported).
    Post-processing and erase both finish a job through here. ``adapter_steps``: the step each
    LoRA adapter joined the row at, for the job's record."""
    result_ref = blobs.put("results", job_blob_name("results", job_id), encode_image(result, "png"))
    thumb_ref = blobs.put(
        "thumbnails", job_blob_name("thumbnails", job_id), thumbnail(result, THUMBNAIL_SIDE)
    )
    timings = dict(timings)
    timings["total_s"] = time.time() - submitted_at if submitted_at else sum(timings.values())
    event = JobEvent(
        job_id=job_id,
        status="done",
        at=time.time(),
        timings=timings,
        result_ref=result_ref,
        thumbnail_ref=thumb_ref,
        adapter_steps=dict(adapter_steps or {}),
    )
    if jobstate is not None:
        jobstate.record_event(event)
    return event


def erase_job(
    settings: Settings, job: EditJob, jobstate=None, blobs: BlobStore | None = None
) -> JobEvent:
    """Finish an erase job in pre-processing: the template and mask as uploaded, the mask ops,
    OpenCV's inpainting (``backend.imaging.erase``) at the template's own resolution, then the
    result stored and the job marked done like a generated one (``store_result``). Needs no
    model. Raises UploadError/MaskError for a bad upload, like ``preprocess``."""
    started = time.time()
    blobs = blobs or open_blob_store(settings)
    if jobstate is not None:
        jobstate.record_event(JobEvent(job_id=job.job_id, status="preprocessing", at=started))
    limit = settings.celery.max_upload_pixels
    template = decode_image(blobs.get(job.template_ref), limit, what="template")
    mask_image = decode_image(blobs.get(job.mask_ref), limit, what="mask")
    full_mask = process_mask(mask_image, template.size, job.mask_ops)
    erase_started = time.time()
    result = erase(template, full_mask, job.mask_ops.feather_px)
    timings = {
        "queue_s": max(0.0, started - job.submitted_at) if job.submitted_at else 0.0,
        "pre_s": erase_started - started,
        "erase_s": time.time() - erase_started,
    }
    return store_result(blobs, jobstate, job.job_id, result, timings, job.submitted_at)

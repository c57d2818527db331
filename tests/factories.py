"""Factories for tests: tiny engines, templates, masks and edit parameters."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import numpy as np
from PIL import Image

from backend import protocol
from backend.config import Settings, load_settings
from backend.engine.cache_store import CacheKey
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.models import load_pipeline, resolve_model
from backend.protocol import DenoisedJob
from backend.protocol.keys import cpu_queue_lists
from templates_store.samples import sample_template

SIZE = 128
STEPS = 3
FAMILIES = ("sd2-inpaint", "sdxl-inpaint", "flux-fill")
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>`` (a Python file that is not part of a package) as a module."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, SCRIPTS / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_engine(family: str, models_dir, cache_dir) -> MaskAwareEngine:
    model_id = f"tiny-{family}"
    pipe = load_pipeline(model_id, models_dir)
    return MaskAwareEngine(pipe, resolve_model(model_id), cache_dir)


def make_params(engine: MaskAwareEngine, **overrides) -> EditParams:
    fields = dict(
        steps=STEPS, guidance=engine.spec.default_guidance, size=(SIZE, SIZE), template_seed=5
    )
    fields.update(overrides)
    return EditParams(**fields)


def make_template(seed: int = 7, size: int = SIZE) -> Image.Image:
    return sample_template(size, size, seed=seed)


def rect_mask(box: tuple[int, int, int, int], size: int = SIZE) -> Image.Image:
    """Mask with 255 (repaint) inside box = (x0, y0, x1, y1)."""
    pixels = np.zeros((size, size), dtype=np.uint8)
    x0, y0, x1, y1 = box
    pixels[y0:y1, x0:x1] = 255
    return Image.fromarray(pixels)


def full_mask(size: int = SIZE) -> Image.Image:
    return Image.fromarray(np.full((size, size), 255, dtype=np.uint8))


MASK = rect_mask((32, 40, 96, 80))


def make_prepared_job(
    engine: MaskAwareEngine,
    blobs,
    job_id: str,
    template: Image.Image,
    mask: Image.Image,
    seed: int,
    params: EditParams,
    prompt: str = "a blue vase",
):
    """What pre-processing hands a worker: the PreparedRequest file, the template PNG and the
    message."""
    from backend.protocol import PreparedJob

    prepared = engine.encode(template, mask, prompt, seed, params)
    with blobs.writing("prepared", f"{job_id}.safetensors") as (prepared_ref, path):
        prepared.save(path)
    buffer = io.BytesIO()
    template.save(buffer, format="PNG")
    template_ref = blobs.put("templates", f"{job_id}.png", buffer.getvalue())
    return PreparedJob(
        job_id=job_id,
        model_id=engine.spec.model_id,
        prepared_ref=prepared_ref,
        template_ref=template_ref,
        num_steps=params.steps,
        mask_ratio=float(prepared.pixels.mean()),
        cache_digest=prepared.cache_key.digest() if prepared.cache_key else "",
        prompt=prompt,
    )


def cache_key(n: int = 0, num_steps: int = 2, mode: str = "kv") -> CacheKey:
    """The cache key of template ``n`` of the tiny sd2 model at 64 px (distinct ``n``, distinct
    entries)."""
    return CacheKey(
        image_sha256=f"{n:064x}",
        model_id="tiny-sd2-inpaint",
        model_revision="r1",
        height=64,
        width=64,
        num_steps=num_steps,
        scheduler="EulerDiscreteScheduler",
        strength=1.0,
        template_seed=0,
        mode=mode,
    )


def queued_tasks(client, queue: str) -> list:
    """The first argument (a ``backend.protocol`` message, decoded) of each Celery task waiting in
    CPU queue ``queue``, every level, in the order the CPU workers take them: the lowest level
    first, the oldest first within a level (kombu pushes on the left and pops on the right)."""
    return [protocol.decode(celery_args(task)[0]) for task in queued_raw(client, queue)]


def queued_raw(client, queue: str) -> list[bytes]:
    """The Celery task messages waiting in CPU queue ``queue`` as Redis holds them, in the order
    of ``queued_tasks``."""

    return [
        task for name in cpu_queue_lists(queue) for task in reversed(client.lrange(name, 0, -1))
    ]


def celery_args(raw: bytes) -> list:
    """The positional arguments of a Celery task message as Redis holds it (JSON envelope, body
    in base64)."""
    return json.loads(base64.b64decode(json.loads(raw)["body"]))[0]


def make_denoised_job(job_id: str, **fields):
    """A ``DenoisedJob`` as an engine worker hands it on (refs named after the job)."""
    return DenoisedJob(
        **{
            "job_id": job_id,
            "model_id": "tiny-sd2-inpaint",
            "latents_ref": f"latents/{job_id}.safetensors",
            "prepared_ref": f"prepared/{job_id}.safetensors",
            "template_ref": "uploads/t.png",
            "used_cache": False,
            **fields,
        }
    )


def worker_service_settings(
    redis_url: str, models_dir, data_dir, worker_id: str, env: dict | None = None
) -> Settings:
    """Settings of an engine worker service on a test's Redis, with small cache budgets."""
    return load_settings(
        env=env or {},
        paths={"data_dir": str(data_dir), "models_dir": str(models_dir)},
        redis={"url": redis_url},
        worker={"worker_id": worker_id},
        cache={"ram_budget_mb": 64, "disk_budget_mb": 256},
    )


@contextmanager
def built_worker(redis_url: str, redis_client, models_dir, data_dir, worker_id: str, env=None):
    """(settings, worker, caches) of an engine worker service built as ``maskserve worker``
    builds it (``worker_service_settings``); its caches are closed on leaving."""
    from backend.tasks.celery_app import make_celery
    from backend.worker.service import build_worker

    settings = worker_service_settings(redis_url, models_dir, data_dir, worker_id, env)
    worker, caches = build_worker(settings, redis_client, make_celery(settings))
    try:
        yield settings, worker, caches
    finally:
        caches.close()

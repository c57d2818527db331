"""A template's cache status is asked for given settings and follows content, not the last job.

Against a real Redis and the real API (no Celery worker runs: pre-processing runs in process on
the tiny models where a test needs it). The digest the status computes for a template and settings
is the one pre-processing computes for a job of those settings (so they cannot drift); a job of
other settings on the template changes nothing; the same pixels under another name share the
status; bad settings are refused like a job submission refuses them.
"""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from backend import protocol
from backend.api.app import create_app
from backend.cache.key import ModelKeyBasis
from backend.cachestatus import publish_key_basis
from backend.config import load_settings
from backend.jobstate import JobStateStore
from backend.models.catalog import DEFAULT_MODEL, resolve_model
from backend.protocol import JobEvent, WorkerHeartbeat
from backend.protocol.keys import heartbeat_key
from templates_store.samples import sample_template
from tests.test_api import KEY, make_settings, pre_queue_jobs
from tests.test_import_guards import MODEL_LIBRARIES, loaded_after_import

WIDTH, HEIGHT = 200, 150  # not square: the bucket crops and resizes
BASIS = ModelKeyBasis(DEFAULT_MODEL, "rev-1", "EulerDiscreteScheduler", True, 8)


def png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def mask_png(box=(60, 40, 130, 100)) -> bytes:
    mask = Image.new("L", (WIDTH, HEIGHT), 0)
    mask.paste(255, box)
    return png(mask)


TEMPLATE = sample_template(WIDTH, HEIGHT, seed=11)


@pytest.fixture
def client(redis_url, redis_client, tmp_path):
    with TestClient(
        create_app(make_settings(redis_url, tmp_path), redis_client=redis_client),
        headers={"X-API-Key": KEY},
    ) as test_client:
        yield test_client


def upload(client, data: bytes, name: str, filename: str = "t.png") -> str:
    response = client.post("/v1/templates", files={"file": (filename, data)}, data={"name": name})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def status(client, template_id: str, **params) -> dict:
    response = client.get(f"/v1/templates/{template_id}/cache", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def beat(redis_client, worker_id: str, ram=(), disk=(), at: float | None = None, device=()) -> None:
    heartbeat = WorkerHeartbeat(
        worker_id=worker_id,
        model_id=DEFAULT_MODEL,
        device="cpu",
        at=time.time() if at is None else at,
        max_batch=8,
        batching="continuous",
        resident_ram=list(ram),
        resident_disk=list(disk),
        resident_device=list(device),
    )
    redis_client.set(heartbeat_key(worker_id), protocol.encode(heartbeat), ex=5)


def test_a_job_of_other_settings_leaves_the_status_of_the_default_settings(client, redis_client):
    publish_key_basis(redis_client, BASIS)
    template_id = upload(client, png(TEMPLATE), "room")
    default = status(client, template_id)
    spec = resolve_model(DEFAULT_MODEL)
    assert default["status"] == "not prepared" and default["digest"]
    assert default["settings"] == {
        "resolution": spec.default_resolution,
        "steps": spec.default_steps,
        "strength": 1.0,
    }
    beat(redis_client, "w1", ram=[default["digest"]])
    assert status(client, template_id) == default | {"status": "in RAM", "workers": ["w1"]}

    # a 60-step job on the template, cancelled: nothing about the 20-step cache changes
    submitted = client.post(
        "/v1/jobs",
        data={"template_id": template_id, "prompt": "a red star", "steps": "60"},
        files={"mask": ("mask.png", mask_png(), "image/png")},
    )
    assert submitted.status_code == 202, submitted.text
    assert client.delete(f"/v1/jobs/{submitted.json()['job_id']}").status_code == 200
    assert status(client, template_id)["status"] == "in RAM"
    explicit = status(client, template_id, steps=spec.default_steps, resolution=0, strength=1.0)
    assert explicit["digest"] == default["digest"] and explicit["status"] == "in RAM"

    sixty = status(client, template_id, steps=60)
    assert sixty["status"] == "not prepared" and sixty["workers"] == []
    assert sixty["digest"] not in ("", default["digest"])
    assert status(client, template_id, strength=0.5)["digest"] != default["digest"]
    assert status(client, template_id, resolution=256)["digest"] != default["digest"]
    # with classifier-free guidance the template is recorded without a prompt: guidance is no input
    assert status(client, template_id, guidance=3.0)["digest"] == default["digest"]
    beat(redis_client, "w2", disk=[sixty["digest"]])
    assert status(client, template_id, steps=60) | {"settings": None} == sixty | {
        "status": "on disk",
        "workers": ["w2"],
        "settings": None,
    }


def test_the_status_names_the_fastest_tier_and_its_workers_first(client, redis_client):
    publish_key_basis(redis_client, BASIS)
    template_id = upload(client, png(TEMPLATE), "room")
    digest = status(client, template_id)["digest"]
    beat(redis_client, "w1", ram=[digest], disk=[digest])
    beat(redis_client, "w2", device=[digest], disk=[digest])  # RAM dropped its copy
    beat(redis_client, "w3", disk=[digest])
    answer = status(client, template_id)
    assert answer["status"] == "on device" and answer["workers"] == ["w2", "w1", "w3"]


def test_the_same_pixels_under_another_name_share_the_cache(client, redis_client):
    publish_key_basis(redis_client, BASIS)
    first = upload(client, png(TEMPLATE), "room")
    digest = status(client, first)["digest"]
    beat(redis_client, "w1", ram=[digest])
    # another name, another file format, another id: the same decoded pixels
    copy = upload(client, png(TEMPLATE, "BMP"), "room (copy)", filename="copy.bmp")
    assert copy != first
    assert status(client, copy) == status(client, first)
    assert status(client, copy)["status"] == "in RAM" and status(client, copy)["workers"] == ["w1"]
    other = upload(client, png(sample_template(WIDTH, HEIGHT, seed=12)), "other")
    assert status(client, other)["status"] == "not prepared"
    assert status(client, other)["digest"] != digest


def test_a_prepare_job_counts_only_for_its_own_settings(client, redis_client):
    """Before any heartbeat lists the cache, the status follows the template's prepare job of the
    asked settings: ``preparing``, then ``in RAM`` on its worker until that worker's next
    heartbeat; a prepare job of other settings says nothing about these."""
    publish_key_basis(redis_client, BASIS)
    template_id = upload(client, png(TEMPLATE), "room")
    accepted = client.post(f"/v1/templates/{template_id}/prepare", data={"steps": "6"}).json()
    cache_url = accepted["cache_url"]
    assert client.get(cache_url).json()["status"] == "preparing"
    assert status(client, template_id, steps=6)["status"] == "preparing"
    assert status(client, template_id)["status"] == "not prepared"
    started = time.time()
    beat(redis_client, "w3", at=started)
    store = JobStateStore(redis_client)
    store.record_event(
        JobEvent(job_id=accepted["job_id"], status="done", at=started + 1, worker_id="w3")
    )
    assert status(client, template_id, steps=6)["status"] == "in RAM"
    assert status(client, template_id, steps=6)["workers"] == ["w3"]
    assert status(client, template_id)["status"] == "not prepared"
    beat(redis_client, "w3", at=started + 2)  # its next heartbeat does not list it: evicted
    assert status(client, template_id, steps=6)["status"] == "not prepared"


def test_without_a_published_key_basis_only_the_prepare_job_speaks(client, redis_client):
    """No CPU stages of the model have started yet: no key can be built (the digest is empty),
    and the status still follows the prepare job."""
    template_id = upload(client, png(TEMPLATE), "room")
    assert status(client, template_id) | {"settings": None} == {
        "model": DEFAULT_MODEL,
        "status": "not prepared",
        "digest": "",
        "workers": [],
        "settings": None,
    }
    client.post(f"/v1/templates/{template_id}/prepare")
    assert status(client, template_id)["status"] == "preparing"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"steps": "0"}, "steps"),
        ({"steps": "1000"}, "steps"),
        ({"strength": "2"}, "strength"),
        ({"strength": "0"}, "strength"),
        ({"guidance": "99"}, "guidance"),
        ({"resolution": "10"}, "resolution"),
    ],
)
def test_bad_settings_are_refused_as_a_job_submission_refuses_them(client, params, field):
    template_id = upload(client, png(TEMPLATE), "room")
    refused = client.get(f"/v1/templates/{template_id}/cache", params=params)
    as_job = client.post(
        "/v1/jobs",
        data={"template_id": template_id, "prompt": "a red star"} | params,
        files={"mask": ("mask.png", mask_png(), "image/png")},
    )
    assert refused.status_code == as_job.status_code == 422
    assert refused.json()["error"] == as_job.json()["error"]
    assert refused.json()["error"].startswith(field)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"model": "nope"}, "unknown model 'nope'"),
        ({"steps": "many"}, "steps"),
        ({"strength": "strong"}, "strength"),
    ],
)
def test_unknown_models_and_unreadable_numbers_are_refused(client, params, words):
    template_id = upload(client, png(TEMPLATE), "room")
    refused = client.get(f"/v1/templates/{template_id}/cache", params=params)
    assert refused.status_code == 422 and words in refused.json()["error"]


def test_another_keys_template_is_not_found(client):
    template_id = upload(client, png(TEMPLATE), "room")
    client.headers["X-API-Key"] = "test-key-2"
    assert client.get(f"/v1/templates/{template_id}/cache").status_code == 404


@pytest.mark.parametrize("family", ["sd2-inpaint", "flux-fill"])
def test_the_status_digest_is_the_one_pre_processing_computes(
    family, models_dir, redis_url, redis_client, tmp_path
):
    """One implementation of the key: for a job and for a prepare job on a gallery template, the
    digest pre-processing gives the job (on the real tiny model, with a non-default template seed
    and cache mode) is the one the status computes for the job's settings."""
    from backend.tasks.core import CpuStages
    from tests.factories import make_engine

    model_id = f"tiny-{family}"
    settings = load_settings(
        {
            "MASKSERVE_REDIS_URL": redis_url,
            "MASKSERVE_DATA_DIR": str(tmp_path / "data"),
            "MASKSERVE_API_KEYS": KEY,
        },
        api={"read_rate_per_minute": 0, "write_rate_per_minute": 0},
        engine={"model_id": model_id, "template_seed": 3, "cache_mode": "hidden"},
        paths={"models_dir": str(models_dir)},
    )
    engine = make_engine(family, models_dir, tmp_path / "cache")
    stages = CpuStages(settings, engine, JobStateStore(redis_client))  # publishes the basis
    with TestClient(create_app(settings, redis_client=redis_client)) as client:
        client.headers["X-API-Key"] = KEY
        template_id = upload(client, png(TEMPLATE), "room")
        edit = {"steps": "3", "strength": "0.8", "guidance": "4.5", "resolution": "96"}
        submitted = client.post(
            "/v1/jobs",
            data={"template_id": template_id, "prompt": "a red star", "seed": "1"} | edit,
            files={"mask": ("mask.png", mask_png(), "image/png")},
        )
        assert submitted.status_code == 202, submitted.text
        prepare = client.post(f"/v1/templates/{template_id}/prepare", data={"steps": "2"}).json()
        jobs = {job.prepare: job for job in pre_queue_jobs(redis_client, settings)}
        edit_job, prepare_job = jobs[False], jobs[True]
        assert prepare_job.job_id == prepare["job_id"]
        edit_digest = stages.preprocess(edit_job).cache_digest
        prepare_digest = stages.preprocess(prepare_job).cache_digest
        assert edit_digest and prepare_digest and edit_digest != prepare_digest
        assert status(client, template_id, **edit)["digest"] == edit_digest
        assert client.get(prepare["cache_url"]).json()["digest"] == prepare_digest
        assert status(client, template_id, steps=2)["digest"] == prepare_digest
        assert status(client, template_id)["digest"] not in (edit_digest, prepare_digest)
        # the edit's guidance enters the key of a model without classifier-free guidance only
        other_guidance = status(client, template_id, **edit | {"guidance": "6"})["digest"]
        assert (other_guidance == edit_digest) == engine.adapter.uses_cfg


def test_the_key_builds_without_a_model_library():
    assert loaded_after_import("backend.cache.key", MODEL_LIBRARIES) == []
    assert loaded_after_import("backend.cachestatus", MODEL_LIBRARIES) == []


def test_image_hash_is_of_the_decoded_pixels():
    from backend.cache.key import image_sha256

    rgb = TEMPLATE.convert("RGB")
    assert image_sha256(rgb) == image_sha256(Image.open(io.BytesIO(png(rgb, "BMP"))))
    assert image_sha256(rgb) == image_sha256(rgb.convert("RGBA"))
    changed = np.asarray(rgb).copy()
    changed[0, 0, 0] ^= 1
    assert image_sha256(Image.fromarray(changed)) != image_sha256(rgb)

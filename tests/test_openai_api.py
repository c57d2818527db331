"""``POST /v1/images/edits`` through the real ``openai`` package, against the real API served by
uvicorn on a real Redis (no worker runs: the edits are accepted and stay queued). Errors come back
as the client's own exception types, in OpenAI's shape; a refused call stores nothing; a wait that
runs out names the jobs, which are not submitted twice; Bearer keys work on every route."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from backend.api.app import create_app
from backend.config import load_settings
from backend.protocol.keys import job_key
from tests.served_app import serve
from tests.test_api import png

KEY = "openai-key"


def holed(size=(64, 48), hole=(16, 12, 40, 30)) -> bytes:
    """An RGBA PNG whose fully transparent box is the area to edit."""
    image = Image.new("RGBA", size, (30, 120, 200, 255))
    image.paste((0, 0, 0, 0), hole)
    return png(image)


OPAQUE = png(Image.new("RGB", (64, 48), "white"))


@pytest.fixture
def served(redis_url, tmp_path):
    """(base URL, settings) of the API served by uvicorn in a thread: edits wait 1 s, admission
    control queues one job at most, the body limit is 1 MiB."""
    settings = load_settings(
        {
            "MASKSERVE_REDIS_URL": redis_url,
            "MASKSERVE_DATA_DIR": str(tmp_path / "data"),
            "MASKSERVE_MODEL": "tiny-sd2-inpaint",
            "MASKSERVE_API_KEYS": KEY,
            "MASKSERVE_STUDIO": "0",
        },
        api={
            "read_rate_per_minute": 0,
            "write_rate_per_minute": 0,
            "openai_wait_s": 1.0,
            "max_body_mb": 1.0,
        },
        deadlines={"max_queue": 1},
    )
    with serve(create_app(settings)) as base:
        yield base, settings


def client(base: str, key: str = KEY, retries: int = 2) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=retries, timeout=30)


def stored_nothing(settings, redis_client) -> bool:
    blobs = Path(settings.paths.data_dir) / "blobs"
    files = [p for p in blobs.rglob("*") if p.is_file()] if blobs.exists() else []
    return not files and not redis_client.keys(job_key("*"))


def edit(api: openai.OpenAI, **fields):
    return api.images.edit(
        **{"image": ("picture.png", holed(), "image/png"), "prompt": "a red chair"} | fields
    )


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"size": "300x300"}, "size", "256x256, 512x512, 1024x1024"),
        ({"n": 11}, "n", "1 to 10"),
        ({"image": ("opaque.png", OPAQUE, "image/png")}, "image", "no transparency"),
        (
            {"mask": ("mask.png", png(Image.new("RGBA", (64, 48), "white")), "image/png")},
            "mask",
            "no fully transparent pixel",
        ),
        ({"image": ("tiny.png", holed((8, 8), (0, 0, 4, 4)), "image/png")}, "image", "at least 16"),
        ({"extra_body": {"stepz": 4}}, "stepz", "unknown field(s) stepz"),
        # the job service's own checks name the field too
        ({"extra_body": {"steps": 0}}, "steps", "steps 0 is out of range"),
        ({"model": "no-such-model"}, "model", "no-such-model"),
        ({"prompt": "x" * 2001}, "prompt", "2001 characters long, the limit is 2000"),
        ({"extra_body": {"service_class": "urgent"}}, "service_class", "is not known"),
        ({"extra_body": {"adapters": "[1]"}}, "adapters", "each adapter needs a string id"),
    ],
)
def test_bad_calls_raise_bad_request_naming_the_field_and_store_nothing(
    served, redis_client, fields, param, words
):
    base, settings = served
    with pytest.raises(openai.BadRequestError) as info:
        edit(client(base), **fields)
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error
    assert stored_nothing(settings, redis_client)


def test_a_wrong_key_raises_authentication_error_and_an_unknown_template_not_found(served):
    base, _ = served
    with pytest.raises(openai.AuthenticationError) as info:
        edit(client(base, key="not-the-key"))
    assert info.value.body["code"] == "invalid_api_key"
    assert "not valid" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        edit(client(base), extra_body={"template_id": "f" * 32})
    assert info.value.body["param"] == "template_id"


def test_a_body_over_the_limit_is_a_bad_request_in_openais_shape(served, redis_client):
    base, settings = served
    pixels = np.random.default_rng(0).integers(0, 256, (700, 700, 4), dtype=np.uint8)
    noise = Image.fromarray(pixels, mode="RGBA")  # incompressible: about 1.9 MiB as PNG
    with pytest.raises(openai.BadRequestError) as info:
        edit(client(base), image=("big.png", png(noise), "image/png"))
    assert "larger than this server's limit" in info.value.body["message"]
    assert stored_nothing(settings, redis_client)


def test_a_wait_that_runs_out_names_the_jobs_once_and_admission_then_answers_429(
    served, redis_client
):
    base, _ = served
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as info:
        edit(client(base))  # retries allowed: the answer tells the client not to
    assert time.monotonic() - started < 10
    error = info.value.body
    assert info.value.status_code == 504 and error["code"] == "timeout"
    (job_id,) = error["job_ids"]
    assert len(redis_client.keys(job_key("*"))) == 1
    record = httpx.get(f"{base}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {KEY}"})
    assert record.status_code == 200 and record.json()["status"] == "queued"
    # the queue holds its one job (max_queue 1): admission control refuses the next batch job
    with pytest.raises(openai.RateLimitError) as info:
        edit(client(base, retries=0))
    assert int(info.value.response.headers["Retry-After"]) >= 1
    assert info.value.body["type"] == "rate_limit_error" and info.value.body["reason"] == "queue"
    assert len(redis_client.keys(job_key("*"))) == 1


def test_bearer_keys_work_on_every_route_and_other_routes_keep_their_error_shape(served):
    base, _ = served
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{base}/v1/templates", headers=bearer).status_code == 200
    assert httpx.get(f"{base}/v1/templates", headers={"X-API-Key": KEY}).status_code == 200
    wrong = httpx.get(f"{base}/v1/templates", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and "Authorization header" in wrong.json()["error"]
    missing = httpx.get(f"{base}/v1/jobs/{'0' * 32}", headers=bearer)
    assert missing.status_code == 404 and isinstance(missing.json()["error"], str)
    schema = httpx.get(f"{base}/openapi.json").json()
    assert "/v1/images/edits" in schema["paths"]

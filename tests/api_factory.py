"""The REST API as its tests drive it, against a real Redis (``redis_url``, ``redis_client``): keys,
images and masks, settings, a ``TestClient`` with the first key, and the helpers that submit jobs
and read what they queue and stream. A plugin of ``tests/conftest.py``: ``settings`` and ``client``
are fixtures of every test module that does not define its own."""

from __future__ import annotations

import io
import json

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from backend.api.app import create_app
from backend.config import load_settings
from backend.protocol import EditJob
from templates_store.samples import sample_template
from tests.factories import queued_tasks

KEY = "test-key-1"
OTHER_KEY = "test-key-2"
WIDTH, HEIGHT = 64, 48


def png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def mask_png(size=(WIDTH, HEIGHT), box=(16, 12, 40, 30)) -> bytes:
    mask = Image.new("L", size, 0)
    mask.paste(255, box)
    return png(mask)


IMAGE = png(sample_template(WIDTH, HEIGHT, seed=3))
MASK = mask_png()


def make_settings(redis_url, tmp_path, deadlines: dict | None = None, **api):
    """Settings of an API on ``redis_url`` with the two keys and no rate limits; ``api`` and
    ``deadlines`` override those sections."""
    env = {
        "MASKSERVE_REDIS_URL": redis_url,
        "MASKSERVE_DATA_DIR": str(tmp_path / "data"),
        "MASKSERVE_API_KEYS": f"{KEY},{OTHER_KEY}",
    }
    unlimited = {"read_rate_per_minute": 0, "write_rate_per_minute": 0, "sse_keepalive_s": 0.2}
    return load_settings(env, api=unlimited | api, deadlines=deadlines or {})


@pytest.fixture
def settings(redis_url, tmp_path):
    return make_settings(redis_url, tmp_path)


@pytest.fixture
def client(settings, redis_client):
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as test_client:
        yield test_client


def submit(client, data=None, files=None, **fields):
    form = {"prompt": "a red chair", "steps": "4"} | fields
    upload = {"image": ("image.png", IMAGE, "image/png"), "mask": ("mask.png", MASK, "image/png")}
    return client.post(
        "/v1/jobs", data=form if data is None else data, files=upload if files is None else files
    )


def pre_queue_jobs(redis_client, settings) -> list[EditJob]:
    """The EditJobs on the Celery pre-processing queue, every level, in the order they are taken."""
    return queued_tasks(redis_client, settings.celery.pre_queue)


def sse_events(text: str) -> list[dict]:
    events = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        data = [line[5:].strip() for line in lines if line.startswith("data:")]
        ids = [line[3:].strip() for line in lines if line.startswith("id:")]
        if data:
            events.append({"id": ids[0] if ids else None, **json.loads("\n".join(data))})
    return events

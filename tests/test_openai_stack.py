"""``POST /v1/images/edits`` end to end: the real ``openai`` package against the whole stack on the
tiny model (API, CPU worker, dispatcher and one engine worker, each its own process, real Redis).
Edits come back as ``b64_json`` or as ``url``s that work with the same key; OpenAI's mask
convention edits only the transparent area (of the mask, or of the image itself); ``n=2`` is one
batch with consecutive seeds; MaskServe's parameters travel in ``extra_body``; a gallery template
is edited by ``template_id``."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
import redis
from PIL import Image

from templates_store.samples import sample_template
from tests.stack_factory import running_stack
from tests.test_cpu_stages import BOX, HEIGHT, WIDTH, assert_edited_inside_only, png

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.model]
KEY = "openai-e2e-key"


def transparent_box(image: Image.Image, box=BOX) -> Image.Image:
    """``image`` as RGBA with ``box`` fully transparent: OpenAI's 'edit here'."""
    holed = image.convert("RGBA")
    holed.paste((0, 0, 0, 0), box)
    return holed


@pytest.fixture(scope="module")
def stack(redis_server, models_dir, tmp_path_factory):
    """(base URL, Redis client) of a running stack; its Redis is flushed once, before it starts
    (the function-scoped redis_url fixture would flush it under the running stack)."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    with pytest.MonkeyPatch.context() as monkeypatch:
        with running_stack(
            monkeypatch,
            tmp_path_factory.mktemp("openai-stack"),
            redis_server,
            models_dir,
            ["w-a"],
            {"MASKSERVE_API_KEYS": KEY, "MASKSERVE_OPENAI_WAIT_S": "120"},
        ) as (_running, base):
            deadline = time.time() + 120
            while not list(client.scan_iter(match="maskserve:worker:*")):
                assert time.time() < deadline, "the engine worker did not start"
                time.sleep(0.2)
            yield base, client
    client.close()


def api(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=180)


def job(base: str, job_id: str) -> dict:
    answer = httpx.get(f"{base}/v1/jobs/{job_id}", headers={"X-API-Key": KEY})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_b64_json_edits_only_the_masks_transparent_area(stack):
    base, _ = stack
    template = sample_template(WIDTH, HEIGHT, seed=31)
    mask = transparent_box(Image.new("RGBA", (WIDTH, HEIGHT), (0, 0, 0, 255)))
    answer = api(base).images.edit(
        image=("template.png", png(template), "image/png"),
        mask=("mask.png", png(mask), "image/png"),
        prompt="a blue vase",
        response_format="b64_json",
        model="gpt-image-1",
        user="tester-1",
        extra_body={"steps": 4, "seed": 5},
    )
    (item,) = answer.data
    assert item.url is None and answer.size == f"{WIDTH}x{HEIGHT}" and answer.created > 0
    result = base64.b64decode(item.b64_json)
    assert Image.open(io.BytesIO(result)).size == (WIDTH, HEIGHT)
    assert_edited_inside_only(result, template)
    record = job(base, answer.job_ids[0])
    assert (record["seed"], record["steps"], record["model_id"]) == (5, 4, "tiny-sd2-inpaint")


def test_url_results_of_the_images_own_alpha_at_a_size_work_with_the_same_key(stack):
    base, _ = stack
    template = sample_template(96, 96, seed=32)
    answer = api(base).images.edit(
        image=("holed.png", png(transparent_box(template, (0, 0, 48, 96))), "image/png"),
        prompt="a stone wall",
        size="256x256",
        response_format="url",
        extra_body={"steps": 3},
    )
    (item,) = answer.data
    assert item.b64_json is None and item.url.startswith(f"{base}/v1/jobs/")
    fetched = httpx.get(item.url, headers={"Authorization": f"Bearer {KEY}"})
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    result = np.asarray(Image.open(io.BytesIO(fetched.content)).convert("RGB"))
    assert result.shape == (256, 256, 3) and answer.size == "256x256"
    assert job(base, answer.job_ids[0])["resolution"] == 256
    assert httpx.get(item.url).status_code == 401  # the same credentials, not an open link


def test_n_2_is_one_batch_with_consecutive_seeds_and_the_extra_body_parameters(stack):
    base, _ = stack
    template = sample_template(WIDTH, HEIGHT, seed=33)
    answer = api(base).images.edit(
        image=("holed.png", png(transparent_box(template)), "image/png"),
        prompt="a yellow lamp",
        n=2,
        extra_body={
            "steps": 3,
            "seed": 11,
            "guidance": 6.0,
            "negative_prompt": "blurry",
            "service_class": "interactive",
            "priority": 2,
            "use_cache": False,
        },
    )
    assert len(answer.data) == 2 and answer.batch_id and len(answer.job_ids) == 2
    images = [base64.b64decode(item.b64_json) for item in answer.data]
    for image in images:
        assert_edited_inside_only(image, template)
    assert images[0] != images[1]  # seeds 11 and 12
    records = [job(base, job_id) for job_id in answer.job_ids]
    assert [record["seed"] for record in records] == [11, 12]
    for record in records:
        assert record["steps"] == 3 and record["guidance"] == 6.0
        assert record["negative_prompt"] == "blurry" and record["use_cache"] is False
        assert record["service_class"] == "interactive" and record["priority"] == 2


def test_a_gallery_template_is_edited_by_template_id(stack):
    base, _ = stack
    template = sample_template(WIDTH, HEIGHT, seed=34)
    uploaded = httpx.post(
        f"{base}/v1/templates",
        headers={"X-API-Key": KEY},
        files={"file": ("t.png", png(template), "image/png")},
    )
    assert uploaded.status_code in (200, 201), uploaded.text
    template_id = uploaded.json()["id"]
    # the uploaded image only carries the edit area: its pixels come from the gallery template
    area = transparent_box(Image.new("RGB", (WIDTH, HEIGHT), "black"))
    answer = api(base).images.edit(
        image=("area.png", png(area), "image/png"),
        prompt="a green plant",
        extra_body={"template_id": template_id, "steps": 3},
    )
    assert_edited_inside_only(base64.b64decode(answer.data[0].b64_json), template)
    assert job(base, answer.job_ids[0])["template_id"] == template_id

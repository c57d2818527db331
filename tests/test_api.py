"""The REST API against a real Redis and a real Celery app object (sending a task only writes to the
broker's list in Redis; no Celery worker runs here): keys, limits, validation and templates.
Jobs, events, results and operations: ``tests/test_api_jobs.py``."""

from __future__ import annotations

import io
import re
import time

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from backend.api.app import create_app
from backend.config import load_settings
from backend.jobstate import JobStateStore
from backend.protocol import JobEvent
from templates_store.samples import sample_template
from tests.api_factory import (
    HEIGHT,
    IMAGE,
    KEY,
    MASK,
    OTHER_KEY,
    WIDTH,
    make_settings,
    mask_png,
    png,
    pre_queue_jobs,
    sse_events,
    submit,
)


# ----- auth, rate limit, body limit ---------------------------------------------------------------
def test_api_key_missing_wrong_and_right(client):
    anonymous = TestClient(client.app)
    assert client.get("/v1/templates", headers={"X-API-Key": ""}).status_code == 401
    missing = anonymous.get("/v1/templates")
    assert missing.status_code == 401 and "X-API-Key" in missing.json()["error"]
    wrong = client.get("/v1/templates", headers={"X-API-Key": "nope"})
    assert wrong.status_code == 403 and "not valid" in wrong.json()["error"]
    assert client.get("/v1/templates").status_code == 200
    assert client.get("/v1/templates", headers={"X-API-Key": OTHER_KEY}).status_code == 200
    for open_path in ("/healthz", "/readyz", "/metrics", "/docs", "/openapi.json"):
        assert anonymous.get(open_path).status_code == 200, open_path


def test_the_api_docs_page_loads_everything_from_the_server_itself(client):
    """/docs works offline: every script, stylesheet and icon it names is served here, no key."""
    anonymous = TestClient(client.app)
    page = anonymous.get("/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    urls += re.findall(r"""url: ?["']([^"']+)["']""", page.text)
    assert urls and not [url for url in urls if "//" in url], urls  # nothing off this server
    for url in urls:
        asset = anonymous.get(url)
        assert asset.status_code == 200 and asset.content, url
    assert "/openapi.json" in urls
    script = anonymous.get("/docs/assets/swagger-ui-bundle.js")
    assert "javascript" in script.headers["content-type"] and len(script.content) > 100_000
    assert anonymous.get("/docs/assets/nothing.js").status_code == 404


def test_event_stream_takes_the_key_as_a_query_parameter(client, redis_client):
    """A browser's EventSource cannot send X-API-Key: the event stream (only) takes ?api_key=."""
    job_id = submit(client).json()["job_id"]
    JobStateStore(redis_client).record_event(
        JobEvent(job_id=job_id, status="cancelled", at=time.time())
    )
    browser = TestClient(client.app)  # no X-API-Key header
    events = browser.get(f"/v1/jobs/{job_id}/events", params={"api_key": KEY})
    assert events.status_code == 200 and [e["status"] for e in sse_events(events.text)] == [
        "cancelled"
    ]
    wrong = browser.get(f"/v1/jobs/{job_id}/events", params={"api_key": "nope"})
    assert (
        wrong.status_code == 403 and "api_key query parameter is not valid" in wrong.json()["error"]
    )
    header_wins = browser.get(
        f"/v1/jobs/{job_id}/events", params={"api_key": KEY}, headers={"X-API-Key": "nope"}
    )
    assert (
        header_wins.status_code == 403
        and "X-API-Key header is not valid" in header_wins.json()["error"]
    )
    assert (
        browser.get(
            f"/v1/jobs/{job_id}/events", params={"api_key": "nope"}, headers={"X-API-Key": KEY}
        ).status_code
        == 200
    )
    missing = browser.get(f"/v1/jobs/{job_id}/events")
    assert missing.status_code == 401
    assert (
        "X-API-Key header" in missing.json()["error"]
        and "api_key query parameter" in missing.json()["error"]
    )
    # everywhere else: 401
    for path in (f"/v1/jobs/{job_id}", "/v1/templates", f"/v1/jobs/{job_id}/result"):
        refused = browser.get(path, params={"api_key": KEY})
        assert refused.status_code == 401, path
        assert "api_key query parameter is not accepted on this route" in refused.json()["error"]
    schemes = client.get("/openapi.json").json()["paths"]["/v1/jobs/{job_id}/events"]["get"][
        "security"
    ]
    assert {"APIKeyQuery": []} in schemes and {"APIKeyHeader": []} in schemes


def test_no_keys_configured_fails_closed_unless_auth_disabled(redis_url, redis_client, tmp_path):
    closed = load_settings({"MASKSERVE_REDIS_URL": redis_url, "MASKSERVE_DATA_DIR": str(tmp_path)})
    with TestClient(create_app(closed, redis_client=redis_client)) as test_client:
        refused = test_client.get("/v1/templates", headers={"X-API-Key": "anything"})
        assert refused.status_code == 401 and "MASKSERVE_API_KEYS" in refused.json()["error"]
    opened = load_settings(
        {
            "MASKSERVE_REDIS_URL": redis_url,
            "MASKSERVE_DATA_DIR": str(tmp_path),
            "MASKSERVE_AUTH_DISABLED": "1",
        }
    )
    with TestClient(create_app(opened, redis_client=redis_client)) as test_client:
        assert test_client.get("/v1/templates").status_code == 200


def test_rate_limit_per_key_with_retry_after(redis_url, redis_client, tmp_path):
    settings = make_settings(redis_url, tmp_path, read_rate_per_minute=6, read_burst=3)
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as test_client:
        assert [test_client.get("/v1/templates").status_code for _ in range(3)] == [200, 200, 200]
        limited = test_client.get("/v1/templates")
        assert limited.status_code == 429 and "rate limit" in limited.json()["error"]
        # 6 a minute = one token every 10 s; the bucket is empty, less what refilled while the burst
        # was sent
        assert limited.headers["Retry-After"] in ("9", "10")
        assert (
            test_client.get("/v1/templates", headers={"X-API-Key": OTHER_KEY}).status_code == 200
        )  # own bucket
        assert test_client.get("/healthz").status_code == 200  # not limited
        assert "maskserve_api_rate_limited_total 1.0" in test_client.get("/metrics").text
    # the bucket lives in Redis: a second API process sees the same one
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as second:
        assert second.get("/v1/templates").status_code == 429


def test_body_limit_413_declared_and_streamed(redis_url, redis_client, tmp_path):
    settings = make_settings(redis_url, tmp_path, max_body_mb=0.05)
    big = b"\0" * 100_000
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as test_client:
        declared = test_client.post(
            "/v1/templates", files={"file": ("big.png", big)}, data={"name": "x"}
        )
        assert declared.status_code == 413 and "limit of 51 KiB" in declared.json()["error"]

        def chunks():
            for _ in range(10):
                yield b"x" * 10_000

        streamed = test_client.post(
            "/v1/templates",
            content=chunks(),
            headers={"Content-Type": "multipart/form-data; boundary=zzz"},
        )
        assert streamed.status_code == 413 and "limit" in streamed.json()["error"]
        assert submit(test_client).status_code == 202  # small requests still pass
        assert 'status="413"' in test_client.get("/metrics").text


# ----- validation ---------------------------------------------------------------------------------
BAD_FIELDS = [
    ({"steps": "0"}, 422, "steps 0 is out of range"),
    ({"steps": "151"}, 422, "steps 151 is out of range"),
    ({"steps": "many"}, 422, "steps"),
    ({"guidance": "50.5"}, 422, "guidance 50.5 is out of range"),
    ({"guidance": "-1"}, 422, "guidance"),
    ({"guidance": "nan"}, 422, "guidance"),
    ({"strength": "0"}, 422, "strength 0.0 is out of range: use a value in (0.0, 1.0]"),
    ({"strength": "1.5"}, 422, "strength"),
    ({"prompt": "x" * 2001}, 422, "prompt is 2001 characters long, the limit is 2000"),
    ({"prompt": ""}, 422, "prompt is empty: say what to paint in the masked area"),
    ({"prompt": " \n\t"}, 422, "prompt is empty"),
    ({"negative_prompt": "x" * 2001}, 422, "negative_prompt"),
    ({"seed": "-1"}, 422, "seed -1 is out of range"),
    ({"seed": str(2**32)}, 422, "seed"),
    ({"threshold": "255"}, 422, "threshold"),
    ({"grow_px": "9999"}, 422, "grow"),
    ({"feather_px": "-2"}, 422, "feather"),
    ({"resolution": "10"}, 422, "resolution 10 is out of range"),
    (
        {"model": "no-such-model"},
        422,
        "unknown model 'no-such-model': use one of demo-sd2-inpaint, tiny",
    ),
    ({"model": "sd2-inpaint:/models/x"}, 422, "checkpoint"),
    ({"template_id": "0" * 32}, 422, "exactly one of template_id"),
]


@pytest.mark.parametrize(
    "fields, status, message",
    BAD_FIELDS,
    ids=[f"{name}={value[:12]}" for fields, _, _ in BAD_FIELDS for name, value in fields.items()],
)
def test_bad_fields_are_4xx_saying_what_to_fix(
    client, redis_client, settings, fields, status, message
):
    response = submit(client, **fields)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
    assert pre_queue_jobs(redis_client, settings) == []  # nothing queued


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"steps": "0"}, "steps"),
        ({"steps": "many"}, "steps"),  # not a number: FastAPI's own validation
        ({"prompt": "x" * 2001}, "prompt"),
        ({"model": "no-such-model"}, "model"),
        ({"service_class": "urgent"}, "service_class"),
        ({"adapters": '[{"id": "nope"}]'}, "adapters"),
    ],
)
def test_a_refusal_names_the_field_to_fix(client, fields, field):
    response = submit(client, **fields)
    assert response.status_code == 422 and response.json()["field"] == field, response.text


def test_a_misspelt_field_is_refused_naming_it_and_the_closest_one(client, redis_client, settings):
    response = submit(client, stepz="3")
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == "unknown field 'stepz': did you mean 'steps'?"
    assert body["field"] == "stepz"
    far = submit(client, colour="red").json()["error"]
    assert far.startswith("unknown field 'colour' (this route takes ")
    assert "negative_prompt" in far and "template_id" in far
    assert pre_queue_jobs(redis_client, settings) == []  # nothing queued


def test_every_rest_route_refuses_fields_and_query_parameters_it_does_not_take(client, tmp_path):
    template = client.post("/v1/templates", files={"file": ("t.png", IMAGE)}).json()
    base = f"/v1/templates/{template['id']}"
    refused = {
        "batch": client.post(
            "/v1/batches",
            data={"promtps": "a", "template_id": template["id"]},
            files={"mask": ("m.png", MASK)},
        ),
        "template": client.post(
            "/v1/templates", files={"file": ("t.png", IMAGE)}, data={"nmae": "room"}
        ),
        "prepare": client.post(f"{base}/prepare", data={"stepz": "3"}),
        "adapter": client.post(
            "/v1/adapters", files={"file": ("a.safetensors", b"x")}, data={"modle": "m"}
        ),
        "jobs": client.get("/v1/jobs", params={"limt": "5"}),
        "cache": client.get(f"{base}/cache", params={"stepz": "3"}),
    }
    expected = {
        "batch": ("promtps", "prompts"),
        "template": ("nmae", "name"),
        "prepare": ("stepz", "steps"),
        "adapter": ("modle", "model"),
        "jobs": ("limt", "limit"),
        "cache": ("stepz", "steps"),
    }
    for what, response in refused.items():
        wrong, right = expected[what]
        assert response.status_code == 422, (what, response.text)
        assert f"{wrong!r}: did you mean {right!r}?" in response.json()["error"], what
    assert [t["id"] for t in client.get("/v1/templates").json()["templates"]] == [template["id"]]
    assert client.get("/v1/adapters").json() == {"adapters": []}
    assert client.get("/v1/jobs").json() == {"jobs": []}


def test_the_shipped_demo_model_is_accepted_without_being_listed(client, redis_client, settings):
    assert not settings.api.models  # no allow-list: only built and shipped models are served
    response = submit(client, model="demo-sd2-inpaint")
    assert response.status_code == 202, response.text
    assert len(pre_queue_jobs(redis_client, settings)) == 1


def upload(name, data, mime="image/png"):
    return (name, data, mime)


BAD_FILES = [
    (
        {
            "image": upload("i.png", IMAGE),
            "mask": upload("m.png", mask_png(size=(32, 32), box=(0, 0, 8, 8))),
        },
        422,
        "mask size 32x32 does not match image size 64x48",
    ),
    (
        {"image": upload("i.png", IMAGE), "mask": upload("m.png", mask_png(box=(0, 0, 0, 0)))},
        422,
        "mask is empty",
    ),
    (
        {"image": upload("i.png", IMAGE), "mask": upload("m.txt", b"plain text", "text/plain")},
        415,
        "mask is not an image file",
    ),
    (
        {
            "image": upload("i.gif", png(Image.new("P", (WIDTH, HEIGHT)), "GIF"), "image/gif"),
            "mask": upload("m.png", MASK),
        },
        415,
        "image is a GIF file, which is not supported",
    ),
    (
        {"image": upload("i.png", IMAGE[: len(IMAGE) // 2]), "mask": upload("m.png", MASK)},
        422,
        "truncated",
    ),
    (
        {
            "image": upload("i.png", png(Image.new("RGB", (5000, 4000)))),
            "mask": upload("m.png", MASK),
        },
        413,
        "the limit is 16.8 MP",
    ),
    ({"mask": upload("m.png", MASK)}, 422, "exactly one of template_id"),
    ({"image": upload("i.png", IMAGE)}, 422, "mask: Field required"),
    (
        {"image": upload("i.png", png(Image.new("RGB", (1, 1)))), "mask": upload("m.png", MASK)},
        422,
        "image is 1x1 px, too small to edit: each side must be at least 16 px",
    ),
    (
        {
            "image": upload("i.png", IMAGE),
            "mask": upload("m.png", mask_png((64, 15), (0, 0, 8, 8))),
        },
        422,
        "mask is 64x15 px, too small to edit",
    ),
]


@pytest.mark.parametrize(
    "files, status, message",
    BAD_FILES,
    ids=[
        "size-mismatch",
        "empty-mask",
        "mask-not-image",
        "gif",
        "truncated",
        "too-many-pixels",
        "no-image",
        "no-mask",
        "image-1x1",
        "mask-too-small",
    ],
)
def test_bad_files_are_4xx_saying_what_to_fix(client, files, status, message):
    response = submit(client, files=files)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


def test_inverting_a_full_mask_leaves_nothing(client):
    full = {
        "image": upload("i.png", IMAGE),
        "mask": upload("m.png", mask_png(box=(0, 0, WIDTH, HEIGHT))),
    }
    response = submit(client, files=full, invert="true")
    assert response.status_code == 422 and "after inverting" in response.json()["error"]


def test_garbage_body_is_a_4xx(client):
    response = client.post(
        "/v1/jobs", content=b"--zzz\r\ngarbage", headers={"Content-Type": "multipart/form-data"}
    )
    assert 400 <= response.status_code < 500
    boundary = "a222103b9b30b1f9e8be6882ecedb1d2"  # a body the multipart parser refuses
    malformed = client.post(
        "/v1/jobs",
        content=f"--{boundary}\r\n[]--{boundary}--\r\n".encode(),
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert malformed.status_code == 400, malformed.text  # documented, saying what to do
    assert "resend the fields as multipart/form-data" in malformed.json()["error"]


# ----- templates ----------------------------------------------------------------------------------
def test_template_crud(client):
    created = client.post(
        "/v1/templates",
        files={"file": ("room.jpg", png(sample_template(80, 60), "JPEG"))},
        data={"name": "Living room", "tags": "interior, Sofa"},
    )
    assert created.status_code == 201, created.text
    record = created.json()
    assert record["name"] == "Living room" and record["tags"] == ["interior", "sofa"]
    assert (record["width"], record["height"]) == (80, 60)
    other = client.post(
        "/v1/templates", files={"file": ("garden.png", png(sample_template(32, 32)))}
    ).json()
    assert other["name"] == "garden"  # default name: the file's stem
    assert [t["id"] for t in client.get("/v1/templates").json()["templates"]] == [
        other["id"],
        record["id"],
    ]
    assert [
        t["id"] for t in client.get("/v1/templates", params={"tag": "sofa"}).json()["templates"]
    ] == [record["id"]]
    assert [
        t["id"] for t in client.get("/v1/templates", params={"query": "LIVING"}).json()["templates"]
    ] == [record["id"]]
    assert client.get(record["url"]).json() == record
    image = client.get(record["image_url"])
    assert image.headers["content-type"] == "image/png" and Image.open(
        io.BytesIO(image.content)
    ).size == (80, 60)
    thumb = client.get(record["thumbnail_url"])
    assert thumb.headers["content-type"] == "image/webp"
    assert client.delete(record["url"]).status_code == 204
    for path in (record["url"], record["image_url"], record["thumbnail_url"]):
        gone = client.get(path)
        assert gone.status_code == 404 and "no template" in gone.json()["error"]
    assert client.delete(record["url"]).status_code == 404


@pytest.mark.parametrize(
    "data, file, status, message",
    [
        ({"name": "x"}, b"not an image", 415, "not an image"),
        ({"name": "a\nb"}, IMAGE, 422, "control characters"),
        ({"name": "x", "tags": "bad tag!"}, IMAGE, 422, "tag"),
        ({"name": "x" * 500}, IMAGE, 422, "limit is 120"),
        ({"name": "x"}, png(Image.new("RGB", (15, 200))), 422, "at least 16 px"),
    ],
)
def test_template_upload_errors(client, data, file, status, message):
    response = client.post("/v1/templates", files={"file": ("f.png", file)}, data=data)
    assert response.status_code == status and message in response.json()["error"]


def test_template_ids_never_reach_the_file_system(client):
    for bad in ("..%2F..%2Fetc%2Fpasswd", "....", "x" * 32):
        assert client.get(f"/v1/templates/{bad}").status_code == 404

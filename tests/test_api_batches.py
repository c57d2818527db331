"""``/v1/batches`` over HTTP against a real Redis and a real Celery app object (no worker runs:
the tests move items along by recording their jobs' events, as the services would)."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
from fastapi.testclient import TestClient

from backend.api.app import create_app
from backend.protocol import JobEvent
from backend.protocol.keys import NAMESPACE
from tests.test_api import IMAGE, KEY, MASK, OTHER_KEY, make_settings, mask_png, sse_events

pytestmark = pytest.mark.redis

MASKS = [mask_png(box=(4 * i, 4, 4 * i + 12, 20)) for i in range(3)]


@pytest.fixture
def client(redis_url, redis_client, tmp_path):
    app = create_app(make_settings(redis_url, tmp_path), redis_client=redis_client)
    with TestClient(app, headers={"X-API-Key": KEY}) as test_client:
        yield test_client


def post_batch(client, masks=MASKS, prompts=(), mask=None, **fields):
    files = [("masks", (f"m{i}.png", data, "image/png")) for i, data in enumerate(masks)]
    files.append(("image", ("image.png", IMAGE, "image/png")))
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    data = {"prompt": "a red chair", "steps": "4", "prompts": list(prompts)} | fields
    return client.post("/v1/batches", data=data, files=files)


def record(client, job_id, status, **fields):
    jobstate = client.app.state.service.jobstate
    jobstate.record_event(JobEvent(job_id=job_id, status=status, at=1.0, **fields))


def keys(redis_client) -> set[bytes]:
    return set(redis_client.scan_iter(f"{NAMESPACE}:*"))


def test_submit_read_and_follow_a_batch(client):
    answer = post_batch(client, seed="7")
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert answer.headers["Location"] == body["status_url"] == f"/v1/batches/{body['batch_id']}"
    assert [item["seed"] for item in body["items"]] == [7, 8, 9]
    jobs = [item["job_id"] for item in body["items"]]
    view = client.get(body["status_url"]).json()
    assert view["status"] == "queued" and view["total"] == 3
    assert view["items"][2]["status_url"] == f"/v1/jobs/{jobs[2]}"
    job = client.get(f"/v1/jobs/{jobs[1]}").json()
    assert job["batch_id"] == body["batch_id"] and job["batch_index"] == 1
    record(client, jobs[0], "running", step=1, num_steps=4)
    record(client, jobs[1], "failed", message="broken")
    view = client.get(body["status_url"]).json()
    assert view["status"] == "running" and view["items"][1]["message"] == "broken"
    record(client, jobs[0], "done", result_ref="results/0.png", thumbnail_ref="thumbnails/0.webp")
    record(client, jobs[2], "cancelled")
    events = sse_events(client.get(body["events_url"]).text)
    items = [e for e in events if e["type"] == "item"]
    assert {e["index"] for e in items} == {0, 1, 2}
    assert [e["status"] for e in items if e["index"] == 0] == ["running", "done"]
    done = next(e for e in items if e["status"] == "done")
    assert done["result_url"] == view["items"][0]["result_url"] == f"/v1/jobs/{jobs[0]}/result"
    assert done["thumbnail_url"].endswith("?thumbnail=1") and "result_ref" not in done
    final = events[-1]
    assert final["type"] == "batch" and final["status"] == "partial" and final["progress"] == 1
    listed = client.get("/v1/batches").json()["batches"]
    assert [b["batch_id"] for b in listed] == [body["batch_id"]]


def test_prompts_pair_with_one_mask_and_unpairable_counts_say_so(client, redis_client):
    answer = post_batch(client, masks=[], prompts=["a cat", "a dog"], mask=MASK)
    assert answer.status_code == 202, answer.text
    view = client.get(answer.json()["status_url"]).json()
    assert [item["prompt"] for item in view["items"]] == ["a cat", "a dog"]
    before = keys(redis_client)
    refused = post_batch(client, masks=MASKS[:2], prompts=["a", "b", "c"])
    assert refused.status_code == 422 and "2 masks and 3 prompts" in refused.json()["error"]
    nothing = post_batch(client, masks=[])
    assert nothing.status_code == 422 and "masks" in nothing.json()["error"]
    assert keys(redis_client) == before


def test_a_bad_item_is_named_and_nothing_is_stored(client, redis_client):
    before = keys(redis_client)
    refused = post_batch(client, masks=[MASK, b"not a png", MASK])
    assert refused.status_code in (415, 422), refused.text
    body = refused.json()
    assert body["item"] == 1 and body["error"].startswith("item 1:")
    wordless = post_batch(client, masks=[], prompts=["a cat", " "], mask=MASK)
    assert wordless.status_code == 422, wordless.text
    body = wordless.json()
    assert body["item"] == 1 and body["field"] == "prompt"
    assert body["error"].startswith("item 1: prompt is empty")
    assert keys(redis_client) == before


def test_results_zip_holds_finished_results_and_a_manifest_of_every_item(client):
    body = post_batch(client).json()
    jobs = [item["job_id"] for item in body["items"]]
    blobs = client.app.state.service.blobs
    record(client, jobs[2], "done", result_ref=blobs.put("results", f"{jobs[2]}.png", b"png 2"))
    record(client, jobs[0], "failed", message="no worker")
    answer = client.get(body["results_url"])
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(answer.content)) as archive:
        assert sorted(archive.namelist()) == ["2.png", "manifest.json"]
        assert archive.read("2.png") == b"png 2"
        manifest = json.loads(archive.read("manifest.json"))
    assert [item["status"] for item in manifest["items"]] == ["failed", "queued", "done"]
    assert manifest["items"][0]["message"] == "no worker" and not manifest["complete"]


def test_delete_cancels_the_unfinished_items(client):
    body = post_batch(client).json()
    jobs = [item["job_id"] for item in body["items"]]
    record(client, jobs[0], "done")
    answer = client.delete(body["status_url"])
    assert answer.status_code == 200 and answer.json()["cancelled"] == 2
    statuses = [client.get(f"/v1/jobs/{job}").json()["status"] for job in jobs]
    assert statuses == ["done", "cancelled", "cancelled"]
    assert client.delete(body["status_url"]).status_code == 409


def test_another_key_gets_404_on_every_batch_route(client):
    body = post_batch(client).json()
    other = {"X-API-Key": OTHER_KEY}
    for method, path in (
        ("GET", body["status_url"]),
        ("GET", body["events_url"]),
        ("GET", body["results_url"]),
        ("DELETE", body["status_url"]),
    ):
        answer = client.request(method, path, headers=other)
        assert answer.status_code == 404, (method, path)
    assert client.get("/v1/batches", headers=other).json() == {"batches": []}

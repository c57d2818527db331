"""The REST API's jobs against a real Redis (no Celery worker runs here: a queued task is a list
entry): submitting, events, results, cancelling, queue positions, cache preparation and the
service's health. Keys, limits, validation and templates: ``tests/test_api.py``."""

from __future__ import annotations

import io
import threading
import time

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from backend import protocol
from backend.api.app import create_app
from backend.blobs import BlobStore
from backend.config import load_settings
from backend.imaging.uploads import encode_image
from backend.jobstate import JobStateStore
from backend.models.catalog import DEFAULT_MODEL
from backend.protocol import CancelJob, JobEvent
from backend.protocol.keys import heartbeat_key, inbox_stream
from backend.services.redis_server import free_port
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
    pre_queue_jobs,
    sse_events,
    submit,
)


# ----- jobs ---------------------------------------------------------------------------------------
def test_submit_returns_202_at_once_and_queues_the_edit(client, redis_client, settings):
    response = submit(
        client,
        seed="1234",
        negative_prompt="blurry",
        guidance="6.5",
        strength="0.9",
        grow_px="2",
        invert="false",
        use_cache="false",
    )
    assert response.status_code == 202, response.text
    body = response.json()
    job_id = body["job_id"]
    assert len(job_id) == 32 and body["seed"] == 1234 and body["status"] == "queued"
    assert (
        body["status_url"] == f"/v1/jobs/{job_id}"
        and response.headers["Location"] == body["status_url"]
    )
    assert (
        body["events_url"] == f"/v1/jobs/{job_id}/events"
        and body["result_url"] == f"/v1/jobs/{job_id}/result"
    )
    state = JobStateStore(redis_client).get(job_id)
    assert (
        state["status"] == "queued" and state["seed"] == 1234 and state["model_id"] == DEFAULT_MODEL
    )
    [job] = pre_queue_jobs(redis_client, settings)
    assert job.job_id == job_id and job.seed == 1234 and job.steps == 4 and job.guidance == 6.5
    assert job.negative_prompt == "blurry" and job.strength == 0.9 and not job.use_cache
    assert job.mask_ops.grow_px == 2 and job.submitted_at > 0
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    assert blobs.get(job.template_ref) == IMAGE and blobs.get(job.mask_ref) == MASK
    shown = client.get(body["status_url"]).json()
    assert (
        shown["status"] == "queued" and shown["seed"] == 1234 and shown["prompt"] == "a red chair"
    )
    assert (
        shown["guidance"] == 6.5
        and shown["use_cache"] is False
        and shown["mask_ops"]["grow_px"] == 2
    )
    metrics = client.get("/metrics").text
    assert (
        f'maskserve_api_jobs_submitted_total{{model="{DEFAULT_MODEL}",source="rest"}} 1.0'
        in metrics
    )
    assert (
        'maskserve_api_requests_total{method="POST",route="/v1/jobs",status="202"} 1.0' in metrics
    )
    assert 'route="/v1/jobs/{job_id}"' in metrics


def test_random_seed_is_chosen_stored_and_defaults_apply(client, redis_client, settings):
    body = submit(client, data={"prompt": "a red chair"}).json()
    assert 0 <= body["seed"] < 2**32 and body["steps"] == 20  # the model's default steps
    [job] = pre_queue_jobs(redis_client, settings)
    assert job.seed == body["seed"] == client.get(body["status_url"]).json()["seed"]
    assert job.guidance == 7.5


def test_submit_from_a_gallery_template(client, redis_client, settings):
    template = client.post(
        "/v1/templates", files={"file": ("t.png", IMAGE)}, data={"name": "t"}
    ).json()
    files = {"mask": ("m.png", MASK, "image/png")}
    response = submit(client, files=files, template_id=template["id"])
    assert response.status_code == 202, response.text
    [job] = pre_queue_jobs(redis_client, settings)
    # shared by every job on this template
    assert job.template_ref == f"uploads/{template['sha256'][:32]}.png"
    stored = BlobStore(settings.paths.data_dir / "blobs").get(job.template_ref)
    assert Image.open(io.BytesIO(stored)).size == (WIDTH, HEIGHT)
    assert client.get(response.json()["status_url"]).json()["template_id"] == template["id"]
    unknown = submit(client, files=files, template_id="f" * 32)
    assert unknown.status_code == 404 and "no template" in unknown.json()["error"]
    wrong_size = submit(
        client,
        files={"mask": ("m.png", mask_png(size=(24, 24), box=(0, 0, 12, 12)))},
        template_id=template["id"],
    )
    assert wrong_size.status_code == 422 and "does not match" in wrong_size.json()["error"]


def test_unknown_job_is_404(client):
    for path in (
        f"/v1/jobs/{'a' * 32}",
        "/v1/jobs/not-an-id",
        f"/v1/jobs/{'a' * 32}/events",
        f"/v1/jobs/{'a' * 32}/result",
    ):
        response = client.get(path)
        assert response.status_code == 404 and "no job" in response.json()["error"], path
    assert client.delete(f"/v1/jobs/{'a' * 32}").status_code == 404


def _events(job_id, *specs):
    now = time.time()
    return [JobEvent(job_id=job_id, at=now + i * 0.001, **spec) for i, spec in enumerate(specs)]


def test_event_stream_replays_in_order_and_ends_after_terminal(client, redis_client):
    job_id = submit(client).json()["job_id"]
    store = JobStateStore(redis_client)
    for event in _events(
        job_id,
        {"status": "preprocessing"},
        {"status": "running", "step": 1, "num_steps": 2, "worker_id": "w1"},
        {"status": "running", "step": 2, "num_steps": 2, "worker_id": "w1"},
        {"status": "done", "result_ref": "results/x.png", "thumbnail_ref": "thumbnails/x.webp"},
    ):
        assert store.record_event(event)
    other = submit(client).json()["job_id"]  # another job's events never show up
    store.record_event(JobEvent(job_id=other, status="preprocessing", at=time.time()))
    response = client.get(f"/v1/jobs/{job_id}/events")
    assert response.status_code == 200 and response.headers["content-type"].startswith(
        "text/event-stream"
    )
    events = sse_events(response.text)
    assert [(e["status"], e.get("step", 0)) for e in events] == [
        ("preprocessing", 0),
        ("running", 1),
        ("running", 2),
        ("done", 0),
    ]
    assert {e["job_id"] for e in events} == {job_id} and response.text.startswith("retry:")
    done = events[-1]  # the URLs a client fetches the result from, never the blob references
    assert done["result_url"] == f"/v1/jobs/{job_id}/result"
    assert done["thumbnail_url"] == f"/v1/jobs/{job_id}/result?thumbnail=1"
    assert not {"result_ref", "thumbnail_ref"} & set(done)
    assert client.get(done["thumbnail_url"]).status_code == 410  # fetched like that (expired)
    resumed = sse_events(
        client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": events[1]["id"]}).text
    )
    assert [e["id"] for e in resumed] == [e["id"] for e in events[2:]]
    after_end = client.get(f"/v1/jobs/{job_id}/events", params={"after": events[-1]["id"]})
    # finished: ends at once
    assert after_end.status_code == 200 and sse_events(after_end.text) == []
    bad = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "yesterday"})
    assert bad.status_code == 422 and "stream id" in bad.json()["error"]


def test_event_stream_follows_live_events_with_keepalives(client, redis_client):
    job_id = submit(client).json()["job_id"]
    store = JobStateStore(redis_client)

    def pipeline():
        time.sleep(0.5)  # the stream is open and idle by now: keep-alive comments go out
        for event in _events(
            job_id,
            {"status": "running", "step": 1, "num_steps": 1, "worker_id": "w"},
            {"status": "failed", "message": "boom"},
        ):
            store.record_event(event)
            time.sleep(0.1)

    worker = threading.Thread(target=pipeline)
    worker.start()
    started = time.monotonic()
    response = client.get(f"/v1/jobs/{job_id}/events")
    worker.join()
    assert [e["status"] for e in sse_events(response.text)] == ["running", "failed"]
    assert ": keep-alive" in response.text and time.monotonic() - started < 10


def test_result_409_until_done_then_png_and_thumbnail(client, redis_client, settings):
    job_id = submit(client).json()["job_id"]
    early = client.get(f"/v1/jobs/{job_id}/result")
    assert early.status_code == 409 and "the job is queued" in early.json()["error"]
    store = JobStateStore(redis_client)
    store.record_event(
        JobEvent(
            job_id=job_id, status="running", at=time.time(), step=3, num_steps=4, worker_id="w"
        )
    )
    running = client.get(f"/v1/jobs/{job_id}/result")
    assert running.status_code == 409 and "step 3/4" in running.json()["error"]
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    result = sample_template(WIDTH, HEIGHT, seed=9)
    result_ref = blobs.put("results", f"{job_id}.png", encode_image(result, "png"))
    thumb_ref = blobs.put("thumbnails", f"{job_id}.webp", encode_image(result, "webp"))
    store.record_event(
        JobEvent(
            job_id=job_id,
            status="done",
            at=time.time(),
            result_ref=result_ref,
            thumbnail_ref=thumb_ref,
            timings={"total_s": 1.5},
        )
    )
    done = client.get(f"/v1/jobs/{job_id}/result")
    assert done.status_code == 200 and done.headers["content-type"] == "image/png"
    assert done.content == blobs.get(result_ref)
    thumb = client.get(f"/v1/jobs/{job_id}/result", params={"thumbnail": 1})
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/webp"
    state = client.get(f"/v1/jobs/{job_id}").json()
    assert state["status"] == "done" and state["timings"] == {"total_s": 1.5}
    assert state["thumbnail_url"] == f"/v1/jobs/{job_id}/result?thumbnail=1"
    # blob refs, the owner's digest and the services' guards stay inside; the list shows the same
    assert not set(state) & {"result_ref", "thumbnail_ref", "template_ref", "mask_ref", "owner"}
    assert "denoised" not in state and isinstance(state["steps"], int)
    listed = client.get("/v1/jobs").json()["jobs"]
    assert [job for job in listed if job["job_id"] == job_id] == [state]


def test_result_of_failed_job_is_409_with_its_message(client, redis_client):
    job_id = submit(client).json()["job_id"]
    JobStateStore(redis_client).record_event(
        JobEvent(job_id=job_id, status="failed", at=time.time(), message="mask outside the crop")
    )
    response = client.get(f"/v1/jobs/{job_id}/result")
    assert (
        response.status_code == 409 and "failed: mask outside the crop" in response.json()["error"]
    )


def test_cancel_queued_job(client, redis_client):
    job_id = submit(client).json()["job_id"]
    response = client.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 200 and response.json() == {
        "job_id": job_id,
        "status": "cancelled",
        "worker_notified": False,
    }
    assert JobStateStore(redis_client).status(job_id) == "cancelled"
    assert [e["status"] for e in sse_events(client.get(f"/v1/jobs/{job_id}/events").text)] == [
        "cancelled"
    ]
    again = client.delete(f"/v1/jobs/{job_id}")
    assert again.status_code == 409 and "job already finished" in again.json()["error"]


def test_cancel_running_job_reaches_its_workers_inbox_only(client, redis_client):
    job_id = submit(client).json()["job_id"]
    bystander = submit(client).json()["job_id"]
    store = JobStateStore(redis_client)
    for some_job in (job_id, bystander):
        store.record_event(
            JobEvent(
                job_id=some_job,
                status="running",
                at=time.time(),
                step=1,
                num_steps=4,
                worker_id="worker-7",
            )
        )
    response = client.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 200 and response.json()["worker_notified"] is True
    entries = redis_client.xrange(inbox_stream("worker-7"))
    assert [protocol.decode(fields[b"msg"]) for _, fields in entries] == [CancelJob(job_id=job_id)]
    assert store.status(job_id) == "cancelled" and store.status(bystander) == "running"


def test_cancel_finished_job_is_409(client, redis_client):
    job_id = submit(client).json()["job_id"]
    JobStateStore(redis_client).record_event(
        JobEvent(job_id=job_id, status="done", at=time.time(), result_ref="results/r.png")
    )
    response = client.delete(f"/v1/jobs/{job_id}")
    assert (
        response.status_code == 409
        and "job already finished (status done)" in response.json()["error"]
    )


# ----- ops ----------------------------------------------------------------------------------------
def test_readyz_follows_redis(client, tmp_path):
    assert client.get("/readyz").json() == {"status": "ready"}
    down = load_settings(
        {
            "MASKSERVE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "MASKSERVE_DATA_DIR": str(tmp_path / "down"),
            "MASKSERVE_API_KEYS": KEY,
        }
    )
    with TestClient(create_app(down), headers={"X-API-Key": KEY}) as test_client:
        assert test_client.get("/healthz").status_code == 200
        ready = test_client.get("/readyz")
        assert ready.status_code == 503 and "Redis does not answer" in ready.json()["error"]
        listed = test_client.get("/v1/templates")  # any route that needs Redis: 503, not 500
        assert listed.status_code == 503 and "Redis is unavailable" in listed.json()["error"]
        submitted = test_client.post("/v1/jobs", data={"prompt": "x"}, files={"mask": MASK})
        assert submitted.status_code == 503
        for answer in (ready, listed, submitted):  # when to try again: Redis may be restarting
            assert answer.headers["Retry-After"] == "5"


def test_create_app_needs_a_redis_url(tmp_path):
    with pytest.raises(ValueError, match="Redis URL"):
        create_app(load_settings({"MASKSERVE_DATA_DIR": str(tmp_path)}), celery_app=object())


def test_api_settings_from_env():
    settings = load_settings(
        {
            "MASKSERVE_API_KEYS": " k1, k2 ,,",
            "MASKSERVE_API_PORT": "9001",
            "MASKSERVE_READ_RATE_PER_MINUTE": "30",
            "MASKSERVE_MAX_BODY_MB": "8",
            "MASKSERVE_API_MODELS": "tiny-flux-fill",
        }
    )
    api = settings.api
    assert api.api_keys == ("k1", "k2") and api.port == 9001 and api.read_rate_per_minute == 30
    assert api.max_body_mb == 8 and api.models == ("tiny-flux-fill",) and not api.auth_disabled
    # keys never show up in logs of settings
    assert api.host == "127.0.0.1" and "k1" not in repr(settings)
    assert load_settings({}).api.api_keys == ()


def test_api_models_allow_list(redis_url, redis_client, tmp_path):
    settings = make_settings(redis_url, tmp_path, models=("tiny-flux-fill",))
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as test_client:
        refused = submit(test_client, model="tiny-sd2-inpaint")
        assert (
            refused.status_code == 422
            and "not served here: use one of tiny-flux-fill" in refused.json()["error"]
        )
        assert submit(test_client, model="tiny-flux-fill").status_code == 202


def test_service_without_http_takes_a_ui_s_float_numbers(client, redis_client, settings):
    from backend.api.service import JobRequest, ServiceError

    service = client.app.state.service  # what the Studio UI calls directly
    submitted = service.submit(
        JobRequest(mask=MASK, image=IMAGE, prompt="p", steps=3.0, seed=11.0, owner="studio")
    )
    assert (submitted.steps, submitted.seed) == (3, 11)
    assert service.get(submitted.job_id, "studio")["seed"] == 11
    with pytest.raises(ServiceError, match="seed must be a whole number") as err:
        service.submit(JobRequest(mask=MASK, image=IMAGE, prompt="p", seed=2.5))
    assert err.value.code == "invalid"


def test_a_waiting_job_shows_its_place_in_its_workers_queue(client, redis_client):
    from backend.protocol import WorkerHeartbeat

    job_id = submit(client).json()["job_id"]
    store = JobStateStore(redis_client)
    store.record_event(
        JobEvent(job_id=job_id, status="waiting", at=time.time(), worker_id="w9", num_steps=4)
    )
    # not in a heartbeat yet
    assert client.get(f"/v1/jobs/{job_id}").json()["queue_position"] is None
    beat = WorkerHeartbeat(
        worker_id="w9",
        model_id="tiny-sd2-inpaint",
        device="cpu",
        at=time.time(),
        max_batch=8,
        batching="continuous",
        waiting=[
            protocol.WaitingRow(job_id="ahead", mask_ratio=0.1, num_steps=4),
            protocol.WaitingRow(job_id=job_id, mask_ratio=0.2, num_steps=4),
        ],
    )
    redis_client.set(heartbeat_key("w9"), protocol.encode(beat), ex=5)
    assert client.get(f"/v1/jobs/{job_id}").json()["queue_position"] == 2
    store.record_event(
        JobEvent(job_id=job_id, status="running", at=time.time(), step=1, num_steps=4)
    )
    assert "queue_position" not in client.get(f"/v1/jobs/{job_id}").json()


def publish_demo_key_basis(redis_client) -> None:
    """What the CPU stages publish when they load the model (tests/test_cache_status.py checks
    the real one)."""
    from backend.cache.key import ModelKeyBasis
    from backend.cachestatus import publish_key_basis

    basis = ModelKeyBasis(DEFAULT_MODEL, "rev", "EulerDiscreteScheduler", True, 8)
    publish_key_basis(redis_client, basis)


def test_prepare_queues_a_recording_and_cache_status_follows_it(client, redis_client, settings):
    from backend.protocol import WorkerHeartbeat

    publish_demo_key_basis(redis_client)
    template_id = client.post(
        "/v1/templates", files={"file": ("t.png", IMAGE, "image/png")}, data={"name": "room"}
    ).json()["id"]
    assert client.get(f"/v1/templates/{template_id}/cache").json()["status"] == "not prepared"
    accepted = client.post(f"/v1/templates/{template_id}/prepare", data={"steps": "6"})
    assert accepted.status_code == 202, accepted.text
    (job,) = pre_queue_jobs(redis_client, settings)
    assert job.prepare and job.template_id == template_id and job.steps == 6 and job.mask_ref == ""
    cache_url = accepted.json()["cache_url"]  # the status for the prepare's settings
    assert cache_url.startswith(f"/v1/templates/{template_id}/cache?") and "steps=6" in cache_url
    assert client.get(cache_url).json()["status"] == "preparing"
    result = client.get(f"/v1/jobs/{accepted.json()['job_id']}/result")
    assert result.status_code == 404 and "no result" in result.json()["error"]
    # a worker reports the cache of those settings in RAM
    digest = client.get(cache_url).json()["digest"]
    beat = WorkerHeartbeat(
        worker_id="w1",
        model_id=job.model_id,
        device="cpu",
        at=time.time(),
        max_batch=8,
        batching="continuous",
        resident_ram=[digest],
    )
    redis_client.set(heartbeat_key("w1"), protocol.encode(beat), ex=5)
    status = client.get(cache_url).json()
    assert status == {
        "model": job.model_id,
        "status": "in RAM",
        "digest": digest,
        "workers": ["w1"],
        "settings": {"resolution": 128, "steps": 6, "strength": 1.0},
    }
    missing = client.post("/v1/templates/0123456789abcdef0123456789abcdef/prepare")
    assert missing.status_code == 404
    assert (
        client.get(f"/v1/templates/{template_id}/cache", params={"model": "nope"}).status_code
        == 422
    )


def test_a_prepared_cache_shows_at_once_not_at_the_next_heartbeat(client, redis_client, settings):
    """Between a prepare job's end and the next heartbeat of its worker, /cache trusts the job;
    a heartbeat sent after the job's end that does not list the cache wins (it was evicted)."""
    from backend.protocol import WorkerHeartbeat

    publish_demo_key_basis(redis_client)
    template_id = client.post(
        "/v1/templates", files={"file": ("t.png", IMAGE, "image/png")}, data={"name": "room"}
    ).json()["id"]
    job_id = client.post(f"/v1/templates/{template_id}/prepare").json()["job_id"]
    (job,) = pre_queue_jobs(redis_client, settings)
    started = time.time()

    def beat(at: float, resident: list[str]) -> None:
        heartbeat = WorkerHeartbeat(
            worker_id="w2",
            model_id=job.model_id,
            device="cpu",
            at=at,
            max_batch=8,
            batching="continuous",
            resident_ram=resident,
        )
        redis_client.set(heartbeat_key("w2"), protocol.encode(heartbeat), ex=5)

    def cache() -> dict:
        return client.get(f"/v1/templates/{template_id}/cache").json()

    beat(started, [])
    store = JobStateStore(redis_client)
    store.record_event(JobEvent(job_id=job_id, status="running", at=started, worker_id="w2"))
    assert cache()["status"] == "preparing"
    store.record_event(JobEvent(job_id=job_id, status="done", at=started + 1, worker_id="w2"))
    assert cache() | {"digest": None, "settings": None} == {
        "model": job.model_id,
        "status": "in RAM",
        "digest": None,
        "workers": ["w2"],
        "settings": None,
    }
    beat(started + 2, [])  # the worker's next heartbeat does not hold it: evicted
    assert cache()["status"] == "not prepared" and cache()["workers"] == []


def test_each_key_lists_only_its_own_jobs_newest_first(client):
    mine = [submit(client, prompt=f"mine {i}").json()["job_id"] for i in range(3)]
    client.headers["X-API-Key"] = OTHER_KEY
    theirs = submit(client, prompt="theirs").json()["job_id"]
    assert [job["job_id"] for job in client.get("/v1/jobs").json()["jobs"]] == [theirs]
    client.headers["X-API-Key"] = KEY
    listed = client.get("/v1/jobs").json()["jobs"]
    assert [job["job_id"] for job in listed] == mine[::-1]
    assert listed[0]["prompt"] == "mine 2" and listed[0]["status_url"] == f"/v1/jobs/{mine[2]}"
    assert [job["job_id"] for job in client.get("/v1/jobs?limit=1").json()["jobs"]] == [mine[2]]
    refused = client.get("/v1/jobs?limit=0")
    assert refused.status_code == 422 and "limit" in refused.json()["error"]

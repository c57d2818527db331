"""Tenants kept apart: every per-job and per-template route answers another key with the same 404 as
an id that never existed; keys are kept (and stored in Redis) only as digests; reads and writes are
rate-limited apart; each key's unfinished jobs are bounded; failed studio logins are throttled."""

from __future__ import annotations

import base64
import hashlib
import re
import uuid

import pytest
from fastapi.testclient import TestClient

from backend.api.app import create_app
from backend.jobstate import JobStateStore
from backend.protocol import JobEvent
from templates_store.samples import sample_template
from tests.api_factory import IMAGE, KEY, MASK, OTHER_KEY, make_settings, png, submit

# every path parameter a /v1 route may have, and how the contract makes a real one of the owner's
OWNED_PARAMS = {"job_id", "template_id", "adapter_id", "batch_id"}
_PARAM = re.compile(r"{(\w+)}")


def owned_routes(app) -> list[tuple[str, str]]:
    """(method, path template) of every /v1 route about one job or template, from the app's own
    route table (its OpenAPI paths: every route FastAPI serves under /v1)."""
    found = []
    for path, operations in app.openapi()["paths"].items():
        if not path.startswith("/v1/"):
            continue
        params = set(_PARAM.findall(path))
        # a new kind of per-object route must join the contract (and get an owner check) first
        assert params <= OWNED_PARAMS, f"{path}: add its parameters to the tenancy contract"
        if params:
            found += [(method.upper(), path) for method in sorted(operations)]
    return found


@pytest.fixture
def app(redis_url, redis_client, tmp_path):
    return create_app(make_settings(redis_url, tmp_path), redis_client=redis_client)


def owned_objects(client, tmp_path) -> dict[str, str]:
    """A template, a queued job (editing the template) and an adapter of KEY's (written into the
    registry as a CPU worker's ingest would leave it: this app has no CPU worker)."""
    uploaded = client.post("/v1/templates", files={"file": ("t.png", IMAGE, "image/png")})
    template_id = uploaded.json()["id"]
    mask = {"mask": ("m.png", MASK, "image/png")}
    job_id = submit(client, files=mask, template_id=template_id).json()["job_id"]
    batch = client.post(
        "/v1/batches",
        data={"template_id": template_id, "prompt": "x"},
        files={"masks": ("m.png", MASK, "image/png")},
    )
    return {
        "job_id": job_id,
        "template_id": template_id,
        "adapter_id": _adapter(client, tmp_path),
        "batch_id": batch.json()["batch_id"],
    }


def _adapter(client, tmp_path) -> str:
    from backend.adapters.files import NormalizedMeta, read_for_model, save_normalized
    from backend.adapters.store import AdapterFacts
    from backend.api.security import key_digest, key_owner
    from tests.adapter_factory import make_adapter_file

    model = "tiny-sd2-inpaint"
    read = read_for_model(make_adapter_file(model, tmp_path / "a.safetensors"), model, max_rank=8)
    normalized = tmp_path / "a.normalized.safetensors"
    save_normalized(read.adapter, NormalizedMeta("sd2-inpaint", model, "peft"), normalized)
    ranks = {module: pair.rank for module, pair in read.adapter.pairs.items()}
    facts = AdapterFacts("sd2-inpaint", model, "peft", ranks, read.adapter.nbytes)
    owner = key_owner(key_digest(KEY))
    return client.app.state.adapters.add(normalized, facts, "mine", owner).adapter_id


def call(client, method: str, path: str, key: str):
    return client.request(method, path, headers={"X-API-Key": key})


def test_another_key_gets_the_404_of_an_id_that_never_existed_on_every_owned_route(app, tmp_path):
    with TestClient(app, headers={"X-API-Key": KEY}) as client:
        routes = owned_routes(app)
        # jobs: get, result, events, cancel; templates: get, delete, image, thumbnail, prepare
        assert len(routes) >= 10, routes
        ids = owned_objects(client, tmp_path)
        for method, template in routes:
            path = template.format(**ids)
            theirs = call(client, method, path, OTHER_KEY)
            assert theirs.status_code == 404, (method, path, theirs.text)
            unknown = {name: uuid.uuid4().hex for name in ids}
            never = call(client, method, template.format(**unknown), OTHER_KEY)
            expected = never.json()["error"]
            for name, value in ids.items():
                expected = expected.replace(unknown[name], value)
            assert theirs.json()["error"] == expected, (method, path)  # the id is not confirmed
        # the owner still has everything (the cancel and delete above were refused, not applied);
        # finished, so its event stream ends
        batch = call(client, "GET", f"/v1/batches/{ids['batch_id']}", KEY).json()
        for job_id in [ids["job_id"], *(item["job_id"] for item in batch["items"])]:
            finished = JobEvent(job_id=job_id, status="done", at=1.0)
            assert client.app.state.service.jobstate.record_event(finished)
        for method, template in routes:
            if method == "GET":
                mine = call(client, method, template.format(**ids), KEY)
                assert mine.status_code != 404, (template, mine.text)
        # and listings are per key
        assert call(client, "GET", "/v1/templates", OTHER_KEY).json()["templates"] == []
        assert call(client, "GET", "/v1/jobs", OTHER_KEY).json()["jobs"] == []
        assert call(client, "GET", "/v1/batches", OTHER_KEY).json()["batches"] == []
        assert call(client, "GET", "/v1/adapters", OTHER_KEY).json()["adapters"] == []
        # a job cannot be submitted over another key's template either
        stolen = client.post(
            "/v1/jobs",
            data={"template_id": ids["template_id"], "prompt": "x"},
            files={"mask": ("m.png", MASK, "image/png")},
            headers={"X-API-Key": OTHER_KEY},
        )
        assert stolen.status_code == 404


def test_the_same_pixels_uploaded_by_two_keys_are_two_private_records(app):
    image = png(sample_template(64, 48, seed=6))
    with TestClient(app) as client:
        records = [
            client.post(
                "/v1/templates",
                files={"file": ("same.png", image, "image/png")},
                headers={"X-API-Key": key},
            ).json()
            for key in (KEY, OTHER_KEY)
        ]
        assert records[0]["sha256"] == records[1]["sha256"] and records[0]["id"] != records[1]["id"]
        for key, record in zip((KEY, OTHER_KEY), records, strict=True):
            listed = call(client, "GET", "/v1/templates", key).json()["templates"]
            assert [r["id"] for r in listed] == [record["id"]]
        assert call(client, "DELETE", f"/v1/templates/{records[1]['id']}", OTHER_KEY).status_code
        image_path = f"/v1/templates/{records[0]['id']}/image"
        assert call(client, "GET", image_path, KEY).content  # still there for its owner


def encodings(secret: str) -> list[str]:
    raw = secret.encode()
    return [
        secret,
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        raw.hex(),
    ]


def redis_dump(redis_client) -> str:
    """Every key and every value in Redis, as text."""
    parts = []
    for key in redis_client.scan_iter(count=1000):
        parts.append(repr(key))
        kind = redis_client.type(key).decode()
        value = {
            "string": lambda k: redis_client.get(k),
            "hash": lambda k: redis_client.hgetall(k),
            "list": lambda k: redis_client.lrange(k, 0, -1),
            "set": lambda k: redis_client.smembers(k),
            "zset": lambda k: redis_client.zrange(k, 0, -1, withscores=True),
            "stream": lambda k: redis_client.xrange(k),
        }[kind](key)
        parts.append(repr(value))
    return "\n".join(parts)


def test_keys_reach_redis_only_as_digests(redis_url, redis_client, tmp_path):
    settings = make_settings(
        redis_url, tmp_path, read_rate_per_minute=600, write_rate_per_minute=600
    )
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as client:
        ids = owned_objects(client, tmp_path)
        job_id = submit(client).json()["job_id"]
        client.get(f"/v1/jobs/{job_id}")
        client.get("/v1/jobs")
        client.delete(f"/v1/jobs/{ids['job_id']}")
        # a cancelled job's stream ends
        client.get(f"/v1/jobs/{ids['job_id']}/events", params={"api_key": KEY})
        client.post(f"/v1/templates/{ids['template_id']}/prepare")
        record = client.get(f"/v1/jobs/{job_id}").json()
    assert "owner" not in record  # the API never shows the digest ...
    owner = JobStateStore(redis_client).get(job_id)["owner"]
    assert owner == "key:" + hashlib.sha256(KEY.encode()).hexdigest()[:32]
    dump = redis_dump(redis_client)
    assert owner in dump  # the owner digest is what is stored ...
    for secret in encodings(KEY):
        assert secret not in dump  # ... never the key
    # the template records on disk hold the digest too
    records = "".join(p.read_text() for p in (tmp_path / "data" / "templates").rglob("*.json"))
    assert owner in records and KEY not in records


def test_keys_may_be_configured_as_digests(redis_url, redis_client, tmp_path):
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    settings = make_settings(redis_url, tmp_path)
    settings.api.__dict__["api_keys"] = (f"sha256:{digest}",)  # the environment holds no raw key
    with TestClient(create_app(settings, redis_client=redis_client)) as client:
        assert call(client, "GET", "/v1/templates", KEY).status_code == 200
        assert call(client, "GET", "/v1/templates", OTHER_KEY).status_code == 403
        assert call(client, "GET", "/v1/templates", f"sha256:{digest}").status_code == 403


def test_a_malformed_digest_entry_is_refused_at_start_up(tmp_path):
    from backend.config import SettingsError, load_settings

    with pytest.raises(SettingsError, match="64 hex"):
        load_settings({"MASKSERVE_API_KEYS": "sha256:abc"})


def test_reads_and_writes_spend_separate_buckets(redis_url, redis_client, tmp_path):
    settings = make_settings(
        redis_url,
        tmp_path,
        read_rate_per_minute=6,
        read_burst=2,
        write_rate_per_minute=6,
        write_burst=3,
    )
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as client:
        assert [client.get("/v1/jobs").status_code for _ in range(2)] == [200, 200]
        reads_out = client.get(f"/v1/jobs/{uuid.uuid4().hex}/events")  # a stream is a read
        assert reads_out.status_code == 429 and "reads a minute" in reads_out.json()["error"]
        # writes still have their own tokens
        writes = [client.delete(f"/v1/jobs/{uuid.uuid4().hex}").status_code for _ in range(3)]
        assert writes == [404, 404, 404]
        writes_out = submit(client)
        assert writes_out.status_code == 429 and "writes a minute" in writes_out.json()["error"]
        assert writes_out.headers["Retry-After"] in ("9", "10")
        # the other key's buckets are its own
        assert call(client, "GET", "/v1/jobs", OTHER_KEY).status_code == 200


def test_a_key_may_have_only_so_many_unfinished_jobs(redis_url, redis_client, tmp_path):
    settings = make_settings(redis_url, tmp_path, max_queued_jobs=2)
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as client:
        first, second = (submit(client).json()["job_id"] for _ in range(2))
        refused = submit(client)
        assert refused.status_code == 429
        assert refused.json()["error"].startswith("2 of your jobs are queued or running, the bound")
        assert "bound is 2" in refused.json()["error"]
        # another key is not held back by this one's queue
        other = client.post(
            "/v1/jobs",
            data={"prompt": "x"},
            files={"image": ("i.png", IMAGE, "image/png"), "mask": ("m.png", MASK, "image/png")},
            headers={"X-API-Key": OTHER_KEY},
        )
        assert other.status_code == 202
        # a finished (or cancelled) job frees its place
        client.app.state.service.jobstate.record_event(
            JobEvent(job_id=first, status="done", at=1.0)
        )
        assert submit(client).status_code == 202
        assert client.delete(f"/v1/jobs/{second}").status_code == 200
        assert submit(client).status_code == 202
        assert submit(client).status_code == 429


USER, PASSWORD = "ada", "correct horse"


def test_failed_studio_logins_are_throttled_per_user_and_address(redis_url, redis_client, tmp_path):
    settings = make_settings(
        redis_url,
        tmp_path,
        users=(f"{USER}:{PASSWORD}", "bob:builder"),
        login_failures_per_minute=1,
        login_failures_burst=2,
    )
    with TestClient(create_app(settings, redis_client=redis_client)) as client:

        def login(user, password):
            return client.post("/studio/login", data={"username": user, "password": password})

        assert login(USER, PASSWORD).status_code == 200  # a success spends nothing
        assert [login(USER, "guess").status_code for _ in range(2)] == [400, 400]
        throttled = login(USER, PASSWORD)  # even the right password waits: guessing gains nothing
        assert throttled.status_code == 429
        assert "too many failed sign-ins" in throttled.json()["error"]
        assert int(throttled.headers["Retry-After"]) >= 1
        assert login("bob", "builder").status_code == 200  # another user's bucket is its own

"""Browser-facing hardening: security headers on every API response, job data never cached, CORS
only for configured origins, metrics ports on loopback unless configured."""

from __future__ import annotations

import urllib.request
import uuid

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from backend.api.app import create_app
from backend.config import load_settings
from backend.metrics import serve_metrics
from backend.services.redis_server import free_port
from tests.api_factory import KEY, make_settings, submit

ORIGIN = "https://studio.example"


@pytest.fixture
def client(redis_url, redis_client, tmp_path):
    app = create_app(make_settings(redis_url, tmp_path), redis_client=redis_client)
    with TestClient(app, headers={"X-API-Key": KEY}) as test_client:
        yield test_client


def assert_hardened(response) -> None:
    headers = response.headers
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-frame-options"] == "DENY"
    assert headers["content-security-policy"] == "frame-ancestors 'none'"
    assert headers["referrer-policy"] == "no-referrer"


def test_every_kind_of_response_carries_the_security_headers(client):
    job_id = submit(client).json()["job_id"]
    responses = {
        "job": client.get(f"/v1/jobs/{job_id}"),
        "unknown job": client.get(f"/v1/jobs/{uuid.uuid4().hex}"),
        "no key": client.get("/v1/jobs", headers={"X-API-Key": ""}),
        "docs": client.get("/docs"),
        "openapi": client.get("/openapi.json"),
        "health": client.get("/healthz"),
        "studio": client.get("/studio/"),
        "unmatched": client.get("/nothing-here"),
    }
    for name, response in responses.items():
        assert_hardened(response), name
    assert responses["job"].status_code == 200 and responses["docs"].status_code == 200
    assert "swagger-ui" in responses["docs"].text  # the CSP names only frame ancestors: /docs works


def test_job_data_is_never_cached(client, redis_client):
    job_id = submit(client).json()["job_id"]
    for path in (f"/v1/jobs/{job_id}", "/v1/jobs", f"/v1/jobs/{uuid.uuid4().hex}"):
        assert client.get(path).headers["cache-control"] == "no-store", path
    assert submit(client).headers["cache-control"] == "no-store"
    # the event stream too (it said no-cache before; no-store wins for job data)
    from backend.protocol import JobEvent

    client.app.state.service.jobstate.record_event(JobEvent(job_id=job_id, status="done", at=1.0))
    events = client.get(f"/v1/jobs/{job_id}/events")
    assert events.headers["cache-control"] == "no-store"
    # other /v1 data is no-store unless its route chose (template images: private)
    assert client.get("/v1/templates").headers["cache-control"] == "no-store"


def test_no_cors_unless_origins_are_configured(client):
    plain = client.get("/v1/jobs", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in plain.headers
    preflight = client.options(
        "/v1/jobs",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_allows_exactly_the_configured_origins(redis_url, redis_client, tmp_path):
    settings = make_settings(redis_url, tmp_path, cors_origins=(ORIGIN,))
    with TestClient(create_app(settings, redis_client=redis_client)) as client:
        preflight = client.options(
            "/v1/jobs",
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "X-API-Key",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "x-api-key" in preflight.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in preflight.headers
        assert_hardened(preflight)
        read = client.get("/v1/jobs", headers={"Origin": ORIGIN, "X-API-Key": KEY})
        assert read.headers["access-control-allow-origin"] == ORIGIN
        stranger = client.options(
            "/v1/jobs",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert stranger.status_code == 400
        assert "access-control-allow-origin" not in stranger.headers


def test_cors_origins_come_from_the_environment():
    api = load_settings({"MASKSERVE_CORS_ORIGINS": f"{ORIGIN}, https://b.example"}).api
    assert api.cors_origins == (ORIGIN, "https://b.example")
    assert load_settings({}).api.cors_origins == ()


def test_metrics_listen_on_loopback_unless_configured():
    assert load_settings({}).metrics_host == "127.0.0.1"
    assert load_settings({"MASKSERVE_METRICS_HOST": "0.0.0.0"}).metrics_host == "0.0.0.0"
    port = free_port()
    server = serve_metrics(port, CollectorRegistry(), load_settings({}).metrics_host)
    try:
        assert server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200
    finally:
        server.shutdown()
        server.server_close()
    assert serve_metrics(0, CollectorRegistry()) is None  # port 0: nothing listens

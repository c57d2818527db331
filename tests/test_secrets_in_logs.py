"""No secret in any log line: a whole stack (every role its own process, DEBUG logs) runs a job flow
with an API key (header and ``?api_key=``), a wrong key and studio sign-ins (right and wrong); then
every role's log is searched for the key, the password, the wrong key and their obvious
encodings."""

from __future__ import annotations

import base64
import urllib.parse

import httpx
import pytest

from backend.client import MaskServeClient
from templates_store.samples import sample_template
from tests.stack_factory import running_stack
from tests.test_cpu_stages import HEIGHT, WIDTH, painted_mask, png

API_KEY = "sk-live-7f3a9c1e5b2d4068"
WRONG_KEY = "sk-wrong-0b1c2d3e4f5a6978"
USER, PASSWORD = "ada", "pw-Tr0ub4dor&3-horse"


def encodings(secret: str) -> set[str]:
    """The secret as a log line might carry it: raw, URL-quoted, base64 (alone and as HTTP basic
    auth with the user), hex."""
    raw = secret.encode()
    return {
        secret,
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote_plus(secret),
        base64.b64encode(raw).decode(),
        base64.b64encode(f"{USER}:{secret}".encode()).decode(),
        raw.hex(),
    }


@pytest.fixture
def stack(redis_url, models_dir, tmp_path, monkeypatch):
    env = {
        "MASKSERVE_API_KEYS": API_KEY,
        "MASKSERVE_USERS": f"{USER}:{PASSWORD}",
        "MASKSERVE_LOG_LEVEL": "DEBUG",  # the most a role ever logs
    }
    with running_stack(monkeypatch, tmp_path, redis_url, models_dir, ["w-1"], env) as started:
        yield started


@pytest.mark.slow
def test_no_role_logs_a_key_or_a_password(stack):
    running, base = stack
    template = sample_template(WIDTH, HEIGHT, seed=31)
    with MaskServeClient(base, API_KEY) as client:
        record = client.upload_template(png(template), name="secret-test")
        accepted = client.submit(
            png(painted_mask()), prompt="a chair", template_id=record["id"], steps=3, seed=1
        )
        final = client.wait(accepted["job_id"], timeout=180)
        assert final["status"] == "done", final
        assert client.result_bytes(accepted["job_id"])
    with httpx.Client(base_url=base, timeout=30) as http:
        job_id = accepted["job_id"]
        # the browser's way: the key in the URL
        streamed = http.get(f"/v1/jobs/{job_id}/events", params={"api_key": API_KEY})
        assert streamed.status_code == 200 and "done" in streamed.text
        assert http.get("/v1/jobs", headers={"X-API-Key": WRONG_KEY}).status_code == 403
        assert http.get("/v1/jobs", params={"api_key": API_KEY}).status_code == 401
        wrong = http.post("/studio/login", data={"username": USER, "password": WRONG_KEY})
        assert wrong.status_code == 400
        right = http.post("/studio/login", data={"username": USER, "password": PASSWORD})
        assert right.status_code == 200
    running.stop()
    logs = {path.name: path.read_text() for path in running.log_dir.glob("*.log")}
    assert {"api.log", "worker-0.log", "cpu-worker.log", "dispatcher.log"} <= set(logs)
    assert all(logs.values())  # every role did log (at DEBUG): an empty log would prove nothing
    for secret in (API_KEY, WRONG_KEY, PASSWORD):
        for form in encodings(secret):
            leaks = [name for name, text in logs.items() if form in text]
            assert not leaks, f"{form!r} (a form of a secret) appears in {leaks}"

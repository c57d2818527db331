"""Fixtures backed by a real S3-compatible server process: ``moto_server`` (from moto[server], in
the virtual environment) started on a free port for the test session, answering boto3 over HTTP
like MinIO or AWS would. Never a mock of boto3: every request crosses a socket to that process.

Registered in tests/conftest.py (``pytest_plugins``).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from backend.services.redis_server import free_port

# credentials moto accepts (any); set for boto3's own chain in this process and in role processes
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "maskserve-test",
    "AWS_SECRET_ACCESS_KEY": "maskserve-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """The endpoint URL of one ``moto_server`` process for the session (stopped at its end)."""
    binary = Path(sys.executable).with_name("moto_server")
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto_server.log").open("wb")
    process = subprocess.Popen(  # nosec B603: our own venv's server on a port we picked
        [str(binary), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()  # nosec B310
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start (see {log.name})") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """boto3's credentials for the test server in this process's environment; the endpoint."""
    for name, value in S3_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    return s3_endpoint


@pytest.fixture
def s3_bucket(s3_env):
    """(endpoint URL, name) of a new, empty bucket on the session's server."""
    from backend.blobs.factory import s3_client

    name = f"maskserve-{uuid.uuid4().hex[:12]}"
    s3_client(s3_env, "us-east-1").create_bucket(Bucket=name)
    return s3_env, name


def s3_role_env(endpoint: str, bucket: str, prefix: str = "deploy") -> dict[str, str]:
    """What a role's environment sets to keep its blobs in ``bucket`` (as a host would)."""
    return {
        **S3_CREDENTIALS,
        "MASKSERVE_BLOB_URL": f"s3://{bucket}/{prefix}",
        "MASKSERVE_S3_ENDPOINT_URL": endpoint,
    }

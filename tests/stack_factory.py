"""A whole stack for a test, each role its own process as ``maskserve up`` starts them, on the tiny
model: the one way the end-to-end, studio-browser and log tests build theirs."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator

from backend.config import load_settings
from backend.services.redis_server import free_port
from backend.services.stack import Role, Stack
from tests.factories import make_engine

CPU_ROLES = [Role("cpu-worker", ["cpu-worker"]), Role("dispatcher", ["dispatcher"])]


@contextlib.contextmanager
def running_stack(
    monkeypatch,
    tmp_path,
    redis_url: str,
    models_dir,
    worker_ids: list[str],
    env: dict[str, str],
    role_env: dict[str, dict[str, str]] | None = None,
) -> Iterator[tuple[Stack, str]]:
    """Start the CPU worker, the dispatcher, one engine worker per id and the API against
    ``redis_url`` with ``env`` set (API keys, users, log level) and ``role_env[role name]`` on top
    for that role (``cpu-worker``, ``dispatcher``, ``worker-<index>``, ``api``: as if on its own
    host); yields the stack and the API's base URL once ``/readyz`` answers, and stops every role
    after."""
    make_engine("sd2-inpaint", models_dir, tmp_path / "warm")  # built once, before roles load it
    port = free_port()
    for name, value in {
        "MASKSERVE_MODELS_DIR": str(models_dir),
        "MASKSERVE_MODEL": "tiny-sd2-inpaint",
        "MASKSERVE_API_PORT": str(port),
        **env,
    }.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(
        env=dict(os.environ), paths={"data_dir": str(tmp_path / "data")}, redis={"url": redis_url}
    )
    workers = [
        Role(f"worker-{index}", ["worker", "--worker-id", worker_id])
        for index, worker_id in enumerate(worker_ids)
    ]
    roles = [  # copies: CPU_ROLES' own stay as they are for the next stack
        dataclasses.replace(role, env={**role.env, **(role_env or {}).get(role.name, {})})
        for role in (*CPU_ROLES, *workers, Role("api", ["api"]))
    ]
    running = Stack(settings, roles)
    running.start()
    base = f"http://127.0.0.1:{port}"
    try:
        ready = running.wait_ready(f"{base}/readyz", threading.Event(), timeout_s=120)
        assert ready, {name: running.log_tail(name) for name in running.processes}
        yield running, base
    finally:
        running.stop()

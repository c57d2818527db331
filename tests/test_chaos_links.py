"""Chaos on the real stack's links: a worker cut off from Redis past its heartbeat TTL (a TCP
proxy the test controls), an unwritable activation-cache disk and an unwritable blob store (the
directory replaced by a file mid-load: every write fails, even as root). Every accepted job ends
exactly once (``tests.chaos.checker``); the test heals the disks' faults and the link's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from PIL import Image
from safetensors import safe_open

from backend.jobstate import JobStateStore
from backend.protocol.keys import heartbeat_key
from tests.chaos import fixtures
from tests.chaos.harness import JobLoad, UpStack, run_fault
from tests.chaos.proxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.chaos]
shared_stacks, stack = fixtures.shared_stacks, fixtures.stack

PROXIED = "w-proxied"
HOLD_S = 12.0  # past the heartbeat TTL (5 s) and the dispatcher's next check
WRITE_ERRORS = ("Not a directory", "File exists")  # what a write under a blocked directory raises


def start_proxied_worker(stack: UpStack, proxy: TcpProxy) -> subprocess.Popen:
    """A second engine worker whose every Redis connection (inbox, events, heartbeat, Celery
    broker) goes through ``proxy``; it is not supervised: it must live through the cut itself."""
    log = open(stack.data_dir / "logs" / f"{PROXIED}.log", "ab")
    env = stack.env | {
        "MASKSERVE_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0",
        "MASKSERVE_DATA_DIR": str(stack.data_dir),
    }
    command = [sys.executable, "-m", "backend.cli", "worker", "--worker-id", PROXIED]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return process


def redispatches(statuses: list[str]) -> int:
    """How many times a job went from running back to waiting (re-dispatched)."""
    return sum(
        1 for a, b in zip(statuses, statuses[1:], strict=False) if (a, b) == ("running", "waiting")
    )


def test_a_worker_cut_off_from_redis_has_its_jobs_redispatched_once(stack):
    upstream = urlsplit(stack.redis_url)
    proxy = TcpProxy(upstream.hostname or "127.0.0.1", upstream.port or 6379)
    worker = start_proxied_worker(stack, proxy)
    load, victim = JobLoad(stack, count=20), {}
    try:
        stack.wait_healthy(workers=2)

        def inject() -> float:
            victim["job"] = _wait_running_on(stack, load, PROXIED)
            at = time.time()
            proxy.cut()
            return at

        accepted_before_heal = []

        def heal() -> None:
            accepted_before_heal.append(proxy.accepted)
            proxy.heal()

        run_fault(stack, "network cut worker<->Redis", inject, heal, hold_s=HOLD_S, load=load)
        with stack.redis() as client:
            statuses = [e["status"] for _, e in JobStateStore(client).events(victim["job"])]
            assert redispatches(statuses) == 1, (victim, statuses, stack.logs())
            deadline = time.monotonic() + 60
            while not client.exists(heartbeat_key(PROXIED)) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert client.exists(heartbeat_key(PROXIED)), (
                f"{PROXIED} never came back\n{stack.logs()}"
            )
        assert worker.poll() is None and proxy.accepted > accepted_before_heal[0]
    finally:
        worker.kill()
        worker.wait()
        proxy.close()


def _wait_running_on(stack: UpStack, load: JobLoad, worker_id: str, timeout_s: float = 120) -> str:
    load.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with stack.redis() as client:
            jobstate = JobStateStore(client)
            for job in list(load.accepted):
                record = jobstate.get(job.job_id)
                if record["status"] == "running" and record["worker_id"] == worker_id:
                    return job.job_id
        time.sleep(0.05)
    raise AssertionError(f"no job ran on {worker_id}\n{stack.logs()}")


def block(directory: Path) -> None:
    """Make every write under ``directory`` fail, as on a dead or full disk, even for root (who
    ignores permissions): the directory is moved aside and a plain file takes its place."""
    directory.rename(directory.with_name(directory.name + ".held"))
    directory.write_bytes(b"")


def unblock(directory: Path) -> None:
    directory.unlink()
    directory.with_name(directory.name + ".held").rename(directory)


def test_an_unwritable_cache_disk_falls_back_to_dense_and_every_job_is_done(stack):
    cache = stack.data_dir / "template_cache"

    def inject() -> float:
        at = time.time()
        block(cache)
        return at

    run_fault(
        stack,
        "unwritable cache disk",
        inject,
        heal=lambda: unblock(cache),
        hold_s=10.0,
        fail_while_faulty=False,
        # templates no earlier test of this shared stack recorded: every job must record
        load=JobLoad(stack, seed=5000),
    )
    logs = [path.read_text(errors="replace") for path in (stack.data_dir / "logs").glob("w*.log")]
    assert any(error in log for log in logs for error in WRITE_ERRORS), (
        f"no cache write failed: the fault was not injected\n{stack.logs()}"
    )


def test_an_unwritable_blob_store_fails_jobs_clearly_and_leaves_no_partial_blob(stack):
    kinds = [stack.data_dir / "blobs" / kind for kind in ("prepared", "results")]
    load = JobLoad(stack)

    def inject() -> float:
        load.wait_running()
        at = time.time()
        for directory in kinds:
            block(directory)
        return at

    def heal() -> None:
        for directory in kinds:
            unblock(directory)

    run_fault(stack, "unwritable blob store", inject, heal, hold_s=8.0, load=load)
    assert not partial_blobs(stack.data_dir / "blobs"), stack.logs()


def partial_blobs(root: Path) -> list[str]:
    """Blobs that are not whole files: temporary files left over, unreadable images or tensors."""
    bad = []
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        if path.name.startswith(".") or path.suffix == ".tmp":
            bad.append(f"{path}: leftover temporary file")
        elif path.suffix in (".png", ".webp"):
            try:
                Image.open(path).load()
            except OSError as exc:
                bad.append(f"{path}: {exc}")
        elif path.suffix == ".safetensors":
            try:
                with safe_open(str(path), "np") as tensors:
                    [tensors.get_tensor(name) for name in tensors.keys()]
            except Exception as exc:  # safetensors raises its own error types
                bad.append(f"{path}: {exc}")
    return bad

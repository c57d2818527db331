"""The chaos suite's own tools, in milliseconds: the invariant checker catches each violation it
names, and the TCP proxy forwards, drops and refuses, then forwards again once healed."""

from __future__ import annotations

import io
import socket
import threading

import numpy as np
import pytest
from PIL import Image

from tests.chaos.checker import Observed, Submitted, job_violations, verdict
from tests.chaos.proxy import TcpProxy

TEMPLATE = Image.fromarray(np.full((8, 10, 3), 90, dtype=np.uint8))
MASK = np.zeros((8, 10), dtype=bool)
MASK[2:5, 3:7] = True


def result_png(change_outside: bool = False) -> bytes:
    pixels = np.asarray(TEMPLATE).copy()
    pixels[MASK] = 200
    if change_outside:
        pixels[0, 0] = 91
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def seen(status="done", statuses=None, result=b"", message="", denoised=None):
    denoised = int(status == "done") if denoised is None else denoised
    record = {"status": status, "message": message, f"{status}_at": 10.0, "denoised": denoised}
    events = statuses or ["queued", "waiting", "running", "postprocessing", status]
    return Observed(record, events, result or (result_png() if status == "done" else None))


JOB = Submitted("j1", 5.0, TEMPLATE, MASK)


def test_a_job_that_kept_every_invariant_has_no_violation():
    assert job_violations(JOB, seen(), after_fault=True) == []


@pytest.mark.parametrize(
    "observed, words",
    [
        (seen(result=result_png(change_outside=True)), "outside the mask"),
        (seen(statuses=["postprocessing", "waiting", "postprocessing", "done"]), "more than once"),
        (seen(denoised=2), "more than once"),
        (seen(denoised=0), "counts 0 denoises"),
        (seen(status="running"), "not terminal"),
        (seen(status="failed", message=""), "without saying why"),
        (seen(status="failed", message="disk full"), "expected done"),
        (seen(statuses=["running", "done", "done"]), "terminal events"),
        (Observed(None, []), "record is gone"),
    ],
)
def test_each_broken_invariant_is_reported(observed, words):
    assert any(words in v for v in job_violations(JOB, observed, after_fault=True))


def test_recovery_is_measured_from_the_fault_and_new_jobs_are_required():
    jobs = [JOB, Submitted("j2", 12.0, TEMPLATE, MASK)]
    outcome = verdict(jobs, {"j1": seen(), "j2": seen()}, fault_at=8.0)
    assert outcome.ok and outcome.first_new_done_s == 2.0 and outcome.all_terminal_s == 2.0
    assert not verdict([JOB], {"j1": seen()}, fault_at=8.0).ok  # nothing submitted after it


@pytest.fixture
def echo_server():
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: _echo(c), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(1024):
            conn.sendall(data)


def roundtrip(port: int, payload: bytes = b"ping") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(payload)
        return sock.recv(1024)


def test_the_proxy_forwards_drops_refuses_and_heals(echo_server):
    proxy = TcpProxy("127.0.0.1", echo_server)
    try:
        assert roundtrip(proxy.port) == b"ping"
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        held.sendall(b"a")
        assert held.recv(10) == b"a"
        proxy.cut()
        assert held.recv(10) == b""  # the open connection was dropped
        held.close()
        assert roundtrip(proxy.port) == b""  # a new one is closed at once
        assert proxy.refused >= 1
        proxy.heal()
        assert roundtrip(proxy.port, b"back") == b"back"
    finally:
        proxy.close()

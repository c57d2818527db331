"""The stack as ``maskserve up`` runs it, a stream of REST jobs, fault injection and the checks.

``UpStack`` starts ``python -m backend.cli up`` (Redis with its AOF, a Celery CPU worker, the
dispatcher, the engine worker, the API) and finds its processes by their command lines, so a
test can kill -9 exactly one role and leave recovery to the stack's own supervision. ``JobLoad``
submits jobs over REST at a steady pace with irregular masks; ``run_fault`` is the shape of every
chaos test: load, fault mid-load, optional heal, jobs after the fault, then ``checker.verdict``
over everything the API accepted, with the stack's log tails in the failure message and the
measured recovery written to the report (``report.record``).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil
import redis
from PIL import Image, ImageDraw

from backend.client import MaskServeClient, MaskServeError
from backend.jobstate import JobNotFound, JobStateStore
from backend.protocol.keys import heartbeat_key
from backend.services.redis_server import free_port
from templates_store.samples import sample_template
from tests.chaos import report
from tests.chaos.checker import TERMINAL, Observed, Submitted, Verdict, verdict

API_KEY = "chaos-key"
WIDTH, HEIGHT = 200, 150  # not square, not a bucket size: crop, resize and paste-back all run
RESOLUTION = 128
STEPS = 12
READY_S = 240.0  # a cold stack on a loaded 2-core machine loads torch in five processes
SETTLE_S = 180.0  # fault -> every accepted job terminal, at most
ROLE_KINDS = ("cpu-worker", "dispatcher", "worker", "api")


def irregular_mask(seed: int, size=(WIDTH, HEIGHT)) -> np.ndarray:
    """A seeded blob of ellipses and a polygon (bool, True = repaint), never empty or full."""
    rng = np.random.default_rng(seed)
    image = Image.new("L", size, 0)
    draw = ImageDraw.Draw(image)
    width, height = size
    for _ in range(int(rng.integers(1, 4))):
        x, y = rng.integers(10, width - 40), rng.integers(10, height - 40)
        draw.ellipse([x, y, x + rng.integers(12, 40), y + rng.integers(12, 40)], fill=255)
    points = [(float(rng.uniform(0, width)), float(rng.uniform(0, height))) for _ in range(5)]
    draw.polygon(points, fill=255)
    return np.asarray(image) > 127


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class UpStack:
    """``maskserve up`` in a child process, on its own data dir, Redis and API port."""

    def __init__(self, data_dir: Path, models_dir: Path, env: dict[str, str] | None = None):
        self.data_dir, self.port = Path(data_dir), free_port()
        unset = ("REDIS_URL", "MASKSERVE_REDIS_URL")  # the stack starts and supervises its own
        base = {k: v for k, v in os.environ.items() if k not in unset}
        self.env = (
            base
            | {
                "MASKSERVE_DATA_DIR": str(self.data_dir),
                "MASKSERVE_MODELS_DIR": str(models_dir),
                "MASKSERVE_MODEL": "tiny-sd2-inpaint",
                "MASKSERVE_API_KEYS": API_KEY,
                "MASKSERVE_API_PORT": str(self.port),
                "MASKSERVE_STUDIO": "0",
                # a test client sends bursts no user would; the limits have tests of their own
                "MASKSERVE_READ_RATE_PER_MINUTE": "0",
                "MASKSERVE_WRITE_RATE_PER_MINUTE": "0",
                "OMP_NUM_THREADS": "1",
            }
            | (env or {})
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.redis_url = ""
        self.process: subprocess.Popen | None = None
        self.output: list[str] = []

    # ----- life ---------------------------------------------------------------------------------
    def start(self) -> UpStack:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "up"],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read_output, daemon=True).start()
        return self

    def _read_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line.rstrip())
            if line.startswith("Redis ") and not self.redis_url:
                self.redis_url = line.split()[-1]

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_healthy(self, timeout_s: float = READY_S, workers: int = 1) -> None:
        """Every role running, ``/readyz`` 200 and ``workers`` engine heartbeats; raises with the
        logs otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.alive():
            if self._healthy(workers):
                return
            time.sleep(0.5)
        raise AssertionError(f"the stack did not become healthy\n{self.logs()}")

    def _healthy(self, workers: int) -> bool:
        if set(self.roles()) != set(ROLE_KINDS) or not self.redis_url:
            return False
        try:
            if httpx.get(f"{self.url}/readyz", timeout=2).status_code != 200:
                return False
            with self.redis() as client:
                return len(list(client.scan_iter(match=heartbeat_key("*")))) >= workers
        except (httpx.HTTPError, redis.RedisError, OSError):
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for child in self._orphans():
            child.kill()  # only processes of this stack's data dir (a role the test started)

    def _orphans(self) -> list[psutil.Process]:
        mine = []
        for proc in psutil.process_iter(["cmdline", "environ"]):
            try:
                if (proc.info["environ"] or {}).get("MASKSERVE_DATA_DIR") == str(self.data_dir):
                    mine.append(proc)
            except (psutil.Error, TypeError):
                continue
        return [p for p in mine if p.pid != os.getpid()]

    # ----- processes ----------------------------------------------------------------------------
    def roles(self) -> dict[str, psutil.Process]:
        """Role kind (``ROLE_KINDS``) -> its running process (the first of a kind)."""
        found: dict[str, psutil.Process] = {}
        if not self.alive():
            return found
        assert self.process is not None
        for child in psutil.Process(self.process.pid).children():
            try:
                cmdline = child.cmdline()
                if child.status() == psutil.STATUS_ZOMBIE or "backend.cli" not in cmdline:
                    continue
            except psutil.Error:
                continue
            kind = cmdline[cmdline.index("backend.cli") + 1]
            found.setdefault(kind, child)
        return found

    def role(self, kind: str) -> psutil.Process:
        role = self.roles().get(kind)
        assert role is not None, f"no running {kind}\n{self.logs()}"
        return role

    def redis_process(self) -> psutil.Process:
        assert self.process is not None
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if "redis-server" in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        raise AssertionError(f"no redis-server under maskserve up\n{self.logs()}")

    def celery_child(self) -> psutil.Process:
        children = self.role("cpu-worker").children()
        assert children, f"the Celery worker has no pool process\n{self.logs()}"
        return children[0]

    # ----- clients and logs ---------------------------------------------------------------------
    def client(self) -> MaskServeClient:
        return MaskServeClient(self.url, API_KEY, timeout=30)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=2)

    def logs(self, lines: int = 25) -> str:
        parts = [f"--- maskserve up (exit {self.process and self.process.poll()})"]
        parts += self.output[-lines:]
        for path in sorted((self.data_dir / "logs").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts += [f"--- {path.name}", *tail]
        return "\n".join(parts)


def kill(process: psutil.Process) -> float:
    """kill -9 one process; returns when (wall clock) the fault happened."""
    at = time.time()
    process.send_signal(signal.SIGKILL)
    return at


@dataclass
class JobLoad:
    """Submits ``count`` jobs over REST, one every ``every_s``, from a thread. A refused submission
    (API down, Redis away) is counted, not retried: only accepted jobs are owed a result."""

    stack: UpStack
    count: int = 16
    every_s: float = 0.4
    seed: int = 0
    accepted: list[Submitted] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> JobLoad:
        """Start submitting (once: a test that started the load early is not restarted)."""
        if self._thread.ident is None:
            self._thread.start()
        return self

    def join(self, timeout_s: float = 120) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        with self.stack.client() as client:
            for index in range(self.count):
                self.submit_one(client, self.seed + index)
                time.sleep(self.every_s)

    def submit_one(self, client: MaskServeClient, seed: int) -> Submitted | None:
        template, mask = sample_template(WIDTH, HEIGHT, seed=seed), irregular_mask(seed)
        try:
            body = client.submit(
                png(Image.fromarray(mask.astype(np.uint8) * 255)),
                prompt=f"chaos {seed}",
                image=png(template),
                steps=STEPS,
                seed=seed,
                resolution=RESOLUTION,
            )
        except (MaskServeError, httpx.HTTPError) as exc:
            self.refused.append(f"{seed}: {exc}")
            return None
        job = Submitted(body["job_id"], time.time(), template, mask)
        self.accepted.append(job)
        return job

    def submit_until_accepted(self, count: int, seed: int, timeout_s: float = 120) -> None:
        """After a fault: new jobs, retried until the API takes each (it may be restarting)."""
        deadline = time.monotonic() + timeout_s
        with self.stack.client() as client:
            for index in range(count):
                while self.submit_one(client, seed + index) is None:
                    assert time.monotonic() < deadline, f"no job accepted: {self.refused[-3:]}"
                    time.sleep(0.5)

    def wait_running(self, timeout_s: float = 120) -> str:
        """Until some accepted job is running on a worker; returns its id."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.stack.redis() as client:
                jobstate = JobStateStore(client)
                for job in list(self.accepted):
                    if jobstate.status(job.job_id) == "running":
                        return job.job_id
            time.sleep(0.05)
        raise AssertionError(f"no job ran\n{self.stack.logs()}")


def collect(stack: UpStack, jobs: list[Submitted], settle_s: float = SETTLE_S) -> dict:
    """Wait (up to ``settle_s``) until every job is terminal, then read what the stack says about
    each; Redis or the API being away for a while (a fault still healing) is waited out."""
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        try:
            with stack.redis() as client:
                jobstate = JobStateStore(client)
                if all(jobstate.status(job.job_id) in TERMINAL for job in jobs):
                    break
        except redis.RedisError:
            pass
        time.sleep(0.5)
    return {job.job_id: _observe(stack, job.job_id, deadline) for job in jobs}


def _observe(stack: UpStack, job_id: str, deadline: float) -> Observed:
    while True:
        try:
            with stack.redis() as client, stack.client() as api:
                jobstate = JobStateStore(client)
                try:
                    record = jobstate.get(job_id)
                except JobNotFound:
                    return Observed(None, [])
                statuses = [event["status"] for _, event in jobstate.events(job_id)]
                result = api.result_bytes(job_id) if record["status"] == "done" else None
                return Observed(record, statuses, result)
        except (redis.RedisError, httpx.HTTPError, MaskServeError):
            if time.monotonic() > deadline + 60:
                raise
            time.sleep(1.0)


def run_fault(
    stack: UpStack,
    fault: str,
    inject: Callable[[], float],
    heal: Callable[[], None] | None = None,
    hold_s: float = 0.0,
    load: JobLoad | None = None,
    extra: Callable[[JobLoad], None] | None = None,
    fail_while_faulty: bool = True,
) -> Verdict:
    """The shape of every chaos test (see the module docstring); ``inject`` returns the fault's
    wall-clock time; ``extra(load)`` runs after the fault (a test's own checks or jobs).
    ``fail_while_faulty``: a job accepted between the fault and ``heal`` may end ``failed`` (a full
    disk); False: it too must end as expected (the fault must not reach users at all)."""
    stack.wait_healthy()
    load = (load or JobLoad(stack)).start()
    load.wait_running()
    fault_at, healed_at = inject(), None
    if heal is not None:
        time.sleep(hold_s)
        heal()
        healed_at = time.time() if fail_while_faulty else None
    load.join()
    if extra is not None:
        extra(load)
    load.submit_until_accepted(3, seed=load.seed + 1000)
    outcome = verdict(load.accepted, collect(stack, load.accepted), fault_at, healed_at)
    report.record(fault, outcome, len(load.accepted), load.refused)
    assert outcome.ok, "\n".join(outcome.violations[:20]) + "\n" + stack.logs()
    return outcome

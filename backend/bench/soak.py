"""`maskserve bench soak`: a whole stack under steady load for minutes, watched for growth.

The command starts a stack the way ``maskserve up`` does (``plan_roles`` + ``Stack``: Redis, CPU
workers, dispatcher, one engine worker per GPU or one CPU worker, the API) in a data directory of
its own, or drives a running one (``--url`` + ``--api-key``; its roles are then found among this
machine's processes). It uploads a few templates, runs one job per template (their caches are
recorded then: not measured), then:

1. **capacity**: ``capacity_clients`` closed-loop clients (submit, wait, submit again) for
   ``capacity_s``; capacity = jobs done in that time / that time (or ``--capacity-rps``);
2. **soak**: open-loop Poisson arrivals at ``load`` x capacity for ``minutes`` (Zipf template
   choice, Beta mask ratios, own seeds: ``backend.bench.trace``), blob and rectangle masks
   (``backend.imaging.masks.synthetic_mask``); every ``sample_s`` it samples every role, Redis and
   the disk (``backend.bench.soak_sampler``) and the P95 latency of the jobs finished since the
   last sample;
3. **drain**: no more arrivals; every submitted job must reach a terminal state within
   ``drain_s``, else it is counted lost.

The verdict (``backend.bench.soak_verdict``) judges every bounded-by-design metric; the soak fails
(``SoakResult.failures`` non-empty, exit status 1) when one grows, a job is lost, failed, cancelled
or refused, or a role had to be restarted. Jobs are followed by polling ``GET /v1/jobs/{id}``
from one thread (not one event stream per job), so the client stays light next to the stack.
"""

from __future__ import annotations

import io
import logging
import os
import random
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from PIL import Image
from redis import Redis
from tqdm import tqdm

from backend.bench.soak_sampler import (
    disk_parts,
    find_role_pids,
    sample_disk,
    sample_redis,
    sample_roles,
)
from backend.bench.soak_verdict import TOLERANCES, failures, judge_all
from backend.bench.trace import poisson_trace
from backend.client import TERMINAL, MaskServeClient, MaskServeError
from backend.config import Settings, load_settings
from backend.imaging.masks import synthetic_mask
from backend.worker.stats import percentile
from templates_store.samples import sample_template

PROMPT = "a red leather armchair"
POLL_S = 0.25
# Totals holding TTL-bounded per-job keys (kept a week): recorded, not judged, in a soak of minutes
NOT_JUDGED = ("redis/all/", "redis/volatile/redis_keys")


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 30.0
    sample_s: float = 60.0
    load: float = 0.8
    model_id: str = "tiny-sd2-inpaint"
    steps: int = 4
    size: int = 128
    templates: int = 6
    mask_mean: float = 0.11
    seed: int = 0
    capacity_s: float = 60.0
    capacity_clients: int = 4
    capacity_rps: float = 0.0  # > 0: skip the capacity phase
    drain_s: float = 180.0
    warmup: float = 0.2
    cpu_workers: int = 1
    retention_s: float = 120.0  # blobs of finished jobs, in a stack the soak starts
    data_dir: str = ""  # a stack the soak starts: "" = a fresh temporary directory
    url: str = ""  # a running stack instead
    api_key: str = ""
    redis_url: str = ""  # of the running stack (sampled when given)

    def __post_init__(self) -> None:
        checks = {
            "--minutes": self.minutes > 0,
            "--sample-s": self.sample_s > 0,
            "--load": 0 < self.load <= 2,
            "--steps": self.steps >= 1,
            "--size": self.size >= 8,
            "--templates": self.templates >= 1,
            "--capacity-s": self.capacity_s > 0,
            "--capacity-clients": self.capacity_clients >= 1,
            "--drain-s": self.drain_s > 0,
            "--retention-s": self.retention_s > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"bad soak settings: {', '.join(bad)} out of range ({self})")
        if self.url and not self.api_key:
            raise ValueError("--url needs --api-key (a key of that stack)")


# ----- jobs ---------------------------------------------------------------------------------------
@dataclass
class _Job:
    job_id: str
    submitted: float  # monotonic
    finished: float = 0.0  # monotonic, when seen terminal
    status: str = "queued"
    latency_s: float = 0.0
    message: str = ""
    done: threading.Event = field(default_factory=threading.Event)


class Tracker:
    """Submits jobs and follows them to a terminal state by polling, from one thread.

    Invariant: every accepted job is in ``jobs`` and stays there; ``refused`` counts submissions
    the API turned down (with the last reason), which never became jobs."""

    def __init__(self, client: MaskServeClient, cfg: SoakConfig, template_ids: list[str]):
        self.client, self.cfg, self.template_ids = client, cfg, template_ids
        self.jobs: list[_Job] = []
        self.refused, self.refusal = 0, ""
        self._open: list[_Job] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="soak-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def submit(self, template: int, mask_ratio: float, seed: int) -> _Job | None:
        size = self.cfg.size
        kind = "rect" if seed % 3 == 0 else "blob"  # irregular blobs, some box selections
        mask = synthetic_mask(size, size, mask_ratio, seed=seed, kind=kind)
        try:
            accepted = self.client.submit(
                _png(Image.fromarray(mask.astype("uint8") * 255)),
                PROMPT,
                template_id=self.template_ids[template % len(self.template_ids)],
                model=self.cfg.model_id,
                steps=self.cfg.steps,
                resolution=size,
                seed=seed,
            )
        except (MaskServeError, httpx.TransportError) as exc:
            with self._lock:
                self.refused, self.refusal = self.refused + 1, str(exc)
            return None
        job = _Job(accepted["job_id"], time.monotonic())
        with self._lock:
            self.jobs.append(job)
            self._open.append(job)
        return job

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                pending = list(self._open)
            for job in pending:
                try:
                    state = self.client.get(job.job_id)
                except (MaskServeError, httpx.TransportError):
                    continue  # asked again next turn; the drain deadline bounds the wait
                if state["status"] in TERMINAL:
                    self._finish(job, state)

    def _finish(self, job: _Job, state: dict) -> None:
        job.finished, job.status = time.monotonic(), state["status"]
        job.message = state.get("message", "")
        total = (state.get("timings") or {}).get("total_s")
        job.latency_s = float(total) if total else job.finished - job.submitted
        with self._lock:
            self._open.remove(job)
        job.done.set()

    def counts(self) -> dict[str, int]:
        with self._lock:
            statuses = [job.status for job in self.jobs]
        counts = {"submitted": len(statuses), "refused": self.refused}
        for status in ("done", "failed", "cancelled"):
            counts[status] = statuses.count(status)
        counts["lost"] = sum(status not in TERMINAL for status in statuses)
        return counts

    def latencies_between(self, start: float, end: float) -> list[float]:
        with self._lock:
            return [
                j.latency_s for j in self.jobs if j.status == "done" and start < j.finished <= end
            ]


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# ----- the stack under test ---------------------------------------------------------------------
class Target:
    """The stack a soak drives: its URL and key, Redis, role processes and data directory.
    ``extra_env``: settings of every role it starts, over the soak's own (``_stack_env``);
    ``own_cache``: its template cache inside its data directory, whatever the environment names
    (a stack that must start cold)."""

    def __init__(
        self,
        cfg: SoakConfig,
        settings: Settings,
        extra_env: dict | None = None,
        own_cache: bool = False,
    ):
        self.cfg, self.settings, self.own_cache = cfg, settings, own_cache
        self.extra_env = dict(extra_env or {})
        self.made_data_dir = False
        self.stack = None
        self.base_url, self.api_key, self.redis_url = cfg.url, cfg.api_key, cfg.redis_url
        self.data_dir = Path(cfg.data_dir or settings.paths.data_dir)
        self.cache_dir = settings.paths.resolved_cache_dir()

    def start(self) -> None:
        """Start the stack (unless ``--url``) and wait until the API is ready."""
        if self.cfg.url:
            return
        from backend.models import materialize
        from backend.services.redis_server import free_port
        from backend.services.stack import Stack, assign_metrics_ports, engine_devices, plan_roles

        models_dir = self.settings.paths.resolved_models_dir().resolve()
        materialize(self.cfg.model_id, models_dir)  # once, before every role loads it
        self.made_data_dir = not self.cfg.data_dir  # a temporary one, the caller's to remove
        self.data_dir = Path(self.cfg.data_dir or tempfile.mkdtemp(prefix="maskserve-soak-"))
        port, self.api_key = free_port(), secrets.token_urlsafe(16)
        env = _stack_env(self.cfg, models_dir, port, self.api_key) | self.extra_env
        if self.own_cache:
            env["MASKSERVE_CACHE_DIR"] = str(self.data_dir / "template_cache")
        settings = load_settings(
            env={**os.environ, **env}, paths={"data_dir": str(self.data_dir)}, redis={"url": ""}
        )
        self.cache_dir = settings.paths.resolved_cache_dir()
        roles = plan_roles(settings, engine_devices(), cpu_workers=self.cfg.cpu_workers)
        assign_metrics_ports(roles, settings)  # fixed ports when free, like `up`
        for role in roles:
            role.env = {**env, **role.env}
        self.stack = Stack(settings, roles)
        self.redis_url = self.stack.start()
        self.base_url = f"http://127.0.0.1:{port}"
        if not self.stack.wait_ready(f"{self.base_url}/readyz", threading.Event()):
            tails = {name: self.stack.log_tail(name, 10) for name in self.stack.processes}
            raise RuntimeError(f"the stack did not become ready; its logs' last lines: {tails}")

    def pids(self) -> dict[str, int]:
        """Role name -> process id now (a role being restarted is left out)."""
        if self.stack is None:
            pids = find_role_pids()
            if self.redis_url:
                pids["redis-server"] = int(self._redis().info("server")["process_id"])
            return pids
        return {name: s["pid"] for name, s in self.stack.snapshot().items() if s["pid"]}

    def restarts(self) -> dict[str, int]:
        """Restarts of each role of a stack the soak started (its supervisor counts them)."""
        if self.stack is None:
            return {}
        return {name: s["restarts"] for name, s in self.stack.snapshot().items() if s["restarts"]}

    def supervise(self) -> None:
        """One supervision turn, as ``maskserve up`` does: a role that exited is restarted."""
        if self.stack is not None:
            self.stack.poll()

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        """``event.wait(timeout_s)``, supervising the stack meanwhile (from this thread, the one
        that started it)."""
        deadline = time.monotonic() + timeout_s
        while not event.wait(min(POLL_S * 4, max(0.0, deadline - time.monotonic()))):
            self.supervise()
            if time.monotonic() >= deadline:
                return False
        return True

    def _redis(self) -> Redis:
        if not hasattr(self, "_client"):
            self._client = Redis.from_url(self.redis_url, socket_timeout=10)
        return self._client

    def sample(self, rng: random.Random) -> dict[str, float]:
        reading = sample_roles(self.pids())
        if self.redis_url:
            reading |= sample_redis(self._redis(), rng)
        return reading | sample_disk(disk_parts(self.data_dir, self.cache_dir), self.data_dir)

    def stop(self) -> None:
        if hasattr(self, "_client"):
            self._client.close()
        if self.stack is not None:
            self.stack.stop()


def _stack_env(cfg: SoakConfig, models_dir: Path, port: int, api_key: str) -> dict[str, str]:
    """Settings of every role of a stack the soak starts (over this process's environment): its
    model, its own key, no rate limits nor bound on open jobs (one client sends every job), and
    blob retention short enough that the janitor's bound shows within the run."""
    hours = str(cfg.retention_s / 3600)
    return {
        "MASKSERVE_MODEL": cfg.model_id,
        "MASKSERVE_MODELS_DIR": str(models_dir),
        "MASKSERVE_API_HOST": "127.0.0.1",
        "MASKSERVE_API_PORT": str(port),
        "MASKSERVE_API_KEYS": api_key,
        "MASKSERVE_READ_RATE_PER_MINUTE": "0",
        "MASKSERVE_WRITE_RATE_PER_MINUTE": "0",
        "MASKSERVE_MAX_QUEUED_JOBS": "0",
        "MASKSERVE_INPUT_RETENTION_HOURS": hours,
        "MASKSERVE_RESULT_RETENTION_HOURS": hours,
        "MASKSERVE_JANITOR_EVERY_S": str(max(5.0, cfg.retention_s / 4)),
    }


# ----- the phases -----------------------------------------------------------------------------
def warm_up(tracker: Tracker, target: Target, cfg: SoakConfig) -> None:
    """One job per template, in turn: records each template's cache (not measured)."""
    for index in range(len(tracker.template_ids)):
        job = tracker.submit(index, cfg.mask_mean, seed=10_000 + index)
        if job is None:
            raise RuntimeError(f"the stack refused the warm-up job: {tracker.refusal}")
        if not target.wait(job.done, cfg.drain_s) or job.status != "done":
            raise RuntimeError(f"warm-up job {job.job_id} ended {job.status}: {job.message}")


def measure_capacity(tracker: Tracker, target: Target, cfg: SoakConfig) -> float:
    """Jobs done per second by ``capacity_clients`` closed-loop clients over ``capacity_s``."""
    start = time.monotonic()
    deadline = start + cfg.capacity_s
    rng = random.Random(cfg.seed)
    lock = threading.Lock()

    def client_loop() -> None:
        while time.monotonic() < deadline:
            with lock:
                template, seed = rng.randrange(cfg.templates), rng.randrange(2**31)
            job = tracker.submit(template, cfg.mask_mean, seed)
            if job is None or not job.done.wait(cfg.drain_s):
                return

    threads = [threading.Thread(target=client_loop) for _ in range(cfg.capacity_clients)]
    for thread in threads:
        thread.start()
    finished = threading.Event()
    threading.Thread(target=_join_all, args=(threads, finished), daemon=True).start()
    target.wait(finished, cfg.capacity_s + cfg.drain_s)
    done = len(tracker.latencies_between(start, deadline))
    if done == 0:
        raise RuntimeError(
            f"no job finished in the {cfg.capacity_s:.0f} s capacity phase: raise --capacity-s "
            f"or lower --steps/--size (refused: {tracker.refused} {tracker.refusal})"
        )
    return done / cfg.capacity_s


def _join_all(threads: list[threading.Thread], finished: threading.Event) -> None:
    for thread in threads:
        thread.join()
    finished.set()


def soak(
    tracker: Tracker, target: Target, cfg: SoakConfig, rps: float, progress: bool
) -> list[dict]:
    """Open-loop Poisson arrivals at ``rps`` for ``minutes``, sampling every ``sample_s``; returns
    the samples (``t_s`` since the start, the readings, the period's P95 latency and job counts)."""
    duration = cfg.minutes * 60.0
    trace = poisson_trace(rps, duration, cfg.templates, cfg.mask_mean, seed=cfg.seed + 1)
    rng, samples = random.Random(cfg.seed), []
    start = last = time.monotonic()
    next_sample, arrivals = start, iter(trace)
    request = next(arrivals, None)
    bar = tqdm(total=round(duration), unit="s", desc="soak", disable=not progress)
    while True:
        target.supervise()
        now = time.monotonic()
        if now >= next_sample:
            samples.append(_sample(tracker, target, rng, start, last, now))
            last, next_sample = now, next_sample + cfg.sample_s
            bar.set_postfix(_postfix(samples[-1], tracker), refresh=False)
            if now - start >= duration:
                break
        if request is not None and now - start >= request.arrival_s:
            tracker.submit(request.template, request.mask_ratio, request.seed)
            request = next(arrivals, None)
            continue
        bar.update(max(0, min(round(duration), round(now - start)) - bar.n))  # tqdm throttles
        wake = next_sample if request is None else min(next_sample, start + request.arrival_s)
        time.sleep(max(0.0, min(1.0, wake - time.monotonic())))
    bar.close()
    return samples


def _sample(tracker, target, rng, start: float, last: float, now: float) -> dict:
    latencies = tracker.latencies_between(last, now)
    return {
        "t_s": round(now - start, 3),
        "readings": target.sample(rng),
        "p95_latency_s": percentile(latencies, 95) if latencies else None,
        "finished": len(latencies),
        "open_jobs": tracker.open_count(),
    }


def _postfix(sample: dict, tracker: Tracker) -> dict:
    p95 = sample["p95_latency_s"]
    return {
        "done": tracker.counts()["done"],
        "open": sample["open_jobs"],
        "p95": p95 and round(p95, 2),
    }


def drain(tracker: Tracker, target: Target, cfg: SoakConfig) -> None:
    """Wait for every submitted job to reach a terminal state, up to ``drain_s``."""
    deadline = time.monotonic() + cfg.drain_s
    while tracker.open_count() and time.monotonic() < deadline:
        target.supervise()
        time.sleep(POLL_S)


# ----- the whole run ----------------------------------------------------------------------------
def series_of(samples: list[dict]) -> dict[str, list[tuple[float, float | None]]]:
    """Metric name -> ``(t_s, value)`` over the samples (the latency included)."""
    series: dict[str, list[tuple[float, float | None]]] = {}
    for sample in samples:
        values = {**sample["readings"], "latency/p95/latency_s": sample["p95_latency_s"]}
        for name, value in values.items():
            series.setdefault(name, []).append((sample["t_s"], value))
    return series


def judged(name: str) -> bool:
    """Whether the verdict applies to a metric: bounded by design, and of a known kind."""
    return not name.startswith(NOT_JUDGED) and name.rsplit("/", 1)[-1] in TOLERANCES


def run_soak(cfg: SoakConfig, settings: Settings, progress: bool = True) -> dict:
    """The whole soak; returns the report (see ``write_outputs``) with its ``failures``."""
    target = Target(cfg, settings)
    started = time.time()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    try:
        target.start()
        with MaskServeClient(target.base_url, target.api_key, timeout=60.0) as client:
            template_ids = [
                client.upload_template(
                    _png(sample_template(cfg.size, cfg.size, seed=2000 + i)),
                    name=f"soak-{i}",
                    tags=["soak"],
                )["id"]
                for i in range(cfg.templates)
            ]
            tracker = Tracker(client, cfg, template_ids)
            tracker.start()
            try:
                warm_up(tracker, target, cfg)
                capacity = cfg.capacity_rps or measure_capacity(tracker, target, cfg)
                drain(tracker, target, cfg)
                before = tracker.counts()
                samples = soak(tracker, target, cfg, cfg.load * capacity, progress)
                drain(tracker, target, cfg)
            finally:
                tracker.close()
            counts, soak_jobs = tracker.counts(), _soak_jobs(tracker, before)
            soak_jobs["refusal"] = tracker.refusal
            restarts = target.restarts()
    finally:
        target.stop()
    return _report(cfg, target, started, capacity, samples, counts, soak_jobs, restarts)


def _soak_jobs(tracker: Tracker, before: dict[str, int]) -> dict:
    jobs = tracker.jobs[before["submitted"] :]
    latencies = [j.latency_s for j in jobs if j.status == "done"]
    return {
        "submitted": len(jobs),
        "done": len(latencies),
        **{f"p{q}_latency_s": percentile(latencies, q) for q in (50, 95, 99)},
        "mean_latency_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "failed_messages": sorted({j.message for j in jobs if j.status == "failed"})[:5],
    }


def _report(cfg, target, started, capacity, samples, counts, soak_jobs, restarts) -> dict:
    series = series_of(samples)
    verdicts = judge_all({k: v for k, v in series.items() if judged(k)}, warmup=cfg.warmup)
    lines = failures(verdicts, counts)
    lines += [f"role {name} restarted {n} times" for name, n in sorted(restarts.items())]
    return {
        "config": asdict(cfg) | {"api_key": "***" if cfg.api_key else ""},
        "machine": machine(),
        "started_at": started,
        "data_dir": str(target.data_dir),
        "capacity_rps": capacity,
        "offered_rps": cfg.load * capacity,
        "jobs": counts,
        "soak_jobs": soak_jobs,
        "restarts": restarts,
        "samples": samples,
        "verdicts": [v.as_dict() for v in verdicts],
        "failures": lines,
        "passed": not lines,
    }


def machine() -> str:
    """The device and host the soak ran on, for the plot's title and the JSON."""
    import platform

    import torch

    cpu = f"{os.cpu_count()} CPU cores, {platform.machine()}"
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {cpu}"
    return f"CPU only, {cpu}"

"""`maskserve bench route --real`: the routing policies on real processes at a small scale.

For each policy a fresh stack runs on this machine (a Celery CPU worker, ``workers`` CPU engine
workers with the tiny model, the dispatcher with that policy; one Redis and one data directory for
the whole run, so template caches recorded on disk by the warm-up serve every policy alike). The
same Poisson trace (Zipf templates, Beta mask ratios, each request's own seed) is submitted through
the real path (job state, Celery pre-processing, dispatcher, worker, Celery post-processing) and
latency is measured from submission to the job's ``done``, from the job state's own timestamps.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from backend.bench.trace import poisson_trace
from backend.blobs.factory import open_blob_store
from backend.config import Settings
from backend.dispatch.router import POLICIES
from backend.imaging.masks import synthetic_mask
from backend.jobstate import TERMINAL, JobStateStore
from backend.protocol import EditJob
from backend.protocol.keys import HEARTBEAT_PATTERN, WORKERS_KEY
from backend.worker.stats import percentile
from templates_store.samples import sample_template

PROMPT = "a red leather armchair"


@dataclass
class RealRouteConfig:
    policies: tuple[str, ...] = POLICIES
    workers: int = 2
    rps: float = 3.0
    duration_s: float = 30.0
    num_templates: int = 12
    mask_mean: float = 0.11
    steps: int = 20
    size: int = 128
    seed: int = 0
    timeout_s: float = 300.0


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _stack(settings: Settings, policy: str, workers: int):
    from backend.services.stack import Role, Stack

    roles = [
        Role("cpu-worker", ["cpu-worker"]),
        Role(f"dispatcher-{policy}", ["dispatcher", "--policy", policy]),
    ]
    roles += [
        Role(f"worker-{i}", ["worker", "--device", "cpu", "--worker-id", f"w{i}"])
        for i in range(workers)
    ]
    return Stack(settings, roles)


def _wait_for_workers(client, count: int, timeout_s: float = 180.0) -> None:
    deadline = time.time() + timeout_s
    while len(list(client.scan_iter(match=HEARTBEAT_PATTERN))) < count:
        if time.time() > deadline:
            raise RuntimeError(f"{count} engine workers did not start within {timeout_s:.0f} s")
        time.sleep(0.2)


def _submit_trace(cfg, app, jobstate, blobs, refs, trace, prefix: str) -> list[str]:
    from backend.tasks.celery_app import submit_edit

    template_refs, mask_refs = refs
    start, job_ids = time.time(), []
    for request in trace:
        time.sleep(max(0.0, start + request.arrival_s - time.time()))
        job = EditJob(
            job_id=f"{prefix}-{request.index}",
            model_id="tiny-sd2-inpaint",
            template_ref=template_refs[request.template],
            mask_ref=mask_refs[request.index],
            prompt=PROMPT,
            seed=request.seed,
            steps=cfg.steps,
            guidance=7.5,
            resolution=cfg.size,
            submitted_at=time.time(),
        )
        jobstate.create(job.job_id)
        submit_edit(app, job)
        job_ids.append(job.job_id)
    return job_ids


def _wait_done(jobstate, job_ids: list[str], timeout_s: float) -> list[dict]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        records = [jobstate.get(j) for j in job_ids]
        if all(r["status"] in TERMINAL for r in records):
            return records
        time.sleep(0.2)
    raise RuntimeError(f"jobs still running after {timeout_s:.0f} s")


def run_real_route_bench(cfg: RealRouteConfig, settings: Settings, progress=print) -> dict:
    from redis import Redis

    from backend.services.redis_server import connect_or_start
    from backend.tasks.celery_app import make_celery

    url, server = connect_or_start(settings.redis.url, settings.paths.data_dir)
    settings = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": url})})
    client, blobs = Redis.from_url(url), open_blob_store(settings)
    jobstate, app = JobStateStore(client), make_celery(settings)
    trace = poisson_trace(cfg.rps, cfg.duration_s, cfg.num_templates, cfg.mask_mean, seed=cfg.seed)
    refs = (
        [
            blobs.put(
                "uploads",
                f"route-t{i}.png",
                _png(sample_template(cfg.size, cfg.size, seed=500 + i)),
            )
            for i in range(cfg.num_templates)
        ],
        [
            blobs.put(
                "uploads",
                f"route-m{r.index}.png",
                _png(
                    Image.fromarray(
                        synthetic_mask(cfg.size, cfg.size, r.mask_ratio, seed=r.seed).astype(
                            np.uint8
                        )
                        * 255
                    )
                ),
            )
            for r in trace
        ],
    )
    results = {}
    try:
        for policy in ("warm-up",) + tuple(cfg.policies):
            stack = _stack(settings, "round_robin" if policy == "warm-up" else policy, cfg.workers)
            stack.start()
            try:
                _wait_for_workers(client, cfg.workers)
                jobs = (
                    trace
                    if policy != "warm-up"
                    else [r for r in trace if r.index < cfg.num_templates * 2]
                )
                job_ids = _submit_trace(
                    cfg, app, jobstate, blobs, refs, jobs, f"{policy}-{int(time.time())}"
                )
                records = _wait_done(jobstate, job_ids, cfg.timeout_s)
            finally:
                stack.stop()
                client.delete(*client.keys(HEARTBEAT_PATTERN), WORKERS_KEY)
            if policy == "warm-up":
                continue
            latencies = [r["done_at"] - r["queued_at"] for r in records if r["status"] == "done"]
            results[policy] = {
                "jobs": len(records),
                "done": len(latencies),
                "avg_s": float(np.mean(latencies)),
                "p50_s": percentile(latencies, 50),
                "p95_s": percentile(latencies, 95),
            }
            progress(
                f"{policy:16s} P95 {results[policy]['p95_s']:.2f} s  "
                f"avg {results[policy]['avg_s']:.2f} s  "
                f"{results[policy]['done']}/{results[policy]['jobs']} done"
            )
    finally:
        client.close()
        if server is not None:
            server.stop()
    return {"config": asdict(cfg), "results": results}


def write_real_outputs(report: dict, json_path: Path) -> None:
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))

"""Cache status of a gallery template per model: not prepared, preparing, in RAM or on disk.

Pre-processing knows a template's cache digest (it depends on the bucketed pixels, the model, the
resolution, steps, scheduler, strength and cache mode), so it records the digest under
``keys.template_cache_key`` (field = model id) for every job that names a gallery template,
and the API records the id of a prepare job there too (field = ``prepare:<model id>``). Status is
then read from the live workers' heartbeats (which list the digests each holds in RAM and on disk)
and from the prepare job's state (between the job's end and the next heartbeat, the job's worker
is taken to hold it); nothing is ever computed from a model here.
"""

from __future__ import annotations

from redis import Redis

from backend.jobstate import TERMINAL, JobNotFound, JobStateStore
from backend.protocol import to_text
from backend.protocol.heartbeats import live_heartbeats
from backend.protocol.keys import template_cache_key

STATUSES = ("not prepared", "preparing", "on disk", "in RAM")


def record_digest(client: Redis, template_id: str, model_id: str, digest: str) -> None:
    if template_id and digest:
        client.hset(template_cache_key(template_id), model_id, digest)


def record_prepare_job(client: Redis, template_id: str, model_id: str, job_id: str) -> None:
    client.hset(template_cache_key(template_id), f"prepare:{model_id}", job_id)


def cache_status(client: Redis, template_id: str, model_id: str) -> dict:
    """``{"model", "status", "digest", "workers"}``: the best tier any live worker holds the cache
    in (``workers``: the ids of those holding it), else what the template's prepare job says
    (``_prepare_job_view``), else ``not prepared``."""

    stored = {
        to_text(k): to_text(v) for k, v in client.hgetall(template_cache_key(template_id)).items()
    }
    digest = stored.get(model_id, "")
    beats = {
        worker_id: beat
        for worker_id, beat in live_heartbeats(client).items()
        if beat.model_id == model_id
    }
    in_ram, on_disk = [], []
    for worker_id, beat in sorted(beats.items()) if digest else ():
        if digest in beat.resident_ram:
            in_ram.append(worker_id)
        elif digest in beat.resident_disk:
            on_disk.append(worker_id)
    if in_ram or on_disk:
        status, workers = ("in RAM" if in_ram else "on disk"), in_ram + on_disk
    else:
        status, workers = _prepare_job_view(client, stored.get(f"prepare:{model_id}", ""), beats)
    return {"model": model_id, "status": status, "digest": digest, "workers": workers}


def _prepare_job_view(client: Redis, job_id: str, beats: dict) -> tuple[str, list[str]]:
    """(status, workers) from the prepare job while no heartbeat lists the cache: ``preparing``
    while it runs; ``in RAM`` on its worker when it was done after that worker's last heartbeat (a
    recording lands in RAM, and the heartbeat that lists it has not been sent yet); else ``not
    prepared`` (a heartbeat sent since the job was done does not list it: it was evicted)."""
    if not job_id:
        return "not prepared", []
    try:
        record = JobStateStore(client).record(job_id)
    except JobNotFound:
        return "not prepared", []
    if record.status not in TERMINAL:
        return "preparing", []
    done_at = record.reached_at.get("done")
    beat = beats.get(record.worker_id)
    if record.status == "done" and done_at is not None and beat is not None and beat.at <= done_at:
        return "in RAM", [record.worker_id]
    return "not prepared", []


def forget(client: Redis, template_id: str) -> None:
    client.delete(template_cache_key(template_id))

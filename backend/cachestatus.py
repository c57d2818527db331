"""Cache status of a gallery template per model: not prepared, preparing, in RAM or on disk.

Pre-processing knows a template's cache digest (it depends on the bucketed pixels, the model, the
resolution, steps, scheduler, strength and cache mode), so it records the digest under
``keys.template_cache_key`` (field = model id) for every job that names a gallery template,
and the API records the id of a prepare job there too (field = ``prepare:<model id>``). Status is
then read from the live workers' heartbeats (which list the digests each holds in RAM and on disk)
and from the prepare job's state; nothing is ever computed from a model here.
"""

from __future__ import annotations

from redis import Redis

from backend.jobstate import TERMINAL, JobStateStore
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
    in (``workers``: the ids of those holding it), else ``preparing`` while a prepare job runs, else
    ``not prepared``."""

    stored = {
        to_text(k): to_text(v) for k, v in client.hgetall(template_cache_key(template_id)).items()
    }
    digest = stored.get(model_id, "")
    in_ram, on_disk = [], []
    if digest:
        for worker_id, beat in sorted(live_heartbeats(client).items()):
            if beat.model_id != model_id:
                continue
            if digest in beat.resident_ram:
                in_ram.append(worker_id)
            elif digest in beat.resident_disk:
                on_disk.append(worker_id)
    if in_ram or on_disk:
        status = "in RAM" if in_ram else "on disk"
    else:
        prepare_job = stored.get(f"prepare:{model_id}")
        running = prepare_job and JobStateStore(client).status(prepare_job) not in (None, *TERMINAL)
        status = "preparing" if running else "not prepared"
    return {"model": model_id, "status": status, "digest": digest, "workers": in_ram + on_disk}


def forget(client: Redis, template_id: str) -> None:
    client.delete(template_cache_key(template_id))

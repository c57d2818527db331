"""Cache status of a gallery template for given settings: not prepared, preparing, on disk, in RAM,
on device.

The status follows content, never "the last job": the template's cache key for the settings asked
about (``KeySettings``) is built the way pre-processing builds a job's
(``backend.cache.key.template_key``: the template's pixels at the model resolution, the settings,
and what the loaded model contributes, ``ModelKeyBasis``). The CPU stages publish that basis under
``keys.cache_key_basis_key`` when they load a model and with every job they pre-process (only a
process that loaded the model knows its revision and scheduler); until one has, no key can be
built and no worker can be found holding the cache. The key's digest is looked up in the live
workers' heartbeats (which list the digests each holds on its device, in RAM and on disk), so a
template sees the cache of the same pixels uploaded under any name.

The API records the id of a prepare job under ``keys.template_cache_key`` (field
``prepare:<settings signature>``): while no heartbeat lists the cache, the status follows that job
(``_prepare_job_view``). No model library is imported here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace

from PIL import Image
from redis import Redis

from backend.cache.key import ModelKeyBasis, adapter_set, key_guidance, template_key
from backend.config import EngineSettings
from backend.imaging.uploads import fit_to_bucket, resolution_bucket
from backend.jobstate import TERMINAL, JobNotFound, JobStateStore
from backend.models.catalog import ModelSpec
from backend.protocol import to_text
from backend.protocol.heartbeats import live_heartbeats
from backend.protocol.keys import cache_key_basis_key, template_cache_key

log = logging.getLogger(__name__)

STATUSES = ("not prepared", "preparing", "on disk", "in RAM", "on device")
MAX_MEMO = 4096  # digests kept per process: a status poll decodes and resizes the template once


@dataclass(frozen=True)
class KeySettings:
    """What an edit chooses that enters its template's cache key, as pre-processing fills it in:
    the resolution bucket's side (the model's default for 0), steps, strength, guidance as the key
    holds it, and the deployment's template seed and cache mode."""

    model_id: str
    resolution: int
    steps: int
    strength: float
    guidance: float
    template_seed: int
    mode: str
    # the adapter set of a pinned cache (``backend.cache.key.adapter_set`` of (sha256, scale)
    # pairs, as the worker keys it); "" for the base model's cache
    adapters: str = ""

    @classmethod
    def of(
        cls,
        spec: ModelSpec,
        engine: EngineSettings,
        steps: int | None = None,
        resolution: int = 0,
        strength: float = 1.0,
        guidance: float | None = None,
        adapters: Iterable[tuple[str, float]] = (),
    ) -> KeySettings:
        """The settings of a job on ``spec`` with these values (``None``/0: the model's
        defaults), as ``backend.engine.factory.edit_params`` completes them; ``adapters``: the
        (sha256, scale) pairs of a cache pinned to them."""
        return cls(
            model_id=spec.model_id,
            resolution=resolution or spec.default_resolution,
            steps=spec.default_steps if steps is None else steps,
            strength=strength,
            guidance=key_guidance(
                spec.uses_cfg, spec.default_guidance if guidance is None else guidance
            ),
            template_seed=engine.template_seed,
            mode=engine.cache_mode,
            adapters=adapter_set(adapters),
        )

    def signature(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def publish_key_basis(client: Redis, basis: ModelKeyBasis) -> None:
    client.set(cache_key_basis_key(basis.model_id), basis.to_json())


def key_basis(client: Redis, model_id: str) -> ModelKeyBasis | None:
    """The basis the CPU stages published for ``model_id``; None before any has (or unreadable)."""
    raw = client.get(cache_key_basis_key(model_id))
    if raw is None:
        return None
    try:
        return ModelKeyBasis.from_json(to_text(raw))
    except (ValueError, TypeError) as exc:
        log.warning("ignoring an unreadable cache key basis of %s: %s", model_id, exc)
        return None


_memo: OrderedDict[tuple[str, ModelKeyBasis, KeySettings], str] = OrderedDict()
_memo_lock = threading.Lock()


def template_digest(
    basis: ModelKeyBasis,
    settings: KeySettings,
    content_id: str,
    load: Callable[[], Image.Image],
) -> str:
    """The digest of the cache a job with ``settings`` reads on the template ``load`` returns (as
    pre-processing decodes it), bucketed as pre-processing buckets it. ``content_id`` names the
    template's content (immutable), so a digest is computed once per process."""
    memo_key = (content_id, basis, settings)
    with _memo_lock:
        if memo_key in _memo:
            _memo.move_to_end(memo_key)
            return _memo[memo_key]
    template = load()
    size = resolution_bucket(
        template.width, template.height, settings.resolution, basis.size_multiple
    )
    key = template_key(
        basis,
        fit_to_bucket(template, size),
        size,
        steps=settings.steps,
        strength=settings.strength,
        guidance=settings.guidance,
        template_seed=settings.template_seed,
        mode=settings.mode,
    )
    digest = replace(key, adapters=settings.adapters).digest()
    with _memo_lock:
        _memo[memo_key] = digest
        while len(_memo) > MAX_MEMO:
            _memo.popitem(last=False)
    return digest


def record_prepare_job(client: Redis, template_id: str, settings: KeySettings, job_id: str) -> None:
    client.hset(template_cache_key(template_id), f"prepare:{settings.signature()}", job_id)


def cache_status(
    client: Redis,
    template_id: str,
    settings: KeySettings,
    content_id: str,
    load: Callable[[], Image.Image],
) -> dict:
    """``{"model", "status", "digest", "workers", "settings"}`` for a job with ``settings`` on the
    template: the best tier any live worker holds its cache in (``workers``: the ids of those
    holding it), else what the template's prepare job with these settings says
    (``_prepare_job_view``), else ``not prepared``. ``digest`` is empty while no CPU stages of
    the model have published its key basis. ``content_id`` and ``load``: see ``template_digest``."""
    basis = key_basis(client, settings.model_id)
    digest = template_digest(basis, settings, content_id, load) if basis is not None else ""
    beats = {
        worker_id: beat
        for worker_id, beat in live_heartbeats(client).items()
        if beat.model_id == settings.model_id
    }
    # status -> the workers whose fastest tier holding the cache is that one, fastest first
    held: dict[str, list[str]] = {"on device": [], "in RAM": [], "on disk": []}
    for worker_id, beat in sorted(beats.items()) if digest else ():
        for status, tier in (
            ("on device", beat.resident_device),
            ("in RAM", beat.resident_ram),
            ("on disk", beat.resident_disk),
        ):
            if digest in tier:
                held[status].append(worker_id)
                break
    if any(held.values()):
        status = next(status for status, workers in held.items() if workers)
        workers = [worker_id for holders in held.values() for worker_id in holders]
    else:
        job_id = client.hget(template_cache_key(template_id), f"prepare:{settings.signature()}")
        status, workers = _prepare_job_view(client, to_text(job_id) if job_id else "", beats)
    return {
        "model": settings.model_id,
        "status": status,
        "digest": digest,
        "workers": workers,
        "settings": {
            "resolution": settings.resolution,
            "steps": settings.steps,
            "strength": settings.strength,
        },
    }


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

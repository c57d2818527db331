"""A batch's items through the real stages on the tiny model: submitted over REST, pre-processed,
routed by the dispatcher (round robin, which would spread them) to one worker by their batch id,
where they read the template's cache once and run in the same forward batch."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from backend.api.app import create_app
from backend.cache import TieredActivationCache
from backend.cache.manager import Tier
from backend.config import load_settings
from backend.dispatch.service import Dispatcher
from backend.engine.cache_store import TemplateCache
from backend.tasks.core import CpuStages
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from tests.factories import make_engine
from tests.test_api import IMAGE, KEY, mask_png, pre_queue_jobs
from tests.test_dispatcher import beat, inbox_jobs

pytestmark = [pytest.mark.model, pytest.mark.redis, pytest.mark.slow]

STEPS = 4
ITEMS = 3


def run_until_idle(worker: EngineWorker, limit: int = 100) -> None:
    for _ in range(limit):
        if not worker.iterate():
            worker.caches.wait_for_loads(10)  # rows wait for their cache's read to land
        if worker.scheduler.idle:
            return
    raise AssertionError("the worker did not drain its queue")


def test_a_batchs_items_share_one_worker_one_cache_read_and_one_forward_batch(
    models_dir, redis_url, redis_client, tmp_path
):
    settings = load_settings(
        env={"MASKSERVE_API_KEYS": KEY},
        paths={"data_dir": str(tmp_path / "data"), "models_dir": str(models_dir)},
        redis={"url": redis_url},
        engine={"model_id": "tiny-sd2-inpaint"},
        dispatcher={"policy": "round_robin"},
        api={"write_rate_per_minute": 0, "read_rate_per_minute": 0},
    )
    app = create_app(settings, redis_client=redis_client)
    engine = make_engine("sd2-inpaint", models_dir, tmp_path / "cache")
    service = app.state.service
    stages = CpuStages(settings, engine, service.jobstate, service.blobs)
    with TestClient(app, headers={"X-API-Key": KEY}) as client:
        template_id = client.post(
            "/v1/templates", files={"file": ("t.png", IMAGE, "image/png")}
        ).json()["id"]
        # the template's cache, recorded once by a worker that then goes away
        client.post(f"/v1/templates/{template_id}/prepare", data={"steps": STEPS})
        (prepare,) = pre_queue_jobs(redis_client, settings)
        recorder = EngineWorker(
            engine, service.blobs, LocalInbox(), LocalSink(), caches=_caches(engine)
        )
        recorder.inbox.put(stages.preprocess(prepare))
        run_until_idle(recorder)
        recorder.caches.close()
        masks = [mask_png(box=(8 * i, 4, 8 * i + 16, 24)) for i in range(ITEMS)]
        answer = client.post(
            "/v1/batches",
            data={"template_id": template_id, "prompt": "a red chair", "steps": STEPS},
            files=[("masks", (f"{i}.png", m, "image/png")) for i, m in enumerate(masks)],
        )
    assert answer.status_code == 202, answer.text
    batch_id = answer.json()["batch_id"]
    edits = [job for job in pre_queue_jobs(redis_client, settings) if job.batch_id == batch_id]
    prepared = [stages.preprocess(job) for job in edits]
    assert {p.batch_id for p in prepared} == {batch_id}
    assert len({p.cache_digest for p in prepared}) == 1 and prepared[0].cache_digest

    # two idle workers and a round-robin dispatcher: the batch id keeps the items together
    for worker_id in ("w0", "w1"):
        beat(redis_client, worker_id)
    dispatcher = Dispatcher(settings, redis_client, consumer="d")
    dispatcher.refresh_workers()
    homes = {dispatcher.place(p) for p in prepared}
    assert len(homes) == 1
    (home,) = homes
    assert sorted(inbox_jobs(redis_client, home)) == sorted(p.job_id for p in prepared)

    # that worker starts with the cache on its disk only: one read, then one batch of three rows
    worker = EngineWorker(engine, service.blobs, LocalInbox(), LocalSink(), caches=_caches(engine))
    for job in prepared:
        worker.inbox.put(job)
    run_until_idle(worker)
    assert [j.used_cache for j in worker.sink.denoised_jobs] == [True] * ITEMS
    stats = worker.stats.snapshot()
    assert stats["max_batch_rows"] == ITEMS and stats["steps"] == STEPS  # every step: all three
    metrics = worker.caches.metrics
    (entry,) = worker.caches.resident(Tier.RAM)
    assert entry == prepared[0].cache_digest
    size = TemplateCache.open(worker.caches.root / entry).bytes_total
    assert metrics.bytes_loaded == size  # read from disk once for all three
    worker.caches.close()


def _caches(engine) -> TieredActivationCache:
    return TieredActivationCache(engine.cache_root, 1 << 30, 1 << 32)

"""Edit requests that name LoRA adapters: the API's checks (4xx, nothing stored), what travels with
the job, and one job end to end through a real CPU worker process and the engine worker with
its adapter tiers over the registry."""

from __future__ import annotations

import argparse
import json
import time

import pytest
from fastapi.testclient import TestClient

from backend.api.app import create_app
from backend.blobs import BlobStore
from backend.client import MaskServeClient, adapter_choice, add_submit_arguments, submit_cli
from backend.protocol import AdapterUse
from backend.worker.adapter_tiers import worker_adapters
from backend.worker.channels import LocalInbox
from backend.worker.loop import EngineWorker
from backend.worker.service import RedisSink
from tests.adapter_factory import make_adapter_file
from tests.api_factory import IMAGE, KEY, MASK, OTHER_KEY, pre_queue_jobs, submit
from tests.test_adapters_api import (  # noqa: F401 (fixtures)
    MODEL,
    client,
    served,
    settings,
    upload,
    worker,
)
from tests.test_celery_tasks import engine, handed_off, stack, wait_for  # noqa: F401

pytestmark = [pytest.mark.model, pytest.mark.redis]


@pytest.fixture
def adapters(client, worker, tmp_path):  # noqa: F811
    """(an SD2 adapter's record, a Flux adapter's record), uploaded through the API."""
    sd2 = make_adapter_file(MODEL, tmp_path / "sd2.safetensors", seed=1).read_bytes()
    flux = make_adapter_file("tiny-flux-fill", tmp_path / "flux.safetensors", seed=2).read_bytes()
    made = upload(client, sd2).json(), upload(client, flux, model="tiny-flux-fill").json()
    assert all("adapter_id" in record for record in made), made
    worker.stop.set()  # it takes every task off the pre queue: jobs must stay there
    worker.thread.join(timeout=5)
    return made


def with_adapters(choices) -> str:
    return json.dumps([{"id": i, "scale": s} for i, s in choices])


def test_a_job_carries_its_adapters_to_pre_processing(client, adapters, redis_client, settings):  # noqa: F811
    sd2, _ = adapters
    accepted = submit(client, adapters=with_adapters([(sd2["adapter_id"], 0.8)]))
    assert accepted.status_code == 202, accepted.text
    (job,) = pre_queue_jobs(redis_client, settings)
    assert job.adapters == [AdapterUse(sd2["adapter_id"], sd2["sha256"], 0.8, sd2["nbytes"])]
    shown = client.get(f"/v1/jobs/{accepted.json()['job_id']}").json()
    assert shown["adapters"] == [{"id": sd2["adapter_id"], "scale": 0.8}]
    assert shown["adapter_steps"] == {}


def refusals(sd2: dict, flux: dict) -> list[tuple[str, str]]:
    a, f = sd2["adapter_id"], flux["adapter_id"]
    return [
        (with_adapters([(a, 1.0), ("1" * 32, 1.0), ("2" * 32, 1.0), ("3" * 32, 1.0)]), "at most 3"),
        (with_adapters([(a, 1.0), (a, 0.5)]), "more than once"),
        (with_adapters([(a, 2.5)]), "use a value in [-2.0, 2.0]"),
        (json.dumps([{"id": a, "scale": "strong"}]), "must be a number"),
        (json.dumps([{"id": a, "weight": 1}]), "unknown adapter fields weight"),
        (json.dumps({"id": a}), "must be a JSON list"),
        ("[{", "adapters is not JSON"),
        (with_adapters([("f" * 32, 1.0)]), "does not exist"),
        (with_adapters([(f, 1.0)]), "was registered for tiny-flux-fill"),
    ]


def test_bad_adapters_are_4xx_saying_what_to_fix_and_store_nothing(
    client,  # noqa: F811
    adapters,
    redis_client,
    settings,  # noqa: F811
):
    uploads = settings.paths.data_dir / "blobs" / "uploads"
    before = sorted(uploads.iterdir()) if uploads.exists() else []
    for field, message in refusals(*adapters):
        refused = submit(client, adapters=field)
        assert refused.status_code == 422, (field, refused.text)
        assert message in refused.json()["error"], (field, refused.json())
    erase = submit(client, mode="erase", adapters=with_adapters([(adapters[0]["adapter_id"], 1)]))
    assert erase.status_code == 422 and "no adapters" in erase.json()["error"]
    assert pre_queue_jobs(redis_client, settings) == []
    assert (sorted(uploads.iterdir()) if uploads.exists() else []) == before


def test_another_tenants_adapter_does_not_exist_for_you(client, adapters):  # noqa: F811
    sd2, _ = adapters
    refused = client.post(
        "/v1/jobs",
        headers={"X-API-Key": OTHER_KEY},
        data={"prompt": "x", "adapters": with_adapters([(sd2["adapter_id"], 1.0)])},
        files={"image": ("i.png", IMAGE, "image/png"), "mask": ("m.png", MASK, "image/png")},
    )
    assert refused.status_code == 422 and "does not exist" in refused.json()["error"]


def test_the_cli_reads_adapter_choices():
    assert adapter_choice("abc") == ("abc", 1.0)
    assert adapter_choice("abc:0.25") == ("abc", 0.25)
    with pytest.raises(Exception, match="ID:SCALE"):
        adapter_choice("abc:strong")


def test_a_job_with_an_adapter_runs_end_to_end(stack, engine, tmp_path):  # noqa: F811
    stack_settings, app, jobstate, redis = stack
    api_settings = stack_settings.model_copy(
        update={
            "api": stack_settings.api.model_copy(
                update={"api_keys": (KEY,), "read_rate_per_minute": 0, "write_rate_per_minute": 0}
            )
        }
    )
    log = tmp_path / "cpu-worker.log"
    with TestClient(
        create_app(api_settings, redis_client=redis), headers={"X-API-Key": KEY}
    ) as api:
        data = make_adapter_file(MODEL, tmp_path / "a.safetensors", seed=3).read_bytes()
        record = upload(api, data).json()  # ingested by the cpu-worker process
        assert "adapter_id" in record, record
        accepted = submit(api, adapters=with_adapters([(record["adapter_id"], 0.9)]))
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["job_id"]
        (prepared,) = wait_for(lambda: handed_off(redis), "the pre-processed job", log)
        use = AdapterUse(record["adapter_id"], record["sha256"], 0.9, record["nbytes"])
        assert prepared.adapters == [use]
        blobs = BlobStore(stack_settings.paths.data_dir / "blobs")
        inbox = LocalInbox()
        rows = worker_adapters(stack_settings, engine)
        worker = EngineWorker(
            engine, blobs, inbox, RedisSink(jobstate, app, stack_settings), adapters=rows
        )
        inbox.put(prepared)
        started = time.time()
        while not inbox.acked and time.time() - started < 60:
            worker.iterate()
        wait_for(lambda: jobstate.status(job_id) == "done", "the job to finish", log)
        shown = api.get(f"/v1/jobs/{job_id}").json()
    # the adapter joined by its deadline (20% of 4 steps: step 1)
    assert set(shown["adapter_steps"]) == {record["adapter_id"]}
    assert shown["adapter_steps"][record["adapter_id"]] <= 1
    assert rows.tiers.book.counters.rows_with_adapters == 1
    assert not rows.tiers.book.pins


def test_a_template_cache_can_be_pinned_to_adapters(
    client,  # noqa: F811
    adapters,
    redis_client,
    settings,  # noqa: F811
    engine,  # noqa: F811
):
    """A prepare job with adapters records a cache pinned to them; the cache status asked with
    the same adapters follows that job and names the digest pre-processing gives it, apart from
    the base cache's."""
    from backend.jobstate import JobStateStore
    from backend.tasks.core import CpuStages

    sd2, flux = adapters
    pinned_set = with_adapters([(sd2["adapter_id"], 0.7)])
    template = client.post("/v1/templates", files={"file": ("room.png", IMAGE)}).json()
    url = f"/v1/templates/{template['id']}/prepare"
    pinned = client.post(url, data={"adapters": pinned_set})
    assert pinned.status_code == 202, pinned.text
    (job,) = pre_queue_jobs(redis_client, settings)
    assert job.prepare and job.adapters == [
        AdapterUse(sd2["adapter_id"], sd2["sha256"], 0.7, sd2["nbytes"])
    ]
    refused = client.post(url, data={"adapters": with_adapters([(flux["adapter_id"], 1.0)])})
    assert refused.status_code == 422 and "registered for tiny-flux-fill" in refused.text
    assert len(pre_queue_jobs(redis_client, settings)) == 1

    status_url = f"/v1/templates/{template['id']}/cache"
    pinned_status = client.get(pinned.json()["cache_url"]).json()
    assert pinned_status["status"] == "preparing"
    assert pinned_status["settings"]["adapters"] == [{"id": sd2["adapter_id"], "scale": 0.7}]
    assert client.get(status_url).json()["status"] == "not prepared"  # the base cache
    other_scale = with_adapters([(sd2["adapter_id"], 0.5)])
    assert client.get(status_url, params={"adapters": other_scale}).json()["status"] == (
        "not prepared"
    )
    wrong = client.get(status_url, params={"adapters": with_adapters([(flux["adapter_id"], 1)])})
    assert wrong.status_code == 422 and "registered for tiny-flux-fill" in wrong.text

    # pre-processing the prepare job publishes the key basis and gives the pinned digest
    prepared = CpuStages(settings, engine, JobStateStore(redis_client)).preprocess(job)
    digest = client.get(status_url, params={"adapters": pinned_set}).json()["digest"]
    assert digest == prepared.cache_digest
    assert digest != client.get(status_url).json()["digest"] != ""


def test_the_client_and_cli_name_adapters(served, adapters, redis_client, settings, tmp_path):  # noqa: F811
    sd2, _ = adapters
    with MaskServeClient(served, KEY) as api:
        api.submit(MASK, "a cat", image=IMAGE, adapters=[(sd2["adapter_id"], 0.6)])
        template = api.upload_template(IMAGE, name="room")
        api.prepare_template(template["id"], adapters=[(sd2["adapter_id"], 1.1)])
    (tmp_path / "image.png").write_bytes(IMAGE)
    (tmp_path / "mask.png").write_bytes(MASK)
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    argv = ["--image", str(tmp_path / "image.png"), "--mask", str(tmp_path / "mask.png")]
    argv += ["--prompt", "a dog", "--adapter", f"{sd2['adapter_id']}:0.9", "--no-wait"]
    argv += ["--url", served]
    assert submit_cli(parser.parse_args([*argv, "--api-key", KEY])) == 0
    jobs = pre_queue_jobs(redis_client, settings)
    assert sorted((job.prepare, [u.scale for u in job.adapters]) for job in jobs) == [
        (False, [0.6]),
        (False, [0.9]),
        (True, [1.1]),
    ]

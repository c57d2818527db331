"""Several hosts with nothing shared but Redis and an object store: every role its own process
with its own data directory and its own copy of the models, as if on its own host, configured only
with the Redis URL and ``MASKSERVE_BLOB_URL=s3://...`` (a real ``moto_server`` process). A gallery
template uploaded to the API and an edit of it submitted over REST finish on the other "hosts", and
the result downloads from the API; a LoRA adapter uploaded to the API is read by the CPU worker and
loaded by the engine worker; every blob, gallery and adapter file is in the bucket, none on a
disk."""

from __future__ import annotations

import shutil

import pytest

from backend.blobs.factory import s3_client
from backend.client import MaskServeClient
from backend.jobstate import JobStateStore
from templates_store.samples import sample_template
from tests.adapter_factory import make_adapter_file
from tests.factories import make_engine
from tests.s3_fixtures import s3_role_env
from tests.stack_factory import running_stack
from tests.test_cpu_stages import HEIGHT, WIDTH, assert_edited_inside_only, painted_mask, png
from tests.test_stack_e2e import diagnose, wait_for_workers

API_KEY = "multihost-key"
ROLES = ("cpu-worker", "dispatcher", "worker-0", "api")
MODEL = "tiny-sd2-inpaint"


@pytest.mark.slow
def test_roles_sharing_only_redis_and_an_object_store_finish_a_job(
    redis_url, redis_client, s3_bucket, models_dir, tmp_path, monkeypatch
):
    endpoint, bucket = s3_bucket
    make_engine("sd2-inpaint", models_dir, tmp_path / "warm")  # the models each host copies
    hosts = {role: tmp_path / "hosts" / role for role in ROLES}
    for host in hosts.values():
        shutil.copytree(models_dir, host / "models")
    role_env = {
        role: {
            "MASKSERVE_DATA_DIR": str(host / "data"),
            "MASKSERVE_MODELS_DIR": str(host / "models"),
        }
        for role, host in hosts.items()
    }
    env = {"MASKSERVE_API_KEYS": API_KEY, **s3_role_env(endpoint, bucket, "site")}
    with (
        running_stack(
            monkeypatch, tmp_path, redis_url, models_dir, ["w-remote"], env, role_env
        ) as (running, base),
        MaskServeClient(base, API_KEY) as client,
    ):
        wait_for_workers(redis_client, count=1)
        template = sample_template(WIDTH, HEIGHT, seed=31)
        record = client.upload_template(png(template), name="vase on a table")
        # staged in the bucket by the API, read by the CPU worker, loaded by the engine worker
        adapter_file = make_adapter_file(MODEL, tmp_path / "style.safetensors", seed=3)
        adapter = client.upload_adapter(adapter_file.read_bytes(), name="style")
        accepted = client.submit(
            png(painted_mask()),
            prompt="a blue vase",
            template_id=record["id"],
            steps=4,
            seed=7,
            resolution=128,
            adapters=[(adapter["adapter_id"], 0.7)],
        )
        jobstate = JobStateStore(redis_client)
        final = client.wait(accepted["job_id"], timeout=180)
        assert final["status"] == "done", diagnose(running, jobstate, accepted["job_id"])
        assert final["worker_id"] == "w-remote" and adapter["adapter_id"] in final["adapter_steps"]
        assert_edited_inside_only(client.result_bytes(accepted["job_id"]), template)
        assert client.result_bytes(accepted["job_id"], thumbnail=True)[8:12] == b"WEBP"

    stored = s3_client(endpoint, "").list_objects_v2(Bucket=bucket, Prefix="site/")
    keys = {item["Key"] for item in stored.get("Contents", ())}
    job_id = accepted["job_id"]
    assert {f"site/blobs/results/{job_id}.png", f"site/blobs/thumbnails/{job_id}.webp"} <= keys
    assert f"site/templates/records/{record['id']}.json" in keys
    assert f"site/adapters/records/{adapter['adapter_id']}.json" in keys
    for role, host in hosts.items():  # nothing was passed through any host's disk
        for area in ("blobs", "templates", "adapters"):
            assert not (host / "data" / area).exists(), (role, area)
    assert not (tmp_path / "data" / "blobs").exists()

"""The template gallery and the adapter registry with ``paths.blob_url`` on an object store: two
"hosts" (two settings trees with separate data directories) share them through a bucket on a
real ``moto_server`` process and a real Redis (their bookkeeping lock), nothing else. And an object
store that cannot answer is an error saying so (503 from the API), never a crash."""

from __future__ import annotations

import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from backend.adapters.store import AdapterFacts, AdapterNotFound, AdapterStore
from backend.api.app import create_app
from backend.blobs import BlobStoreUnavailable
from backend.blobs.factory import open_objects, s3_client
from backend.blobs.s3 import S3Objects
from backend.config import load_settings
from backend.services.redis_server import free_port
from templates_store.store import TemplateNotFound, TemplateStore
from tests.test_api import KEY, make_settings, submit

OWNER = "team-a"
FACTS = AdapterFacts("sd2-inpaint", "tiny-sd2-inpaint", "peft", {"attn1.to_q": 4}, 128)


@pytest.fixture
def hosts(tmp_path, redis_url, s3_bucket):
    endpoint, bucket = s3_bucket

    def host(name: str):
        return load_settings(
            {
                "MASKSERVE_BLOB_URL": f"s3://{bucket}/site",
                "MASKSERVE_S3_ENDPOINT_URL": endpoint,
                "MASKSERVE_REDIS_URL": redis_url,
                "MASKSERVE_DATA_DIR": str(tmp_path / name),
            }
        )

    return host("host-a"), host("host-b")


def gallery(settings) -> TemplateStore:
    return TemplateStore(open_objects(settings, "templates"), max_pixels=10**6, max_bytes=10**7)


def png(colour: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (48, 32), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_template_added_on_one_host_is_served_and_deleted_on_another(hosts, tmp_path):
    here, there = gallery(hosts[0]), gallery(hosts[1])
    record = here.add(png("red"), "red square", OWNER, ["catalogue"])
    twin = here.add(png("red"), "same pixels", OWNER)  # content shared by two records
    assert [r.id for r in there.list(OWNER, tag="catalogue")] == [record.id]
    assert there.get(record.id, OWNER) == record
    with Image.open(there.image_path(record.id, OWNER)) as image:
        assert image.size == (48, 32) and image.getpixel((0, 0)) == (255, 0, 0)
    assert there.image_path(record.id, OWNER).is_relative_to(tmp_path / "host-b")
    assert there.thumbnail_path(record.id, OWNER).stat().st_size > 0
    with pytest.raises(TemplateNotFound):
        there.get(record.id, "team-b")  # another owner's is not found, on every host

    there.delete(record.id, OWNER)
    with pytest.raises(TemplateNotFound):
        here.get(record.id, OWNER)
    assert here.image_path(twin.id, OWNER).exists()  # its twin still has the content
    here.delete(twin.id, OWNER)
    assert not [*here.objects.listing("content"), *here.objects.listing("thumbs")]


def test_an_adapter_registered_by_the_api_host_loads_on_a_worker_host(hosts, tmp_path):
    api, worker = (AdapterStore(open_objects(settings, "adapters")) for settings in hosts)
    normalized = tmp_path / "normalized.safetensors"
    normalized.write_bytes(b"normalized adapter bytes")
    record = api.add(normalized, FACTS, "pixel art", OWNER)
    local = worker.content_of(record.sha256)
    assert local.read_bytes() == b"normalized adapter bytes"
    assert local.is_relative_to(tmp_path / "host-b")  # the worker's own disk
    assert [r.adapter_id for r in worker.list(OWNER)] == [record.adapter_id]
    api.delete(record.adapter_id, OWNER)
    with pytest.raises(AdapterNotFound):
        worker.content_of(record.sha256)


def test_a_missing_bucket_or_a_dead_endpoint_is_unavailable_not_a_crash(s3_bucket, tmp_path):
    endpoint, _bucket = s3_bucket
    nowhere = S3Objects(s3_client(endpoint, ""), "no-such-bucket", "", tmp_path)
    with pytest.raises(BlobStoreUnavailable, match="NoSuchBucket"):
        nowhere.put("uploads/a.png", b"x")
    with pytest.raises(BlobStoreUnavailable, match="NoSuchBucket"):
        list(nowhere.listing("uploads"))
    dead = S3Objects(s3_client(f"http://127.0.0.1:{free_port()}", ""), "bucket", "", tmp_path)
    with pytest.raises(BlobStoreUnavailable, match="failed"):
        dead.get("uploads/a.png")


def test_the_api_answers_503_when_the_object_store_cannot_take_an_upload(
    redis_url, redis_client, s3_bucket, tmp_path
):
    endpoint, _bucket = s3_bucket
    settings = make_settings(redis_url, tmp_path)
    paths = settings.paths.model_copy(
        update={"blob_url": "s3://no-such-bucket/x", "s3_endpoint_url": endpoint}
    )
    studio_off = settings.studio.model_copy(update={"enabled": False})  # it lists at start
    settings = settings.model_copy(update={"paths": paths, "studio": studio_off})
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as client:
        answer = submit(client, mode="erase")
    assert answer.status_code == 503, answer.text
    assert "blob store is unavailable" in answer.json()["error"]
    assert not list(redis_client.scan_iter(match="maskserve:job:*"))  # no job was created

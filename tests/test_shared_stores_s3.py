"""The template gallery and the adapter registry with ``paths.blob_url`` on an object store: two
"hosts" (two settings trees with separate data directories) share them through a bucket on a
real ``moto_server`` process and a real Redis (their bookkeeping lock), nothing else."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from backend.adapters.store import AdapterFacts, AdapterNotFound, AdapterStore
from backend.blobs.factory import open_objects
from backend.config import load_settings
from templates_store.store import TemplateNotFound, TemplateStore

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

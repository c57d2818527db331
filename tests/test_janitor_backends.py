"""The blob janitor over both blob-store back ends (a local directory, and an S3 bucket on a real
``moto_server`` process), against a real Redis. An object store cannot be told a modification
time, so these tests write every blob now and sweep at a later ``now`` instead of ageing files;
the local-only tests (tests/test_blob_janitor.py) age files as well."""

from __future__ import annotations

import time

import pytest

import backend.janitor as janitor_module
from backend.blobs import BlobStore, LocalObjects
from backend.blobs.factory import s3_client
from backend.blobs.s3 import S3Objects
from backend.janitor import BlobJanitor
from backend.jobstate import JobStateStore
from backend.protocol import JobEvent
from backend.retention import RetentionPolicy

HOUR = 3600.0
POLICY = RetentionPolicy.from_hours(inputs_hours=24, results_hours=168)


@pytest.fixture(params=("local", "s3"))
def blobs(request, tmp_path) -> BlobStore:
    if request.param == "local":
        return BlobStore(LocalObjects(tmp_path / "blobs"))
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    return BlobStore(S3Objects(s3_client(endpoint, ""), bucket, "j/blobs/", tmp_path / "cache"))


def finished(store: JobStateStore, job_id: str, at: float, **refs) -> None:
    store.create(job_id, model_id="tiny-sd2-inpaint", **refs)
    store.record_event(
        JobEvent(
            job_id=job_id,
            status="done",
            at=at,
            result_ref=f"results/{job_id}.png",
            thumbnail_ref=f"thumbnails/{job_id}.webp",
        )
    )


def test_inputs_and_results_expire_after_their_own_retention(redis_client, blobs):
    store, written = JobStateStore(redis_client), time.time()
    for ref in (
        "uploads/done.img",
        "uploads/recent.img",
        "uploads/live.mask",
        "uploads/orphan.img",
        "results/done.png",
        "thumbnails/done.webp",
        "prepared/live.safetensors",
    ):
        kind, _, name = ref.partition("/")
        blobs.put(kind, name, b"x" * 50)
    finished(store, "done", written, template_ref="uploads/done.img")
    finished(store, "recent", written + 10 * HOUR, template_ref="uploads/recent.img")
    store.create("live", model_id="tiny-sd2-inpaint", mask_ref="uploads/live.mask")
    janitor = BlobJanitor(redis_client, blobs, POLICY)

    day_later = janitor.sweep(now=written + 30 * HOUR)
    assert dict(day_later.deleted) == {"uploads": 2}
    assert dict(day_later.bytes_freed) == {"uploads": 100}
    assert not blobs.exists("uploads/done.img") and not blobs.exists("uploads/orphan.img")
    assert blobs.exists("uploads/recent.img") and blobs.exists("results/done.png")

    week_later = janitor.sweep(now=written + 200 * HOUR)
    assert dict(week_later.deleted) == {"uploads": 1, "results": 1, "thumbnails": 1}
    # a job that has not finished keeps its blobs, whatever their age
    assert {blob.key for blob in blobs.files()} == {
        "uploads/live.mask",
        "prepared/live.safetensors",
    }


def test_a_blob_reused_during_the_sweep_is_kept(redis_client, blobs, monkeypatch):
    reused = blobs.put("uploads", "gallery.png", b"template")
    blobs.put("uploads", "unused.png", b"template")
    time.sleep(1.1)  # an object store's modification times are whole seconds
    real_job_records = janitor_module.job_records

    def records_while_a_job_is_submitted(client):
        blobs.touch(reused)
        return real_job_records(client)

    monkeypatch.setattr(janitor_module, "job_records", records_while_a_job_is_submitted)
    report = BlobJanitor(redis_client, blobs, POLICY).sweep(now=time.time() + 48 * HOUR)
    assert blobs.exists(reused) and report.kept_in_use == 1
    assert dict(report.deleted) == {"uploads": 1} and not blobs.exists("uploads/unused.png")

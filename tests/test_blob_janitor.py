"""The blob janitor against a real Redis (started by the tests) and real files: what a sweep deletes
and keeps, its Prometheus counters, its thread, and the API's 410 for an expired result."""

from __future__ import annotations

import os
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

import backend.janitor as janitor_module
from backend.api.app import create_app
from backend.api.middleware import ApiMetrics
from backend.blobs import BlobStore
from backend.config import load_settings
from backend.janitor import BlobJanitor, start_janitor
from backend.jobstate import JobStateStore
from backend.protocol import JobEvent
from backend.protocol.keys import JANITOR_LOCK_KEY as LOCK_KEY
from backend.retention import RetentionPolicy
from tests.test_api import IMAGE, KEY, MASK, make_settings, submit

HOUR = 3600.0
POLICY = RetentionPolicy.from_hours(inputs_hours=24, results_hours=168)


def aged(blobs: BlobStore, ref: str, hours: float, data: bytes = b"x" * 100) -> str:
    """Write ``ref`` as if it was last written ``hours`` ago."""
    kind, _, name = ref.partition("/")
    blobs.put(kind, name, data)
    then = time.time() - hours * HOUR
    os.utime(blobs.local_path(ref), (then, then))
    return ref


def make_job(store: JobStateStore, job_id: str, finished_h_ago: float | None, **refs) -> None:
    store.create(job_id, model_id="tiny-sd2-inpaint", **refs)
    if finished_h_ago is not None:
        store.record_event(
            JobEvent(
                job_id=job_id,
                status="done",
                at=time.time() - finished_h_ago * HOUR,
                result_ref=f"results/{job_id}.png",
                thumbnail_ref=f"thumbnails/{job_id}.webp",
            )
        )


@pytest.fixture
def blobs(tmp_path):
    return BlobStore(tmp_path / "blobs")


def test_a_sweep_deletes_expired_blobs_only_and_counts_them(redis_client, blobs):
    store = JobStateStore(redis_client)
    make_job(
        store,
        "old",
        200,
        template_ref=aged(blobs, "uploads/old.img", 201),
        mask_ref="uploads/old.mask",
    )
    make_job(
        store,
        "day",
        30,
        template_ref=aged(blobs, "uploads/shared.img", 31),
        mask_ref="uploads/day.mask",
    )
    make_job(
        store,
        "live",
        None,
        template_ref="uploads/shared.img",
        mask_ref=aged(blobs, "uploads/live.mask", 48),
    )
    for job_id, age in (("old", 201), ("day", 31)):
        for ref in (
            f"uploads/{job_id}.mask",
            f"masks/{job_id}-processed.png",
            f"results/{job_id}.png",
            f"thumbnails/{job_id}.webp",
        ):
            aged(blobs, ref, age)
    aged(blobs, "prepared/live.safetensors", 48)  # a running job's intermediates
    aged(blobs, "uploads/orphan.img", 25)  # its job's record expired
    aged(blobs, "uploads/fresh.img", 0)  # its job is being created

    report = BlobJanitor(redis_client, blobs, POLICY).sweep()

    left = {blob.key for blob in blobs.files()}
    assert left == {
        "uploads/shared.img",
        "uploads/live.mask",
        "prepared/live.safetensors",
        "uploads/fresh.img",
        "results/day.png",
        "thumbnails/day.webp",
    }
    assert dict(report.deleted) == {"uploads": 4, "masks": 2, "results": 1, "thumbnails": 1}
    assert dict(report.bytes_freed) == {
        "uploads": 400,
        "masks": 200,
        "results": 100,
        "thumbnails": 100,
    }
    metrics = ApiMetrics()
    metrics.record_sweep(report)
    text = generate_latest(metrics.registry).decode()
    assert 'maskserve_blobs_deleted_total{kind="uploads"} 4.0' in text
    assert 'maskserve_blob_bytes_freed_total{kind="masks"} 200.0' in text
    assert BlobJanitor(redis_client, blobs, POLICY).sweep().deleted == {}  # nothing left to do


def test_a_blob_reused_during_the_sweep_is_kept(redis_client, blobs, monkeypatch):
    """A submission that reuses an upload between the listing and the deletion (it rewrites or
    touches the file) keeps it, even before its job record exists."""
    reused = aged(blobs, "uploads/gallery.png", 100)
    real_job_records = janitor_module.job_records

    def records_while_a_job_is_submitted(client):
        blobs.touch(reused)
        return real_job_records(client)

    monkeypatch.setattr(janitor_module, "job_records", records_while_a_job_is_submitted)
    report = BlobJanitor(redis_client, blobs, POLICY).sweep()
    assert blobs.exists(reused) and report.kept_in_use == 1 and report.deleted == {}


def test_the_janitor_thread_sweeps_and_reports(redis_url, redis_client, tmp_path, blobs):
    settings = load_settings(
        {"MASKSERVE_REDIS_URL": redis_url, "MASKSERVE_DATA_DIR": str(tmp_path)},
        retention={"sweep_every_s": 0.2},
    )
    expired = aged(blobs, "uploads/orphan.img", 25)
    reports = []
    stop = start_janitor(settings, redis_client, blobs, reports.append)
    try:
        deadline = time.monotonic() + 10
        while blobs.exists(expired) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
    assert not blobs.exists(expired) and reports[0].deleted == {"uploads": 1}
    assert redis_client.exists(LOCK_KEY)  # one sweep per period across API processes
    keep_forever = load_settings(
        {"MASKSERVE_INPUT_RETENTION_HOURS": "0", "MASKSERVE_RESULT_RETENTION_HOURS": "0"}
    )
    assert start_janitor(keep_forever, redis_client, blobs) is None


def test_expired_result_is_410_saying_when_it_expired_and_queued_uploads_are_kept(
    redis_url, redis_client, tmp_path
):
    settings = make_settings(redis_url, tmp_path)
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as client:
        blobs = client.app.state.service.blobs
        queued, finished = submit(client).json()["job_id"], submit(client).json()["job_id"]
        store = JobStateStore(redis_client)
        store.record_event(
            JobEvent(
                job_id=finished,
                status="done",
                at=time.time() - 170 * HOUR,
                result_ref=aged(blobs, f"results/{finished}.png", 170, IMAGE),
                thumbnail_ref=aged(blobs, f"thumbnails/{finished}.webp", 170),
            )
        )
        uploads = {store.get(queued)["template_ref"], store.get(queued)["mask_ref"]}
        for ref in uploads:  # the queued job has waited two days: its uploads stay all the same
            then = time.time() - 48 * HOUR
            os.utime(blobs.local_path(ref), (then, then))
        assert client.get(f"/v1/jobs/{finished}/result").status_code == 200

        report = BlobJanitor(redis_client, blobs, POLICY).sweep()

        assert report.deleted == {"results": 1, "thumbnails": 1} and all(
            blobs.exists(ref) for ref in uploads
        )
        for params in ({}, {"thumbnail": 1}):
            gone = client.get(f"/v1/jobs/{finished}/result", params=params)
            assert gone.status_code == 410, gone.text
            assert (
                "expired: results are kept 168 hours after their job finishes"
                in gone.json()["error"]
            )
            assert "finished 170.0 hours ago" in gone.json()["error"]
        # the record outlives the blobs
        assert client.get(f"/v1/jobs/{finished}").json()["status"] == "done"


def test_a_gallery_template_reused_by_a_new_job_starts_its_retention_again(
    redis_url, redis_client, tmp_path
):
    settings = make_settings(redis_url, tmp_path)
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as client:
        template_id = client.post(
            "/v1/templates", files={"file": ("t.png", IMAGE)}, data={"name": "t"}
        ).json()["id"]
        files = {"mask": ("m.png", MASK, "image/png")}
        first = submit(client, files=files, template_id=template_id).json()["job_id"]
        store = JobStateStore(redis_client)
        ref = store.get(first)["template_ref"]
        store.record_event(JobEvent(job_id=first, status="done", at=time.time() - 48 * HOUR))
        blobs = client.app.state.service.blobs
        then = time.time() - 48 * HOUR
        os.utime(blobs.local_path(ref), (then, then))
        # the template copy
        assert BlobJanitor(redis_client, blobs, POLICY).sweep().deleted == {"uploads": 1}
        # copied again
        assert submit(client, files=files, template_id=template_id).status_code == 202
        assert blobs.exists(ref)
        os.utime(blobs.local_path(ref), (then, then))
        # reused: touched
        assert submit(client, files=files, template_id=template_id).status_code == 202
        assert time.time() - blobs.local_path(ref).stat().st_mtime < 60

"""The janitor's pure decision: which blobs have expired, given job records and now."""

from __future__ import annotations

import pytest

from backend.blobs import job_blob_refs
from backend.retention import BlobFile, JobRecord, RetentionPolicy, expired_blobs

HOUR = 3600.0
NOW = 1_000_000_000.0
POLICY = RetentionPolicy.from_hours(inputs_hours=24, results_hours=168)


def blob(ref: str, age_h: float, size: int = 10) -> BlobFile:
    return BlobFile(ref, size, NOW - age_h * HOUR)


def job(job_id: str, *refs: str, finished_h_ago: float | None) -> JobRecord:
    finished_at = None if finished_h_ago is None else NOW - finished_h_ago * HOUR
    return JobRecord(job_id, job_blob_refs(job_id) | frozenset(refs), finished_at)


def expired(blobs, jobs, policy=POLICY) -> set[str]:
    return {b.ref for b in expired_blobs(blobs, jobs, NOW, policy)}


@pytest.mark.parametrize(
    "finished_h_ago, gone",
    [
        (23, set()),
        (30, {"uploads/t.img", "uploads/m.mask", "masks/j1-processed.png"}),
        (
            200,
            {
                "uploads/t.img",
                "uploads/m.mask",
                "masks/j1-processed.png",
                "results/j1.png",
                "thumbnails/j1.webp",
            },
        ),
    ],
)
def test_a_finished_job_s_inputs_go_after_a_day_its_result_after_a_week(finished_h_ago, gone):
    written = finished_h_ago + 0.1  # a job's blobs are written before it finishes
    blobs = [
        blob(ref, written)
        for ref in (
            "uploads/t.img",
            "uploads/m.mask",
            "masks/j1-processed.png",
            "results/j1.png",
            "thumbnails/j1.webp",
        )
    ]
    assert (
        expired(
            blobs, [job("j1", "uploads/t.img", "uploads/m.mask", finished_h_ago=finished_h_ago)]
        )
        == gone
    )


@pytest.mark.parametrize("age_h", [25, 500, 10_000])
def test_a_job_that_has_not_finished_keeps_every_blob_it_references_whatever_their_age(age_h):
    blobs = [
        blob(ref, age_h)
        for ref in ("uploads/t.img", "prepared/j2.safetensors", "latents/j2.safetensors")
    ]
    assert expired(blobs, [job("j2", "uploads/t.img", finished_h_ago=None)]) == set()
    assert expired(blobs, [job("j2", "uploads/t.img", finished_h_ago=age_h)]) == {
        b.ref for b in blobs
    }


def test_a_shared_upload_lives_until_its_last_job_is_over_and_its_retention_has_passed():
    shared = [blob("uploads/gallery.png", 100)]
    old, recent, live = (
        job("a", "uploads/gallery.png", finished_h_ago=100),
        job("b", "uploads/gallery.png", finished_h_ago=2),
        job("c", "uploads/gallery.png", finished_h_ago=None),
    )
    assert expired(shared, [old]) == {"uploads/gallery.png"}
    assert expired(shared, [old, recent]) == set()  # b finished 2 h ago: a day from then
    assert expired(shared, [old, live]) == set()


def test_last_use_counts_from_a_write_or_touch_after_the_job_finished():
    reused = [blob("uploads/gallery.png", 1)]  # touched an hour ago by a new submission
    assert expired(reused, [job("a", "uploads/gallery.png", finished_h_ago=100)]) == set()


def test_a_blob_no_job_references_is_judged_by_its_age():
    blobs = [
        blob("uploads/orphan.img", 25),
        blob("uploads/new.img", 0.001),
        blob("results/gone-job.png", 169),
    ]
    assert expired(blobs, []) == {"uploads/orphan.img", "results/gone-job.png"}


def test_the_period_is_inclusive_at_its_end():
    assert expired([blob("uploads/x.img", 24)], []) == {"uploads/x.img"}
    assert expired([blob("uploads/x.img", 23.99)], []) == set()


def test_zero_keeps_a_kind_forever():
    blobs = [
        blob("uploads/t.img", 10_000),
        blob("results/j.png", 10_000),
        blob("thumbnails/j.webp", 10_000),
    ]
    finished = [job("j", "uploads/t.img", finished_h_ago=10_000)]
    assert expired(blobs, finished, RetentionPolicy.from_hours(24, 0)) == {"uploads/t.img"}
    assert expired(blobs, finished, RetentionPolicy.from_hours(0, 168)) == {
        "results/j.png",
        "thumbnails/j.webp",
    }
    assert expired(blobs, finished, RetentionPolicy.from_hours(0, 0)) == set()


def test_blobs_named_after_a_job_belong_to_it():
    assert job_blob_refs("j9") == {
        "prepared/j9.safetensors",
        "latents/j9.safetensors",
        "masks/j9-processed.png",
        "results/j9.png",
        "thumbnails/j9.webp",
    }

"""Batches at the service level (``backend.api.batches``) against a real Redis and a real Celery
app object (queueing only writes to the broker's list; no worker runs): validation per item,
nothing stored on refusal, per-item failure isolation, cancel, the zip and its manifest, tenancy.
"""

from __future__ import annotations

import io
import json
import zipfile

import pytest
from PIL import Image

from backend.api.app import create_app
from backend.api.batches import MANIFEST, BatchItem, BatchRequest
from backend.api.checks import ServiceError
from backend.api.submission import JobRequest
from backend.jobstate import JobStateStore
from backend.protocol import JobEvent
from backend.protocol.keys import NAMESPACE
from tests.test_api import HEIGHT, IMAGE, MASK, WIDTH, make_settings, mask_png, pre_queue_jobs

pytestmark = pytest.mark.redis

OWNER, OTHER = "key:owner", "key:other"


@pytest.fixture
def app(redis_url, redis_client, tmp_path):
    return create_app(make_settings(redis_url, tmp_path), redis_client=redis_client)


@pytest.fixture
def batches(app):
    return app.state.batches


def shared(**fields) -> JobRequest:
    return JobRequest(
        **{"mask": b"", "prompt": "a red chair", "image": IMAGE, "steps": 4, "owner": OWNER}
        | fields
    )


MASKS = [mask_png(box=(4 * i, 4, 4 * i + 12, 20)) for i in range(3)]


def three_masks(**fields) -> BatchRequest:
    return BatchRequest(shared(**fields), tuple(BatchItem(mask=m) for m in MASKS))


def stored_keys(redis_client) -> set[str]:
    return {key.decode() for key in redis_client.scan_iter(f"{NAMESPACE}:*")}


def blob_files(settings) -> list:
    root = settings.paths.data_dir / "blobs"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def finish(jobstate: JobStateStore, job_id: str, status: str, **fields) -> None:
    jobstate.record_event(JobEvent(job_id=job_id, status=status, at=1.0, **fields))


def test_a_batch_queues_one_job_per_item_with_seeds_in_order(batches, redis_client, app):
    submitted = batches.submit(three_masks(seed=10))
    assert len(submitted.job_ids) == 3 and submitted.seeds == (10, 11, 12)
    queued = pre_queue_jobs(redis_client, app.state.settings)
    assert sorted(job.job_id for job in queued) == sorted(submitted.job_ids)
    assert {job.batch_id for job in queued} == {submitted.batch_id}
    assert len({job.template_ref for job in queued}) == 1  # the template stored once
    assert len({job.mask_ref for job in queued}) == 3
    view = batches.get(submitted.batch_id, OWNER)
    assert view["status"] == "queued" and view["total"] == 3 and view["progress"] == 0
    assert [item["index"] for item in view["items"]] == [0, 1, 2]
    assert [item["seed"] for item in view["items"]] == [10, 11, 12]
    job = app.state.service.get(submitted.job_ids[1], OWNER)
    assert job["batch_id"] == submitted.batch_id and job["batch_index"] == 1


def test_prompts_with_one_shared_mask(batches):
    items = tuple(BatchItem(prompt=p) for p in ("a cat", "a dog"))
    submitted = batches.submit(BatchRequest(shared(mask=MASK), items))
    view = batches.get(submitted.batch_id, OWNER)
    assert [item["prompt"] for item in view["items"]] == ["a cat", "a dog"]
    assert len(set(submitted.seeds)) == 2  # random seeds, each its own


@pytest.mark.parametrize(
    "items, fields, said",
    [
        ((BatchItem(mask=MASK), BatchItem(mask=b"not an image")), {}, "item 1"),
        ((BatchItem(mask=MASK), BatchItem(mask=mask_png(size=(20, 20)))), {}, "item 1"),
        ((BatchItem(mask=MASK), BatchItem(prompt="x" * 5000)), {"mask": MASK}, "item 1"),
        ((BatchItem(), BatchItem(mask=MASK)), {}, "item 0: no mask"),
        ((BatchItem(mask=MASK),) * 2, {"seed": 2**32 - 1}, "seed"),
        ((BatchItem(mask=MASK),) * 2, {"steps": 0}, "item 0: steps"),
        ((BatchItem(mask=MASK),) * 101, {}, "1 to 100 items"),
        ((), {}, "1 to 100 items"),
        ((BatchItem(mask=MASK),), {"image": None, "template_id": "nope"}, "template"),
    ],
)
def test_a_refused_batch_stores_nothing_and_names_the_item(
    batches, redis_client, app, items, fields, said
):
    before_keys, before_blobs = stored_keys(redis_client), blob_files(app.state.settings)
    with pytest.raises(ServiceError) as refused:
        batches.submit(BatchRequest(shared(**fields), items))
    assert said in str(refused.value)
    if said.startswith("item"):
        assert refused.value.detail["item"] == int(said.split()[1].rstrip(":"))
    assert stored_keys(redis_client) == before_keys
    assert blob_files(app.state.settings) == before_blobs
    assert pre_queue_jobs(redis_client, app.state.settings) == []


def test_an_items_failure_does_not_fail_the_others_and_the_zip_says_so(batches, app):
    submitted = batches.submit(three_masks())
    jobstate, blobs = app.state.service.jobstate, app.state.service.blobs
    first, second, third = submitted.job_ids
    result = blobs.put("results", f"{first}.png", b"\x89PNG first")
    finish(jobstate, first, "done", result_ref=result)
    finish(jobstate, second, "failed", message="the mask was empty")
    finish(jobstate, third, "running", step=2, num_steps=4)
    view = batches.get(submitted.batch_id, OWNER)
    assert view["status"] == "running" and view["counts"] == {"done": 1, "failed": 1, "running": 1}
    assert view["progress"] == pytest.approx((1 + 1 + 0.5) / 3, abs=1e-3)
    buffer = io.BytesIO()
    manifest = batches.write_zip(submitted.batch_id, OWNER, buffer)
    with zipfile.ZipFile(buffer) as archive:
        assert sorted(archive.namelist()) == ["0.png", MANIFEST]
        assert archive.read("0.png") == b"\x89PNG first"
        assert json.loads(archive.read(MANIFEST)) == manifest
    statuses = [(item["status"], item.get("message", "")) for item in manifest["items"]]
    assert statuses[1] == ("failed", "the mask was empty") and not manifest["complete"]
    finish(jobstate, third, "done", result_ref=blobs.put("results", f"{third}.png", b"third"))
    final = batches.get(submitted.batch_id, OWNER)
    assert final["status"] == "partial" and final["progress"] == 1.0


def test_cancel_ends_every_unfinished_item_and_only_those(batches, app):
    submitted = batches.submit(three_masks())
    jobstate = app.state.service.jobstate
    finish(jobstate, submitted.job_ids[0], "done")
    answer = batches.cancel(submitted.batch_id, OWNER)
    assert answer["cancelled"] == 2 and answer["already_finished"] == 1
    statuses = [jobstate.status(job_id) for job_id in submitted.job_ids]
    assert statuses == ["done", "cancelled", "cancelled"]
    assert batches.get(submitted.batch_id, OWNER)["status"] == "partial"
    with pytest.raises(ServiceError) as again:
        batches.cancel(submitted.batch_id, OWNER)
    assert again.value.code == "conflict"


def test_another_owner_gets_not_found_like_an_id_that_never_existed(batches):
    submitted = batches.submit(three_masks())
    for call in (batches.get, batches.cancel, batches.results):
        with pytest.raises(ServiceError) as theirs:
            call(submitted.batch_id, OTHER)
        with pytest.raises(ServiceError) as never:
            call("0" * 32, OTHER)
        assert theirs.value.code == never.value.code == "not_found"
        assert str(theirs.value).replace(submitted.batch_id, "0" * 32) == str(never.value)
    with pytest.raises(ServiceError):
        batches.write_zip(submitted.batch_id, OTHER, io.BytesIO())


def test_a_batch_counts_its_items_against_the_owners_bound(redis_url, redis_client, tmp_path):
    settings = make_settings(redis_url, tmp_path, max_queued_jobs=4)
    batches = create_app(settings, redis_client=redis_client).state.batches
    batches.submit(three_masks())
    with pytest.raises(ServiceError) as refused:
        batches.submit(three_masks())
    assert refused.value.code == "too_many" and "this batch adds 3" in str(refused.value)


def test_an_image_of_another_size_than_the_masks_is_refused_once(batches):
    big = io.BytesIO()
    Image.new("RGB", (WIDTH * 2, HEIGHT * 2)).save(big, format="PNG")
    with pytest.raises(ServiceError) as refused:
        batches.submit(three_masks(image=big.getvalue()))
    assert "item 0" in str(refused.value)


def test_the_studio_history_lists_the_owners_batches(batches):
    first = batches.submit(three_masks())
    second = batches.submit(three_masks())
    listed = batches.history(OWNER)
    assert [b["batch_id"] for b in listed] == [second.batch_id, first.batch_id]
    assert batches.history(OTHER) == []

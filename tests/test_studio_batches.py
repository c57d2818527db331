"""The studio's Batches tab over the real services (a real Redis, the real batch and job services,
a Celery app that only writes to the broker): submit one template with several masks, follow it
per item and overall, cancel it; each user sees their own batches; the page builds with the tab."""

from __future__ import annotations

import time

import pytest
from PIL import Image

from backend.api.app import create_app
from backend.api.security import STUDIO_OWNER
from backend.imaging.uploads import encode_image
from backend.protocol import JobEvent
from studio.actions import StudioActions, StudioError
from studio.app import build_studio
from studio.batch_actions import BatchForm, StudioBatches, item_rows, summary_line
from studio.batches_tab import progress_bar
from templates_store.samples import sample_template
from tests.test_api import make_settings

pytestmark = pytest.mark.redis

W, H = 96, 64


@pytest.fixture
def batches(redis_url, redis_client, tmp_path) -> StudioBatches:
    app = create_app(make_settings(redis_url, tmp_path), redis_client=redis_client)
    return StudioBatches(StudioActions(app.state.service, app.state.templates, STUDIO_OWNER))


def mask_files(tmp_path, count: int) -> tuple:
    paths = []
    for index in range(count):
        mask = Image.new("L", (W, H), 0)
        mask.paste(255, (10 * index, 8, 10 * index + 20, 30))
        paths.append(tmp_path / f"mask-{index}.png")
        mask.save(paths[-1])
    return tuple(paths)


def template_id(batches: StudioBatches, tmp_path) -> str:
    path = tmp_path / "room.png"
    sample_template(W, H, seed=5).save(path)
    (record,), _ = batches.actions.upload([path])
    return record.id


def record(batches, job_id: str, status: str, **fields) -> None:
    jobstate = batches.actions.service.jobstate
    jobstate.record_event(JobEvent(job_id=job_id, status=status, at=time.time(), **fields))


def test_a_batch_of_uploaded_masks_is_followed_item_by_item_until_it_ends(batches, tmp_path):
    form = BatchForm(template_id(batches, tmp_path), mask_files(tmp_path, 3), "a vase", 4, 9)
    submitted = batches.submit("ada", form)
    assert [b["batch_id"] for b in batches.list("ada")] == [submitted.batch_id]
    assert batches.list("bob") == []  # each user's own
    first, second, third = submitted.job_ids
    record(batches, first, "running", step=2, num_steps=4)
    view = batches.get(submitted.batch_id)
    assert [row[1] for row in item_rows(view)] == ["running", "queued", "queued"]
    assert item_rows(view)[0][2:4] == ["2/4", "50%"] and [r[5] for r in item_rows(view)] == [
        9,
        10,
        11,
    ]
    assert "running" in summary_line(view) and 'value="0.1667"' in progress_bar(view)
    result = encode_image(sample_template(W, H, seed=1), "png")
    thumb = batches.actions.service.blobs.put_content("thumbnails", result, ".webp")
    record(batches, first, "done", thumbnail_ref=thumb)
    record(batches, second, "failed", message="boom")
    assert len(batches.thumbnails(batches.get(submitted.batch_id))) == 1
    followed = batches.follow(submitted.batch_id, timeout_s=30)
    assert next(followed)["status"] == "running"
    record(batches, third, "done")
    last = list(followed)[-1]
    assert last["status"] == "partial" and last["finished"] == 3


def test_cancel_stops_every_unfinished_item(batches, tmp_path):
    submitted = batches.submit(
        "ada", BatchForm(template_id(batches, tmp_path), mask_files(tmp_path, 2), "a vase")
    )
    assert batches.cancel(submitted.batch_id).startswith("cancelled 2 item(s)")
    assert batches.get(submitted.batch_id)["status"] == "cancelled"
    with pytest.raises(StudioError, match="nothing to cancel"):
        batches.cancel(submitted.batch_id)


@pytest.mark.parametrize(
    "change, said",
    [
        ({"template_id": ""}, "pick a template"),
        ({"masks": ()}, "upload one or more masks"),
        ({"masks": ("/no/such/mask.png",)}, "cannot be read"),
        ({"steps": 500}, "item 0: steps 500"),
    ],
)
def test_bad_batches_say_what_to_fix_and_store_nothing(batches, tmp_path, change, said):
    form = BatchForm(template_id(batches, tmp_path), mask_files(tmp_path, 2))
    with pytest.raises(StudioError, match=said):
        batches.submit("ada", BatchForm(**(vars(form) | change)))
    assert batches.list("ada") == []


def test_the_studio_page_has_the_batches_tab(batches):
    page = build_studio(batches.actions)
    ids = {getattr(block, "elem_id", None) for block in page.blocks.values()}
    assert {"ms-batch-submit", "ms-batch-items", "ms-batches", "ms-batch-cancel"} <= ids

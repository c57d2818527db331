"""The studio's actions over the real service layer (a real Redis, the real JobService and
TemplateStore, a Celery app that only writes to the broker), and the studio mounted in the API app
behind the one auth layer."""

from __future__ import annotations

import base64
import dataclasses
import re
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from backend.api.app import create_app
from backend.api.security import STUDIO_OWNER
from backend.imaging.uploads import encode_image
from backend.protocol import JobEvent
from backend.training.scenes import make_scene
from studio import masks as studio_masks
from studio.actions import MAX_SAMPLES, SAMPLE_TAG, EditForm, StudioActions, StudioError
from studio.components import progress_html
from templates_store.samples import sample_template
from templates_store.store import MAX_NAME_CHARS
from tests.test_api import KEY, make_settings, pre_queue_jobs

W, H = 96, 64
USER, PASSWORD = "ada", "s3cret pass"


@pytest.fixture
def settings(redis_url, tmp_path):
    # the tests edit with tiny-sd2-inpaint, which no live worker serves here: configured (listed),
    # so its jobs are accepted and wait for a worker, like the default model's
    models = ("demo-sd2-inpaint", "tiny-sd2-inpaint")
    return make_settings(redis_url, tmp_path, users=(f"{USER}:{PASSWORD}",), models=models)


@pytest.fixture
def app(settings, redis_client):
    return create_app(settings, redis_client=redis_client)


@pytest.fixture
def actions(app) -> StudioActions:
    counted = app.state.metrics.jobs_submitted
    return StudioActions(
        app.state.service,
        app.state.templates,
        STUDIO_OWNER,
        lambda model: counted.labels(model, "studio").inc(),
    )


def upload_file(tmp_path, name="street.png", seed=3, size=(W, H)):
    path = tmp_path / name
    sample_template(*size, seed=seed).save(path)
    return path


def stroke(box=(20, 10, 50, 40), size=(W, H)) -> dict:
    layer = Image.new("RGBA", size, (0, 0, 0, 0))
    x0, y0, x1, y1 = box
    layer.paste(Image.new("RGBA", (x1 - x0, y1 - y0), (255, 48, 48, 255)), (x0, y0))
    return {"background": None, "layers": [layer], "composite": None}


def finish(service, job_id: str, image: Image.Image) -> None:
    """Post-processing's part, done the way the real post task records it: the result blob, then
    `done`."""
    ref = service.blobs.put_content("results", encode_image(image, "png"), ".png")
    service.jobstate.record_event(
        JobEvent(
            job_id=job_id, status="done", at=time.time(), result_ref=ref, timings={"total_s": 1.5}
        )
    )


def record_running(service, job_id: str, **extra) -> None:
    """A worker's running event at step 1 of 2, as the worker records it."""
    service.jobstate.record_event(
        JobEvent(
            job_id=job_id,
            status="running",
            at=time.time(),
            step=1,
            num_steps=2,
            worker_id="w",
            **extra,
        )
    )


# ----- gallery ------------------------------------------------------------------------------------
def test_several_templates_upload_at_once_and_bad_files_are_reported_not_fatal(actions, tmp_path):
    good = [upload_file(tmp_path, f"t{i}.png", seed=i) for i in range(3)]
    bad = tmp_path / "notes.txt"
    bad.write_text("not an image")
    added, problems = actions.upload([*good, bad], name="", tags="street, Day")
    assert sorted(r.name for r in added) == ["t0", "t1", "t2"]
    assert all(r.tags == ("street", "day") for r in added)
    assert len(problems) == 1 and problems[0].startswith("notes.txt:")
    named, _ = actions.upload(good[:2], name="shop")
    assert sorted(r.name for r in named) == ["shop 1", "shop 2"]
    assert {r.name for r in actions.gallery(query="SHOP")} == {"shop 1", "shop 2"}
    assert len(actions.gallery(tag="day")) == 3
    with pytest.raises(StudioError, match="no files"):
        actions.upload([])


def test_delete_removes_the_template_and_unknown_ids_are_clear_errors(actions, tmp_path):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    assert actions.delete(record.id) == "street"
    assert actions.gallery() == []
    with pytest.raises(StudioError, match="no template with id"):
        actions.delete(record.id)
    with pytest.raises(StudioError, match="pick one in the gallery"):
        actions.template("")


def test_cache_status_and_prepare(actions, tmp_path, settings, redis_client):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    assert actions.cache_status(record.id, "tiny-sd2-inpaint") == "not prepared"
    submitted = actions.prepare(record.id, "tiny-sd2-inpaint")
    assert actions.cache_status(record.id, "tiny-sd2-inpaint") == "preparing"
    queued = pre_queue_jobs(redis_client, settings)
    assert [(j.job_id, j.prepare, j.template_id) for j in queued] == [
        (submitted.job_id, True, record.id)
    ]
    with pytest.raises(StudioError, match="unknown model"):
        actions.cache_status(record.id, "no-such-model")


def test_add_samples_adds_distinct_held_out_scenes_once_and_lists_them(actions):
    records = actions.add_samples()
    assert [r.name.split(":")[0] for r in records] == [f"sample scene {n}" for n in range(1, 9)]
    assert all(r.tags == (SAMPLE_TAG,) and (r.width, r.height) == (128, 128) for r in records)
    assert len({r.sha256 for r in records}) == 8
    # the caption is in the name: whole, or cut in its background at the store's name limit
    for seed, record in enumerate(records):
        scene = make_scene(seed, split="heldout", size=128)
        full = f"sample scene {seed + 1}: {scene.caption}"
        assert record.name == full or full.startswith(record.name.removesuffix("…"))
        assert " and ".join(obj.caption for obj in scene.objects) in record.name
        assert len(record.name) <= MAX_NAME_CHARS
    assert records[3].name.endswith("…")  # seed 3's caption is longer than a name may be
    again = actions.add_samples()
    assert [r.id for r in again] == [r.id for r in records]
    listed = actions.gallery()
    assert len(listed) == 8 and listed[0].id == records[0].id  # scene 1 first
    assert {r.id for r in actions.gallery(tag=SAMPLE_TAG)} == {r.id for r in records}


def test_add_samples_keeps_an_upload_of_the_same_pixels_apart_and_refuses_bad_counts(
    actions, tmp_path
):
    (first,) = actions.add_samples(1)
    path = tmp_path / "mine.png"
    path.write_bytes(actions.image_path(first.id).read_bytes())
    (mine,), _ = actions.upload([path])  # not a sample: the next call still finds its own
    assert [r.id for r in actions.add_samples(2)][0] == first.id
    assert len(actions.gallery()) == 3 and mine.tags == ()
    for bad in (0, -1, MAX_SAMPLES + 1):
        with pytest.raises(StudioError, match=f"1 to {MAX_SAMPLES} sample scenes"):
            actions.add_samples(bad)
    assert len(actions.gallery()) == 3


# ----- editing ------------------------------------------------------------------------------------
def test_submit_sends_the_painted_alpha_as_the_mask_and_records_the_users_history(
    app, actions, tmp_path, settings, redis_client
):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    form = EditForm(
        prompt="a red door",
        model="tiny-sd2-inpaint",
        steps=4,
        guidance=5.0,
        seed=None,
        grow_px=3,
        feather_px=2.0,
    )
    submitted = actions.submit(USER, record.id, stroke(), form)
    assert 0 <= submitted.seed < 2**32 and submitted.steps == 4
    (job,) = pre_queue_jobs(redis_client, settings)
    assert (
        job.template_id == record.id and job.prompt == "a red door" and job.seed == submitted.seed
    )
    assert (job.mask_ops.grow_px, job.mask_ops.feather_px) == (3, 2.0)
    # someone is watching it: the studio's edits are interactive, at the default priority
    assert (job.service.service_class, job.service.priority) == ("interactive", 0)
    mask = np.asarray(Image.open(actions.service.blobs.local_path(job.mask_ref)))
    expected = np.zeros((H, W), dtype=bool)
    expected[10:40, 20:50] = True
    assert np.array_equal(mask == 255, expected)
    assert [j["job_id"] for j in actions.history(USER)] == [submitted.job_id]
    assert actions.history("someone else") == []
    counted = {"model": "tiny-sd2-inpaint", "source": "studio"}
    assert (
        app.state.metrics.registry.get_sample_value("maskserve_api_jobs_submitted_total", counted)
        == 1
    )


def test_bad_edits_are_refused_with_what_to_fix(actions, tmp_path):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    form = EditForm(prompt="x", model="tiny-sd2-inpaint", steps=4)
    empty = {"background": None, "layers": [Image.new("RGBA", (W, H))], "composite": None}
    cases = [
        ("", stroke(), form, "pick one in the gallery"),
        (record.id, empty, form, "nothing is painted"),
        (record.id, stroke(size=(W, W)), form, "another shape"),
        (record.id, stroke(), EditForm(prompt="x", model="nope"), "unknown model"),
        (record.id, stroke(), EditForm(prompt="x", steps=0), "steps 0 is out of range"),
        (record.id, stroke(), EditForm(prompt="x", grow_px=-40), "empty after"),
    ]
    for template_id, canvas, bad_form, message in cases:
        with pytest.raises(StudioError, match=message):
            actions.submit(USER, template_id, canvas, bad_form)


def test_follow_reports_each_change_until_the_job_ends_and_the_result_can_be_saved(
    actions, tmp_path
):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    submitted = actions.submit(
        USER, record.id, stroke(), EditForm(prompt="p", model="tiny-sd2-inpaint", steps=2)
    )
    service = actions.service
    seen = []
    follower = actions.follow(submitted.job_id)
    seen.append(next(follower))
    record_running(service, submitted.job_id)
    seen.append(next(follower))
    finish(service, submitted.job_id, sample_template(W, H, seed=9))
    seen.extend(follower)
    assert [p.status for p in seen] == ["queued", "running", "done"]
    assert seen[1].describe() == "Denoising · step 1/2" and seen[-1].finished
    saved = actions.save_result(submitted.job_id)
    assert saved.name == "street (edited)" and (saved.width, saved.height) == (W, H)
    with pytest.raises(StudioError, match="nothing to cancel"):
        actions.cancel(submitted.job_id)


def test_cancel_ends_a_queued_job_and_its_progress(actions, tmp_path):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    submitted = actions.submit(
        USER, record.id, stroke(), EditForm(prompt="p", model="tiny-sd2-inpaint", steps=2)
    )
    assert "next step" in actions.cancel(submitted.job_id)
    (final,) = list(actions.follow(submitted.job_id))
    assert final.status == "cancelled" and "cancelled by the user" in final.describe()
    with pytest.raises(StudioError, match="no result: the job was cancelled"):
        actions.save_result(submitted.job_id)
    with pytest.raises(StudioError, match="no job is running"):
        actions.cancel("")


# ----- mounted behind the one auth layer ----------------------------------------------------------
def test_the_studio_is_mounted_in_the_api_app_behind_the_login(app):
    with TestClient(app) as client:
        assert client.get("/", follow_redirects=False).headers["location"] == "/studio/"
        page = client.get("/studio/")
        assert page.status_code == 200 and "auth_required" in page.text
        assert client.get("/studio/config").status_code == 401
        refused = client.post("/studio/login", data={"username": USER, "password": "wrong"})
        assert refused.status_code in (400, 401)
        assert client.get("/studio/config").status_code == 401
        accepted = client.post("/studio/login", data={"username": USER, "password": PASSWORD})
        assert accepted.status_code == 200
        assert client.get("/studio/config").status_code == 200
        # the same app still serves REST with API keys (a studio login is not an API key)
        assert client.get("/v1/templates").status_code == 401
        assert client.get("/v1/templates", headers={"X-API-Key": KEY}).status_code == 200


def test_without_users_every_studio_login_is_refused(redis_url, tmp_path, redis_client):
    app = create_app(make_settings(redis_url, tmp_path), redis_client=redis_client)
    with TestClient(app) as client:
        # the login page says why nobody can sign in
        assert "MASKSERVE_USERS" in client.get("/studio/").text
        refused = client.post("/studio/login", data={"username": "studio", "password": "anything"})
        assert refused.status_code in (400, 401)
        assert client.get("/studio/config").status_code == 401


def test_the_studio_can_be_switched_off(redis_url, tmp_path, redis_client):
    settings = make_settings(redis_url, tmp_path)
    off = settings.model_copy(
        update={"studio": settings.studio.model_copy(update={"enabled": False})}
    )
    with TestClient(create_app(off, redis_client=redis_client)) as client:
        assert client.get("/studio/").status_code == 404


# ----- variations, recall, mask upload, keep editing ---------------------------------------------
def test_variations_are_one_batch_with_consecutive_seeds_and_followed_as_one(
    actions, tmp_path, settings, redis_client
):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    form = EditForm(prompt="a lamp", model="tiny-sd2-inpaint", steps=2, seed=2**32 - 3)
    jobs = actions.submit_variations(USER, record.id, stroke(), form, 3)
    # seeds follow the form's
    assert [job.seed for job in jobs] == [2**32 - 3, 2**32 - 2, 2**32 - 1]
    queued = pre_queue_jobs(redis_client, settings)
    assert sorted(job.job_id for job in queued) == sorted(job.job_id for job in jobs)
    assert {job.mask_ref for job in queued} and len({job.prompt for job in queued}) == 1
    # submitted in one request, as one batch: the dispatcher routes its items together
    (batch_id,) = {job.batch_id for job in queued}
    listed = actions.batches.record(batch_id, actions.owner).job_ids
    assert batch_id and [job.job_id for job in jobs] == list(listed)
    # a random first seed leaves room for the others; a given one too large is refused whole
    unseeded = actions.submit_variations(USER, record.id, stroke(), EditForm(prompt="p"), 4)
    assert [job.seed - unseeded[0].seed for job in unseeded] == [0, 1, 2, 3]
    before = len(pre_queue_jobs(redis_client, settings))
    with pytest.raises(StudioError, match="out of range for 3 items"):
        too_large = dataclasses.replace(form, seed=2**32 - 2)
        actions.submit_variations(USER, record.id, stroke(), too_large, 3)
    assert len(pre_queue_jobs(redis_client, settings)) == before
    follower = actions.follow_all([job.job_id for job in jobs])
    assert [p.status for p in next(follower)] == ["queued"] * 3
    for job in jobs:
        finish(actions.service, job.job_id, sample_template(W, H, seed=job.seed % 7))
    final = list(follower)[-1]
    assert [p.status for p in final] == ["done"] * 3
    for bad, message in ((0, "1 to 4"), (5, "1 to 4"), (2.5, "whole number"), (True, "whole")):
        with pytest.raises(StudioError, match=message):
            actions.submit_variations(USER, record.id, stroke(), form, bad)


def test_cancel_all_stops_the_unfinished_variations_and_keeps_finished_results(actions, tmp_path):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    form = EditForm(prompt="p", model="tiny-sd2-inpaint", steps=2)
    first, second = actions.submit_variations(USER, record.id, stroke(), form, 2)
    finish(actions.service, first.job_id, sample_template(W, H, seed=1))
    assert actions.cancel_all([first.job_id, second.job_id]) == (
        "Cancelled: the edit stops before its next step"
    )
    assert [actions.progress(j).status for j in (first.job_id, second.job_id)] == [
        "done",
        "cancelled",
    ]
    with pytest.raises(StudioError, match="nothing to cancel"):
        actions.cancel_all([first.job_id, second.job_id])


def test_a_recalled_job_brings_back_the_mask_it_was_submitted_with(actions, tmp_path):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    painted = stroke(box=(5, 6, 40, 30))
    submitted = actions.submit(USER, record.id, painted, EditForm(prompt="p", steps=2))
    (job,) = actions.history(USER)
    layer = actions.job_mask_layer(job)
    assert layer.mode == "RGBA" and layer.size == (W, H)
    again = {"background": None, "layers": [layer], "composite": None}
    assert np.array_equal(
        studio_masks.painted_mask(again, (W, H)), studio_masks.painted_mask(painted, (W, H))
    )
    # once the mask's file has expired, the recall says so (and what to do)
    actions.service.blobs.delete(job["mask_ref"])
    with pytest.raises(StudioError, match="mask has expired.*paint the mask again"):
        actions.job_mask_layer(actions.job(submitted.job_id))


def test_an_uploaded_mask_becomes_the_painted_layer_and_bad_ones_say_what_to_fix(actions, tmp_path):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    white = Image.new("L", (W, H), 0)
    white.paste(255, (10, 10, 30, 20))
    layer = actions.uploaded_mask_layer(record.id, white)
    painted = studio_masks.painted_mask({"layers": [layer]}, (W, H))
    assert painted.sum() == 20 * 10 and painted[15, 20]
    # twice the size, same shape: scaled to the template; a red RGB mask counts as painted
    red = Image.new("RGB", (2 * W, 2 * H), (0, 0, 0))
    red.paste((255, 0, 0), (20, 20, 60, 40))
    scaled = studio_masks.painted_mask(
        {"layers": [actions.uploaded_mask_layer(record.id, red)]}, (W, H)
    )
    assert np.array_equal(scaled, painted)
    for bad, message in (
        (Image.new("L", (W, H), 0), "uploaded mask is empty"),
        (Image.new("L", (W, W), 255), "another shape"),
    ):
        with pytest.raises(StudioError, match=message):
            actions.uploaded_mask_layer(record.id, bad)
    with pytest.raises(StudioError, match="pick one in the gallery"):
        actions.uploaded_mask_layer("", white)


def test_keep_editing_makes_the_result_a_template_and_queues_its_cache_recording(
    actions, tmp_path, settings, redis_client
):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    submitted = actions.submit(
        USER, record.id, stroke(), EditForm(prompt="p", model="tiny-sd2-inpaint", steps=3)
    )
    finish(actions.service, submitted.job_id, sample_template(W, H, seed=11))
    kept = actions.keep_editing(submitted.job_id)
    assert kept.name == "street (edited)" and kept.id != record.id
    (prepare,) = [job for job in pre_queue_jobs(redis_client, settings) if not job.mask_ref]
    assert (prepare.template_id, prepare.model_id, prepare.steps, prepare.mask_ref) == (
        kept.id,
        "tiny-sd2-inpaint",
        3,
        "",
    )


def test_the_predicted_time_comes_from_the_models_cost_profile(actions):
    line = actions.estimate("tiny-sd2-inpaint", 0.1, 20, 7.5)
    cached, ordinary = (float(x) for x in re.findall(r"~([\d.]+) s", line))
    assert "with the cache" in line and "on cpu" in line and 0 < cached < ordinary
    shorter = actions.estimate("tiny-sd2-inpaint", 0.1, 10, 7.5)
    assert float(re.findall(r"~([\d.]+) s", shorter)[1]) < ordinary
    # no profile for the model or nothing painted: no prediction rather than a made-up one
    assert actions.estimate("arch-flux-fill", 0.1, 20, 7.5) == ""
    assert actions.estimate("tiny-sd2-inpaint", 0.0, 20, 7.5) == ""


def test_erase_masked_area_lasso_and_speck_options_reach_the_job(
    actions, tmp_path, settings, redis_client
):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    # a prompt left in the form is not an erase's (it runs no model)
    form = EditForm(prompt="a lamp", mode="erase", fill_holes=True, min_area_px=9)
    actions.submit(USER, record.id, stroke(), form)
    (job,) = pre_queue_jobs(redis_client, settings)
    assert job.mode == "erase" and job.mask_ops.fill_holes and job.mask_ops.min_area_px == 9
    assert job.prompt == "" and actions.history(USER)[0]["prompt"] == ""
    # "inpaint only the masked area" and its padding reach the job too
    cropped = EditForm(prompt="a cat", inpaint_area="masked", crop_padding_px=64)
    submitted = actions.submit(USER, record.id, stroke(), cropped)
    (masked,) = [j for j in pre_queue_jobs(redis_client, settings) if j.job_id == submitted.job_id]
    assert (masked.inpaint_area, masked.crop_padding_px) == ("masked", 64)
    with pytest.raises(StudioError, match="crop_padding"):
        actions.submit(USER, record.id, stroke(), EditForm(prompt="x", crop_padding_px=-1))
    # the preview applies them too: an outline with fill_holes repaints what it encloses
    ring = Image.new("RGBA", (W, H), (0, 0, 0, 0))
    ring.paste(Image.new("RGBA", (30, 30), (255, 48, 48, 255)), (10, 10))
    ring.paste(Image.new("RGBA", (20, 20), (0, 0, 0, 0)), (15, 15))
    canvas = {"background": None, "layers": [ring], "composite": None}
    _, outline = actions.preview(record.id, canvas, EditForm(prompt=""))
    _, filled = actions.preview(record.id, canvas, EditForm(prompt="", fill_holes=True))
    assert outline == pytest.approx(500 / (W * H)) and filled == pytest.approx(900 / (W * H))


def test_live_previews_from_the_event_stream_show_in_the_progress_until_the_job_ends(
    actions, tmp_path
):
    (record,), _ = actions.upload([upload_file(tmp_path)])
    first, second = actions.submit_variations(
        USER, record.id, stroke(), EditForm(prompt="p", model="tiny-sd2-inpaint", steps=2), 2
    )
    preview = (
        "data:image/png;base64,"
        + base64.b64encode(encode_image(sample_template(16, 16, seed=2), "png")).decode()
    )
    follower = actions.follow_all([first.job_id, second.job_id])
    next(follower)
    for job in (first, second):
        record_running(actions.service, job.job_id, preview=preview)
    running = next(follower)
    while [p.preview for p in running] != [preview, preview]:
        running = next(follower)
    page = progress_html(running)
    assert page.count('<img class="ms-preview"') == 2 and "1: Denoising · step 1/2" in page
    for job in (first, second):
        finish(actions.service, job.job_id, sample_template(W, H, seed=3))
    final = list(follower)[-1]
    assert [p.status for p in final] == ["done", "done"] and "<img" not in progress_html(final)

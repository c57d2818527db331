"""Inpaint only the masked area (issue 17, "what painters expect"): ``inpaint_area="masked"``.

* the crop box (``uploads.masked_crop_box``): inside the image, the bucket's aspect, contains the
  mask's feather support plus the padding and its grid cells; a larger padding gives a larger
  crop until the image bounds;
* a masked-area edit through pre-processing, an engine worker and post-processing on the tiny
  model (in process, and on Celery with a real Redis): a full-size result, the template's own
  pixels outside the mask, changed inside;
* the template cache: two masks in the same snapped cell share one cache key, another cell or the
  whole image is another key, a crop reaching the whole image shares the whole-image edit's;
* REST, the client and ``maskserve submit`` carry the fields; bad values are 4xx saying what to
  fix; the job record shows them.
"""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

import backend.client
from backend.api.app import create_app
from backend.blobs import BlobStore
from backend.cli import build_parser
from backend.client import MaskServeClient
from backend.config import load_settings
from backend.imaging.masks import feather_support
from backend.imaging.uploads import (
    CROP_GRID_DIVISIONS,
    DEFAULT_CROP_PADDING_PX,
    UploadError,
    crop_box_for,
    masked_crop_box,
    resolution_bucket,
    validate_inpaint_area,
)
from backend.protocol import EditJob, decode, encode
from backend.tasks.core import CpuStages, erase_job
from backend.worker.channels import LocalInbox
from backend.worker.loop import EngineWorker
from backend.worker.service import RedisSink
from templates_store.samples import sample_template
from tests.factories import make_engine, queued_tasks
from tests.test_api import KEY, make_settings, pre_queue_jobs, submit
from tests.test_celery_tasks import engine, handed_off, stack, wait_for  # noqa: F401
from tests.test_cpu_stages import assert_edited_inside_only, painted_mask, png, run_worker

# a "large" template for the tiny model's 128 px bucket; cells of the 1/8 grid: 60 x 45 px
WIDTH, HEIGHT = 480, 360
BOX = (300, 220, 340, 250)  # painted area, upload pixels
NEAR_BOX = (305, 224, 338, 252)  # another painting in the same grid cells (padding 32)
FAR_BOX = (50, 40, 90, 70)


def rect(box, size=(WIDTH, HEIGHT)) -> np.ndarray:
    mask = np.zeros(size[::-1], dtype=bool)
    x0, y0, x1, y1 = box
    mask[y0:y1, x0:x1] = True
    return mask


def bbox(mask: np.ndarray) -> tuple[int, int, int, int]:
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def area(box) -> int:
    return (box[2] - box[0]) * (box[3] - box[1])


def contains(outer, inner) -> bool:
    return (
        outer[0] <= inner[0]
        and outer[1] <= inner[1]
        and inner[2] <= outer[2]
        and inner[3] <= outer[3]
    )


def padded(box, padding, width, height):
    x0, y0, x1, y1 = box
    return (
        max(0, x0 - padding),
        max(0, y0 - padding),
        min(width, x1 + padding),
        min(height, y1 + padding),
    )


def snapped(box, width, height, divisions=CROP_GRID_DIVISIONS):
    xs = [round(i * width / divisions) for i in range(divisions + 1)]
    ys = [round(i * height / divisions) for i in range(divisions + 1)]
    x0, y0, x1, y1 = box
    return (
        max(x for x in xs if x <= x0),
        max(y for y in ys if y <= y0),
        min(x for x in xs if x >= x1),
        min(y for y in ys if y >= y1),
    )


# ----- geometry ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(60))
def test_the_crop_box_is_inside_the_image_of_the_bucket_aspect_around_mask_padding_and_cells(
    seed,
):
    rng = np.random.default_rng(seed)
    width, height = (int(v) for v in rng.integers(48, 1400, size=2))
    base = int(rng.choice([128, 256, 512]))
    th, tw = size_hw = resolution_bucket(width, height, base, 8)
    mask = np.zeros((height, width), dtype=bool)
    for _ in range(int(rng.integers(1, 4))):  # one to three strokes
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        w = int(rng.integers(1, max(2, width // 4)))
        h = int(rng.integers(1, max(2, height // 4)))
        mask[y0 : y0 + h, x0 : x0 + w] = True
    padding = int(rng.integers(0, 200))
    divisions = int(rng.choice([0, 8, 16]))
    box = masked_crop_box(mask, size_hw, padding, divisions)
    left, top, right, bottom = box
    assert 0 <= left < right <= width and 0 <= top < bottom <= height
    w, h = right - left, bottom - top
    assert abs(w * th - h * tw) <= max(th, tw) / 2  # the bucket's aspect, to the nearest pixel
    full = crop_box_for((width, height), size_hw)
    assert w <= full[2] - full[0] and h <= full[3] - full[1]
    wanted = padded(bbox(mask), padding, width, height)
    if divisions:
        cells = snapped(wanted, width, height, divisions)
        if area(box) < area(full):  # not the largest box of that aspect: all of the cells
            assert contains(box, cells), (box, cells)
    fits = wanted[2] - wanted[0] <= full[2] - full[0] and wanted[3] - wanted[1] <= full[3] - full[1]
    if fits:  # some box of the bucket's aspect holds mask and padding: this one does
        assert contains(box, wanted), (box, wanted)
    else:  # else the largest such box (as a whole-image edit's bucket crop cuts margins)
        assert (w, h) == (full[2] - full[0], full[3] - full[1])


def test_a_larger_padding_gives_a_larger_crop_until_the_image_bounds():
    width, height = 1024, 768
    size_hw = resolution_bucket(width, height, 512, 8)
    mask = rect((600, 400, 650, 440), (width, height))
    full = crop_box_for((width, height), size_hw)
    cell = width // CROP_GRID_DIVISIONS

    def crop(padding, divisions=CROP_GRID_DIVISIONS):
        box = masked_crop_box(mask, size_hw, padding, divisions)
        wanted = padded(bbox(mask), padding, width, height)
        if wanted[3] - wanted[1] <= full[3] - full[1]:  # the bucket's aspect cuts 7 rows of 768
            assert contains(box, wanted)
        return box

    areas = [area(crop(p)) for p in range(0, 1025, 8)]
    assert areas == sorted(areas) and areas[0] < areas[-1]
    assert crop(1024) == full  # the bounds: the whole-image edit's crop (and so its cache)
    for p in range(0, 1024 - cell, 16):  # a grid cell more padding: a larger crop, or the bounds
        assert area(crop(p + cell)) > area(crop(p)) or area(crop(p)) == area(full), p
    # without snapping every few pixels of padding count
    unsnapped = [area(crop(p, divisions=0)) for p in (0, 8, 16, 32, 64, 128)]
    assert unsnapped == sorted(set(unsnapped))
    # the default padding keeps context around the mask, and the crop is far smaller than the image
    default = crop(DEFAULT_CROP_PADDING_PX)
    assert contains(default, padded(bbox(mask), 32, width, height)) and area(default) < area(full)


def test_nearby_masks_share_a_snapped_crop_and_far_ones_do_not():
    size_hw = resolution_bucket(WIDTH, HEIGHT, 128, 8)
    near = [masked_crop_box(rect(b), size_hw, 32) for b in (BOX, NEAR_BOX)]
    far = masked_crop_box(rect(FAR_BOX), size_hw, 32)
    assert near[0] == near[1] != far
    unsnapped = [masked_crop_box(rect(b), size_hw, 32, divisions=0) for b in (BOX, NEAR_BOX)]
    assert unsnapped[0] != unsnapped[1]  # what the grid is for


def test_the_crop_covers_the_feather_support():
    size_hw = resolution_bucket(WIDTH, HEIGHT, 128, 8)
    support = feather_support(rect(BOX), 12.0)
    box = masked_crop_box(support, size_hw, 0, divisions=0)
    assert contains(box, bbox(support)) and bbox(support) != BOX


@pytest.mark.parametrize(
    "area_name, padding, message",
    [
        ("everything", 32, "inpaint_area 'everything' is not known: use whole"),
        ("masked", -1, "crop_padding_px -1 is out of range: use a whole number of pixels in 0"),
        ("masked", 1025, "crop_padding_px 1025 is out of range"),
        ("masked", 2.5, "crop_padding_px 2.5 is out of range"),
        ("masked", True, "crop_padding_px True is out of range"),
    ],
)
def test_bad_settings_say_what_to_fix(area_name, padding, message):
    with pytest.raises(UploadError, match="^" + message.replace("(", r"\(")):
        validate_inpaint_area(area_name, padding)


def test_the_edit_job_carries_the_fields_and_older_messages_read_as_whole():
    job = EditJob(
        job_id="j",
        model_id="m",
        template_ref="t",
        mask_ref="m",
        prompt="p",
        seed=1,
        steps=2,
        guidance=1.0,
        inpaint_area="masked",
        crop_padding_px=48,
    )
    assert decode(encode(job)) == job
    older = json.loads(encode(job))
    del older["inpaint_area"], older["crop_padding_px"]
    read = decode(json.dumps(older | {"version": "1.2"}))
    assert (read.inpaint_area, read.crop_padding_px) == ("whole", 32)


# ----- pre -> engine -> post, in process ----------------------------------------------------------
@pytest.fixture(scope="module")
def stages(models_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("crop-stages")
    settings = load_settings(env={}, paths={"data_dir": str(root), "models_dir": str(models_dir)})
    tiny = make_engine("sd2-inpaint", models_dir, root / "cache")
    return CpuStages(settings, tiny, blobs=BlobStore(root / "blobs"))


@pytest.fixture(scope="module")
def template():
    return sample_template(WIDTH, HEIGHT, seed=21)


def crop_job(stages, job_id, template, box=BOX, **fields) -> EditJob:
    blobs = stages.blobs
    values = dict(
        job_id=job_id,
        model_id=stages.engine.spec.model_id,
        template_ref=blobs.put("uploads", f"{job_id}-template.png", png(template)),
        mask_ref=blobs.put("uploads", f"{job_id}-mask.png", png(painted_mask(box, template.size))),
        prompt="a blue vase",
        seed=3,
        steps=3,
        guidance=7.5,
        resolution=128,
        inpaint_area="masked",
    )
    return EditJob(**(values | fields))


def test_a_masked_area_edit_runs_on_a_crop_and_pastes_back_into_the_full_image(stages, template):
    whole = stages.preprocess(crop_job(stages, "area-whole", template, inpaint_area="whole"))
    masked = stages.preprocess(crop_job(stages, "area-masked", template))
    size_hw = resolution_bucket(WIDTH, HEIGHT, 128, stages.engine.size_multiple)
    assert whole.paste.crop_box == list(crop_box_for(template.size, size_hw))
    box = masked.paste.crop_box
    assert contains(box, padded(BOX, 32, WIDTH, HEIGHT)) and area(box) * 4 <= area(
        whole.paste.crop_box
    )
    # the mask fills more of the model's pixels: that is the detail gained
    assert masked.mask_ratio > 3 * whole.mask_ratio
    assert masked.cache_digest != whole.cache_digest  # another picture, another cache
    denoised = run_worker(stages, masked)
    assert denoised.paste.crop_box == box
    event = stages.postprocess(denoised)
    assert event.status == "done"
    result = stages.blobs.get(event.result_ref)
    assert Image.open(io.BytesIO(result)).size == template.size
    assert_edited_inside_only(result, template, box=BOX)


def test_masks_in_the_same_cells_share_one_cache_and_the_whole_image_crop_shares_its(
    stages, template
):
    first = stages.preprocess(crop_job(stages, "cell-a", template))
    near = stages.preprocess(crop_job(stages, "cell-b", template, box=NEAR_BOX, seed=8))
    far = stages.preprocess(crop_job(stages, "cell-c", template, box=FAR_BOX))
    assert first.paste.crop_box == near.paste.crop_box != far.paste.crop_box
    assert first.cache_digest == near.cache_digest != far.cache_digest
    whole = stages.preprocess(crop_job(stages, "cell-w", template, inpaint_area="whole"))
    widest = stages.preprocess(crop_job(stages, "cell-p", template, crop_padding_px=1024))
    assert widest.paste.crop_box == whole.paste.crop_box
    assert widest.cache_digest == whole.cache_digest


def test_a_padding_out_of_range_fails_pre_processing_before_any_model(stages, template):
    with pytest.raises(UploadError, match="crop_padding_px 2000 is out of range"):
        stages.preprocess(crop_job(stages, "bad-pad", template, crop_padding_px=2000))


def test_erase_ignores_the_inpaint_area(stages, template):
    results = []
    for area_name in ("whole", "masked"):
        job = crop_job(stages, f"erase-{area_name}", template, mode="erase", inpaint_area=area_name)
        event = erase_job(stages.settings, job, blobs=stages.blobs)
        results.append(stages.blobs.get(event.result_ref))
    assert results[0] == results[1]


# ----- on Celery, with a real Redis ---------------------------------------------------------------
def test_a_masked_area_job_runs_pre_and_post_on_celery(stack, engine, tmp_path):  # noqa: F811
    settings, app, jobstate, client = stack
    from backend.tasks.celery_app import submit_edit

    template = sample_template(WIDTH, HEIGHT, seed=22)
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    job = EditJob(
        job_id="celery-crop",
        model_id="tiny-sd2-inpaint",
        template_ref=blobs.put("uploads", "crop-t.png", png(template)),
        mask_ref=blobs.put("uploads", "crop-m.png", png(painted_mask(BOX, template.size))),
        prompt="a blue vase",
        seed=9,
        steps=3,
        guidance=7.5,
        resolution=128,
        submitted_at=time.time(),
        inpaint_area="masked",
        crop_padding_px=16,
    )
    jobstate.create(job.job_id, prompt=job.prompt, seed=job.seed, inpaint_area="masked")
    submit_edit(app, job)
    log = tmp_path / "cpu-worker.log"
    (prepared,) = wait_for(lambda: handed_off(client), "the pre-processed job", log)
    assert contains(prepared.paste.crop_box, padded(BOX, 16, WIDTH, HEIGHT))
    assert area(prepared.paste.crop_box) * 4 <= WIDTH * HEIGHT
    inbox = LocalInbox()
    worker = EngineWorker(engine, blobs, inbox, RedisSink(jobstate, app, settings))
    inbox.put(prepared)
    while not inbox.acked:
        worker.iterate()
    wait_for(lambda: jobstate.status(job.job_id) == "done", "the job to finish", log)
    record = jobstate.get(job.job_id)
    assert record["inpaint_area"] == "masked"
    assert_edited_inside_only(blobs.get(record["result_ref"]), template, box=BOX)


# ----- REST, client, CLI --------------------------------------------------------------------------
@pytest.fixture
def api(redis_url, redis_client, tmp_path):
    app = create_app(make_settings(redis_url, tmp_path), redis_client=redis_client)
    with TestClient(app, headers={"X-API-Key": KEY}) as test_client:
        yield test_client, app.state.settings


def test_rest_takes_the_fields_queues_them_and_the_record_shows_them(api, redis_client):
    client, settings = api
    default = submit(client)
    masked = submit(client, inpaint_area="masked", crop_padding_px="48")
    assert default.status_code == masked.status_code == 202, masked.text
    queued = {job.job_id: job for job in pre_queue_jobs(redis_client, settings)}
    first, second = queued[default.json()["job_id"]], queued[masked.json()["job_id"]]
    assert (first.inpaint_area, first.crop_padding_px) == ("whole", 32)
    assert (second.inpaint_area, second.crop_padding_px) == ("masked", 48)
    shown = client.get(f"/v1/jobs/{masked.json()['job_id']}").json()
    assert (shown["inpaint_area"], shown["crop_padding_px"]) == ("masked", 48)
    fields = client.get("/openapi.json").json()["components"]["schemas"]["JobView"]["properties"]
    assert fields["inpaint_area"]["enum"] == ["whole", "masked"]
    assert fields["crop_padding_px"]["type"] == "integer"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"inpaint_area": "everything"}, "inpaint_area 'everything' is not known: use whole"),
        ({"inpaint_area": "masked", "crop_padding_px": "-1"}, "crop_padding_px -1 is out of range"),
        ({"crop_padding_px": "1025"}, "crop_padding_px 1025 is out of range: use a whole number"),
        ({"crop_padding_px": "wide"}, "crop_padding_px"),
    ],
)
def test_bad_fields_are_422_saying_what_to_fix(api, redis_client, fields, message):
    client, settings = api
    response = submit(client, **fields)
    assert response.status_code == 422 and message in response.json()["error"], response.text
    assert queued_tasks(redis_client, settings.celery.pre_queue) == []


def test_the_client_sends_the_fields(api, redis_client):
    client, settings = api
    maskserve = MaskServeClient("http://testserver")
    maskserve.http.close()
    maskserve.http = client  # the app in process
    from tests.test_api import IMAGE, MASK

    accepted = maskserve.submit(
        MASK, "a vase", image=IMAGE, steps=4, inpaint_area="masked", crop_padding_px=64
    )
    (job,) = pre_queue_jobs(redis_client, settings)
    assert job.job_id == accepted["job_id"]
    assert (job.inpaint_area, job.crop_padding_px) == ("masked", 64)


def test_maskserve_submit_takes_inpaint_area_and_crop_padding(monkeypatch, tmp_path, capsys):
    sent = {}

    class FakeClient:
        def __init__(self, url, api_key):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def submit(self, mask, prompt, template_id=None, image=None, **params):
            sent.update(params)
            return {"job_id": "0" * 32}

    monkeypatch.setattr(backend.client, "MaskServeClient", FakeClient)
    (tmp_path / "i.png").write_bytes(b"x")
    argv = ["submit", "--url", "http://x", "--api-key", "k", "--image", str(tmp_path / "i.png")]
    argv += ["--mask", str(tmp_path / "i.png"), "--no-wait"]
    args = build_parser().parse_args(argv + ["--inpaint-area", "masked", "--crop-padding", "32"])
    assert args.func(args, None) == 0
    assert sent["inpaint_area"] == "masked" and sent["crop_padding_px"] == 32
    sent.clear()
    args = build_parser().parse_args(argv)
    assert args.func(args, None) == 0
    assert sent["inpaint_area"] is None and sent["crop_padding_px"] is None  # the server's
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv + ["--inpaint-area", "everything"])
    capsys.readouterr()


def test_maskserve_bench_crop_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "crop.json"
    args = build_parser().parse_args(
        ["bench", "crop", "--masks", "3", "--timed", "0", "--json", str(out)]
    )
    settings = load_settings(env={}, paths={"data_dir": str(tmp_path)})
    assert args.func(args, settings) == 0
    report = json.loads(out.read_text())
    rows = report["geometry"]["nearby"]["rows"]
    assert {row["grid"] for row in rows} == {"none", "1/16 side", "1/8 side"}
    assert all(row["distinct_crops"] <= 3 and row["gain_min"] >= 1.0 for row in rows)
    assert out.with_suffix(".png").stat().st_size > 0
    assert "distinct crops" in capsys.readouterr().out

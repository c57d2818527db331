"""Erase mode and the OpenCV mask operations over the wire: OpenCV's inpainting (Telea) fills the
painted area from its surroundings; the REST API validates the new fields (mode, fill_holes,
min_area_px) with 4xx messages; an erase job submitted with `maskserve submit --mode erase` goes
through the real API process and a real `maskserve cpu-worker` (Celery pre-processing), which
finishes it itself: done, with a result, thumbnail, timings, events and a history entry, never
handed to the dispatcher."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from backend.api.app import create_app
from backend.blobs import BlobStore
from backend.client import MaskServeClient, add_submit_arguments, submit_cli
from backend.config import load_settings
from backend.engine.editor import EditParams
from backend.engine.prepared import PreparedRequest
from backend.imaging import masks, uploads
from backend.imaging.erase import erase, require_erasable
from backend.imaging.masks import MaskError
from backend.protocol import EditJob, MaskOps
from backend.protocol.keys import PREPARED_STREAM
from backend.services.redis_server import free_port
from backend.tasks.core import CpuStages, erase_job
from tests.api_factory import KEY, make_settings, pre_queue_jobs
from tests.factories import make_engine, queued_tasks

BLUE, RED = (30, 60, 200), (230, 20, 20)
W, H = 96, 72
SQUARE = (36, 26, 56, 44)  # x0, y0, x1, y1 of the red square
OUTLINE = (32, 22, 60, 48)  # a closed outline around it, 2 px wide: the lasso
SPECK = (80, 8)  # x, y of a 1-px speck of paint, far from the square


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def red_square_on_blue() -> Image.Image:
    pixels = np.zeros((H, W, 3), dtype=np.uint8)
    pixels[:] = BLUE
    x0, y0, x1, y1 = SQUARE
    pixels[y0:y1, x0:x1] = RED
    return Image.fromarray(pixels, mode="RGB")


def box_mask(box, margin: int = 0) -> np.ndarray:
    mask = np.zeros((H, W), dtype=bool)
    x0, y0, x1, y1 = box
    mask[y0 - margin : y1 + margin, x0 - margin : x1 + margin] = True
    return mask


def lasso_with_speck() -> np.ndarray:
    """A 2-px closed outline around the red square (nothing painted inside) and a 1-px speck."""
    outline = box_mask(OUTLINE) & ~box_mask(OUTLINE, margin=-2)
    outline[SPECK[1], SPECK[0]] = True
    return outline


def mask_png(mask: np.ndarray) -> bytes:
    return png(Image.fromarray(mask.astype(np.uint8) * 255, mode="L"))


def assert_erased(result: np.ndarray, template: np.ndarray, area: np.ndarray) -> None:
    """Outside ``area`` the template's own pixels; inside, the blue of the surroundings."""
    assert result.shape == template.shape
    assert np.array_equal(result[~area], template[~area])
    inside = result[area].astype(int)
    assert np.abs(inside - np.asarray(BLUE)).max() <= 12, inside.mean(axis=0)
    assert (inside[:, 0] < 80).all()  # no trace of the red square


# ----- the inpainting itself ------------------------------------------------------------------
def test_erase_fills_the_mask_from_its_surroundings_and_keeps_everything_else():
    template = red_square_on_blue()
    area = box_mask(SQUARE, margin=2)
    result = np.asarray(erase(template, area))
    assert_erased(result, np.asarray(template), area)


def test_a_feathered_erase_changes_nothing_beyond_the_feathers_reach():
    template = red_square_on_blue()
    area = box_mask(SQUARE, margin=1)
    result = np.asarray(erase(template, area, feather_px=3.0))
    reach = masks.feather_support(area, 3.0)
    assert np.array_equal(result[~reach], np.asarray(template)[~reach])
    core = masks.shrink(area, 3)  # alpha 1: wholly filled; nearer the edge the template blends in
    assert np.abs(result[core].astype(int) - np.asarray(BLUE)).max() <= 12
    soft = reach & ~core
    assert np.array_equal(result[soft], np.asarray(erase(template, area))[soft]) is False


def test_erase_needs_something_to_fill_from():
    template = red_square_on_blue()
    with pytest.raises(MaskError, match="whole image is painted"):
        erase(template, np.ones((H, W), dtype=bool))
    with pytest.raises(MaskError, match="mask is empty"):
        erase(template, np.zeros((H, W), dtype=bool))
    with pytest.raises(MaskError, match="does not match"):
        erase(template, np.ones((H + 1, W), dtype=bool))
    require_erasable(box_mask(SQUARE))  # a partial mask is fine


# ----- pre-processing: what the engine gets, erase jobs in process --------------------------------
@pytest.fixture(scope="module")
def stages(models_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("erase-stages")
    settings = load_settings(env={}, paths={"data_dir": str(root), "models_dir": str(models_dir)})
    engine = make_engine("sd2-inpaint", models_dir, root / "cache")
    return CpuStages(settings, engine, blobs=BlobStore(root / "blobs"))


def stored_job(stages, job_id: str, template: Image.Image, mask: np.ndarray, **fields) -> EditJob:
    blobs = stages.blobs
    values = dict(
        job_id=job_id,
        model_id=stages.engine.spec.model_id,
        template_ref=blobs.put("uploads", f"{job_id}-t.png", png(template)),
        mask_ref=blobs.put("uploads", f"{job_id}-m.png", mask_png(mask)),
        prompt="",
        seed=1,
        steps=2,
        guidance=7.5,
        resolution=64,
    )
    return EditJob(**(values | fields))


def test_the_engine_repaints_the_feathers_reach_so_its_tokens_cover_the_paste(stages):
    """Pre-processing hands the engine the feather's support at the model resolution, not the bare
    mask: every token under a pixel that paste-back blends is computed fresh (margin 0 here)."""
    template, painted = red_square_on_blue(), box_mask(SQUARE)
    ops = MaskOps(feather_px=6.0)
    prepared = stages.preprocess(stored_job(stages, "reach", template, painted, mask_ops=ops))
    request = PreparedRequest.load(stages.blobs.local_path(prepared.prepared_ref))
    size_hw = tuple(EditParams.from_dict(request.params).size)
    bare = uploads.mask_to_bucket(painted, size_hw)
    reach = uploads.mask_to_bucket(masks.feather_support(painted, 6.0), size_hw)
    assert np.array_equal(request.pixels, reach) and reach.sum() > bare.sum()
    assert prepared.mask_ratio == pytest.approx(reach.mean())
    assert EditParams.from_dict(request.params).mask_margin == 0
    with pytest.raises(ValueError, match="erase job is finished in pre-processing"):
        stages.preprocess(stored_job(stages, "erase-pre", template, painted, mode="erase"))


def test_erase_job_finishes_the_job_in_process(stages):
    template, painted = red_square_on_blue(), box_mask(SQUARE, margin=2)
    job = stored_job(stages, "erase-in-process", template, painted, mode="erase")
    event = erase_job(stages.settings, job, blobs=stages.blobs)
    assert event.status == "done" and {"pre_s", "erase_s", "total_s"} <= set(event.timings)
    result = np.asarray(Image.open(io.BytesIO(stages.blobs.get(event.result_ref))))
    assert_erased(result, np.asarray(template), painted)
    assert stages.blobs.exists(event.thumbnail_ref)


# ----- REST validation and the submitted message -------------------------------------------------
@pytest.fixture
def client(redis_url, redis_client, tmp_path):
    settings = make_settings(redis_url, tmp_path)
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as test_client:
        yield test_client, settings


def post(test_client, mask: bytes, image: bytes | None = None, **fields):
    files = {
        "image": ("image.png", image or png(red_square_on_blue()), "image/png"),
        "mask": ("mask.png", mask, "image/png"),
    }
    return test_client.post("/v1/jobs", data=fields, files=files)


BAD = [
    ({"min_area_px": "-1"}, "min_area_px -1 is out of range: use 0..16777216"),
    ({"min_area_px": str(2**25)}, "min_area_px 33554432 is out of range"),
    ({"min_area_px": "many"}, "min_area_px"),
    ({"fill_holes": "perhaps"}, "fill_holes"),
    ({"mode": "paint"}, "mode 'paint' is not known: use one of generate, erase"),
    # every painted area is a speck: nothing is left to repaint
    ({"min_area_px": "10000"}, "every painted area is smaller than the speck size"),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[m[:24] for _, m in BAD])
def test_bad_mask_ops_and_modes_are_4xx_saying_what_to_fix(client, redis_client, fields, message):
    test_client, settings = client
    response = post(test_client, mask_png(box_mask(SQUARE)), **({"prompt": "a vase"} | fields))
    assert 400 <= response.status_code < 500, response.text
    assert message in response.json()["error"]
    assert queued_tasks(redis_client, settings.celery.pre_queue) == []  # nothing queued


def test_an_erase_of_the_whole_image_is_refused_at_submission(client, redis_client):
    test_client, settings = client
    response = post(test_client, mask_png(np.ones((H, W), dtype=bool)), mode="erase")
    assert response.status_code == 422 and "whole image is painted" in response.json()["error"]
    # generate may repaint everything; erase needs pixels to fill from, the feather's reach too
    assert post(test_client, mask_png(np.ones((H, W), bool)), prompt="a vase").status_code == 202
    grown = post(test_client, mask_png(box_mask(SQUARE)), mode="erase", grow_px="200")
    assert grown.status_code == 422 and "whole image" in grown.json()["error"]


def test_the_new_fields_reach_the_job_message_and_record(client, redis_client):
    test_client, settings = client
    response = post(
        test_client, mask_png(lasso_with_speck()), mode="erase", fill_holes="true", min_area_px="4"
    )
    assert response.status_code == 202, response.text  # no prompt: erase needs none
    (job,) = pre_queue_jobs(redis_client, settings)
    assert job.mode == "erase" and job.prompt == ""
    assert job.mask_ops == MaskOps(fill_holes=True, min_area_px=4)
    shown = test_client.get(f"/v1/jobs/{job.job_id}").json()
    assert shown["mask_ops"]["fill_holes"] is True and shown["mask_ops"]["min_area_px"] == 4
    assert shown["mode"] == "erase"
    # the defaults: a generate job whose ops change nothing
    accepted = post(test_client, mask_png(box_mask(SQUARE)), prompt="a vase")
    assert accepted.status_code == 202
    (plain,) = [
        queued
        for queued in pre_queue_jobs(redis_client, settings)
        if queued.job_id == accepted.json()["job_id"]
    ]
    assert plain.mode == "generate" and plain.mask_ops == MaskOps()
    assert test_client.get(f"/v1/jobs/{plain.job_id}").json()["mode"] == "generate"


def test_the_cli_sends_mode_and_mask_ops():
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    args = parser.parse_args(
        ["--image", "i.png", "--mask", "m.png", "--mode", "erase", "--fill-holes"]
        + ["--min-area-px", "9"]
    )
    assert (args.mode, args.fill_holes, args.min_area_px) == ("erase", True, 9)
    with pytest.raises(SystemExit):  # argparse refuses an unknown mode
        parser.parse_args(["--image", "i.png", "--mask", "m.png", "--mode", "paint"])


# ----- end to end: CLI -> API process -> Celery pre-processing -> done ---------------------------
def _start(code_or_args: list[str], env: dict, log_path) -> subprocess.Popen:
    log = open(log_path, "wb")
    try:
        return subprocess.Popen(
            [sys.executable, *code_or_args],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()  # the child holds its own descriptor


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture
def stack(redis_url, models_dir, tmp_path):
    """A `run_api` process and a `maskserve cpu-worker` process on one Redis and data directory;
    no dispatcher and no engine worker (an erase job needs neither). Yields (base url, client)."""
    port = free_port()
    env = {
        "MASKSERVE_REDIS_URL": redis_url,
        "MASKSERVE_DATA_DIR": str(tmp_path / "data"),
        "MASKSERVE_MODELS_DIR": str(models_dir),
        "MASKSERVE_MODEL": "tiny-sd2-inpaint",
        "MASKSERVE_API_KEYS": KEY,
        "MASKSERVE_API_PORT": str(port),
        "MASKSERVE_CPU_METRICS_PORT": str(free_port()),
        "MASKSERVE_READ_RATE_PER_MINUTE": "0",
        "MASKSERVE_WRITE_RATE_PER_MINUTE": "0",
    }
    api_code = (
        "from backend.api.server import run_api; from backend.config import load_settings; "
        "from backend.runtime import run_role; "
        "raise SystemExit(run_role('api', run_api, load_settings()))"
    )
    api = _start(["-c", api_code], env, tmp_path / "api.log")
    worker = _start(["-m", "backend.cli", "cpu-worker"], env, tmp_path / "cpu-worker.log")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if api.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"API did not start: {(tmp_path / 'api.log').read_text()}")
            time.sleep(0.1)
        yield base, load_settings(env)
    finally:
        _stop(api)
        _stop(worker)


def test_an_erase_job_runs_through_the_api_and_celery_pre_processing_only(
    stack, tmp_path, capsys, redis_client
):
    base, settings = stack
    template = red_square_on_blue()
    (tmp_path / "image.png").write_bytes(png(template))
    (tmp_path / "mask.png").write_bytes(mask_png(lasso_with_speck()))
    out = tmp_path / "erased.png"
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    args = parser.parse_args(
        ["--url", base, "--api-key", KEY, "--image", str(tmp_path / "image.png")]
        + ["--mask", str(tmp_path / "mask.png"), "--mode", "erase", "--fill-holes"]
        + ["--min-area-px", "4", "--out", str(out), "--timeout", "120"]
    )
    started = time.monotonic()
    code = submit_cli(args)
    latency = time.monotonic() - started
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    log = (tmp_path / "cpu-worker.log").read_text()[-3000:]
    assert code == 0 and lines[-1]["status"] == "done", (lines, log)
    job_id = lines[0]["job_id"]

    # the lasso's inside is erased; the speck (below min_area_px) was dropped, so its pixel and
    # everything else outside the filled outline is the template's own
    area = box_mask(OUTLINE)
    result = np.asarray(Image.open(out).convert("RGB"))
    assert_erased(result, np.asarray(template), area)
    assert tuple(result[SPECK[1], SPECK[0]]) == BLUE

    with MaskServeClient(base, KEY) as client:
        job = client.get(job_id)
        assert job["status"] == "done" and job["worker_id"] == ""
        assert {"queue_s", "pre_s", "erase_s", "total_s"} <= set(job["timings"])
        assert job["num_steps"] == 0 and "denoise_s" not in job["timings"]
        statuses = [event["status"] for event in client.events(job_id, after="0", timeout=10)]
        assert statuses == ["preprocessing", "done"]  # no waiting, running or postprocessing
        assert [listed["job_id"] for listed in client.jobs()] == [job_id]  # the history
        thumb = Image.open(io.BytesIO(client.result_bytes(job_id, thumbnail=True)))
        assert thumb.format == "WEBP" and max(thumb.size) <= 256
        assert client.result_bytes(job_id) == out.read_bytes()
    assert redis_client.xlen(PREPARED_STREAM) == 0  # never handed to the dispatcher
    print(f"erase job: {latency:.2f} s submit-to-result, timings {job['timings']}")

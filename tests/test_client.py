"""The Python client and `maskserve submit` against a real API process (uvicorn, `run_api`) on a
real Redis. A stand-in pipeline thread takes the EditJob off the Celery pre queue and records the
events a CPU worker and an engine worker would, so no model runs here."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import zipfile

import httpx
import pytest
from PIL import Image
from redis import Redis

from backend import protocol
from backend.batch_cli import run_batch
from backend.blobs import BlobStore
from backend.cli import main
from backend.client import MaskServeClient, MaskServeError, add_submit_arguments, submit_cli
from backend.config import load_settings
from backend.imaging.uploads import encode_image
from backend.jobstate import JobStateStore
from backend.protocol import JobEvent
from backend.protocol.keys import cpu_queue_lists
from backend.services.redis_server import free_port
from templates_store.samples import sample_template
from tests.factories import celery_args
from tests.test_api import HEIGHT, IMAGE, MASK, WIDTH

KEY = "client-test-key"


@pytest.fixture
def api(redis_url, tmp_path):
    """A running `run_api` process; yields (base url, settings)."""
    port = free_port()
    env = {
        "MASKSERVE_REDIS_URL": redis_url,
        "MASKSERVE_DATA_DIR": str(tmp_path / "data"),
        # a digest entry first: the CLI's default key must skip it (it is no key one can send)
        "MASKSERVE_API_KEYS": f"sha256:{'0' * 64},{KEY}",
        "MASKSERVE_API_PORT": str(port),
        "MASKSERVE_READ_RATE_PER_MINUTE": "0",
        "MASKSERVE_WRITE_RATE_PER_MINUTE": "0",
    }
    settings = load_settings(env)
    code = (
        "from backend.api.server import run_api; from backend.config import load_settings; "
        "from backend.runtime import run_role; "
        "raise SystemExit(run_role('api', run_api, load_settings()))"
    )
    log = open(tmp_path / "api.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"API did not start: {(tmp_path / 'api.log').read_text()[-2000:]}"
                )
            time.sleep(0.1)
        yield base, settings
    finally:
        process.terminate()
        assert process.wait(timeout=20) == 0, (tmp_path / "api.log").read_text()[-2000:]
        log.close()


def fake_pipeline(settings, num_jobs: int = 1, fail=False) -> threading.Thread:
    """Stand-in for the CPU and engine workers: pops EditJobs off the pre queue, records progress
    events, writes a result blob and records ``done`` (or ``failed``: every job when ``fail`` is
    True, those it returns True for when it is a function of the job)."""
    client = Redis.from_url(settings.redis.url)
    store, blobs = JobStateStore(client), BlobStore(settings.paths.data_dir / "blobs")

    def run():
        for _ in range(num_jobs):
            # every level of the queue, taken as a CPU worker takes them
            popped = client.brpop(cpu_queue_lists(settings.celery.pre_queue), timeout=30)
            if popped is None:
                return
            job = protocol.decode(celery_args(popped[1])[0])
            store.record_event(JobEvent(job_id=job.job_id, status="preprocessing", at=time.time()))
            for step in range(1, job.steps + 1):
                time.sleep(0.05)
                store.record_event(
                    JobEvent(
                        job_id=job.job_id,
                        status="running",
                        at=time.time(),
                        step=step,
                        num_steps=job.steps,
                        worker_id="worker-0",
                    )
                )
            if fail is True or (callable(fail) and fail(job)):
                store.record_event(
                    JobEvent(job_id=job.job_id, status="failed", at=time.time(), message="boom")
                )
                continue
            result = sample_template(WIDTH, HEIGHT, seed=job.seed % 1000)
            ref = blobs.put("results", f"{job.job_id}.png", encode_image(result, "png"))
            thumb = blobs.put("thumbnails", f"{job.job_id}.webp", encode_image(result, "webp"))
            store.record_event(
                JobEvent(
                    job_id=job.job_id,
                    status="done",
                    at=time.time(),
                    result_ref=ref,
                    thumbnail_ref=thumb,
                    timings={"total_s": 0.2},
                )
            )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_client_upload_submit_wait_result(api):
    base, settings = api
    with MaskServeClient(base, KEY) as client:
        template = client.upload_template(IMAGE, name="Room", tags=["interior"])
        assert [t["id"] for t in client.templates(tag="interior")] == [template["id"]]
        pipeline = fake_pipeline(settings)
        job = client.submit(
            MASK, "a lamp", template_id=template["id"], seed=77, steps=3, invert=False
        )
        assert job["seed"] == 77
        seen = []
        final = client.wait(job["job_id"], timeout=30, on_event=seen.append)
        pipeline.join(5)
        assert final["status"] == "done" and final["seed"] == 77
        assert [e["status"] for e in seen] == [
            "preprocessing",
            "running",
            "running",
            "running",
            "done",
        ]
        png = client.result_bytes(job["job_id"])
        stored = JobStateStore(Redis.from_url(settings.redis.url)).get(job["job_id"])
        assert png == BlobStore(settings.paths.data_dir / "blobs").get(stored["result_ref"])
        assert "result_ref" not in final  # the client sees URLs, never blob refs
        assert client.result_bytes(job["job_id"], thumbnail=True)[:4] == b"RIFF"
        client.delete_template(template["id"])
        assert client.templates() == []


def test_client_errors_and_cancel(api):
    base, _settings = api
    with MaskServeClient(base, "wrong") as bad:
        with pytest.raises(MaskServeError) as err:
            bad.templates()
        assert err.value.status == 403
    with MaskServeClient(base, KEY) as client:
        with pytest.raises(MaskServeError) as err:
            client.submit(MASK, "x", image=IMAGE, steps=0)
        assert err.value.status == 422 and "steps 0" in err.value.message
        job = client.submit(MASK, "x", image=IMAGE)
        assert client.cancel(job["job_id"])["status"] == "cancelled"
        assert client.wait(job["job_id"], timeout=10)["status"] == "cancelled"
        with pytest.raises(MaskServeError) as err:
            client.cancel(job["job_id"])
        assert err.value.status == 409


def _args(argv):
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    return parser.parse_args(argv)


def test_submit_cli(api, tmp_path, capsys):
    base, settings = api
    (tmp_path / "image.png").write_bytes(IMAGE)
    (tmp_path / "mask.png").write_bytes(MASK)
    out = tmp_path / "edited.png"
    common = [
        "--url",
        base,
        "--image",
        str(tmp_path / "image.png"),
        "--mask",
        str(tmp_path / "mask.png"),
        "--prompt",
        "a vase",
        "--steps",
        "2",
    ]
    pipeline = fake_pipeline(settings)
    code = submit_cli(
        _args(common + ["--api-key", KEY, "--seed", "5", "--out", str(out), "--timeout", "30"])
    )
    pipeline.join(5)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (
        code == 0
        and lines[0]["seed"] == 5
        and lines[-1]["status"] == "done"
        and lines[-1]["out"] == str(out)
    )
    assert Image.open(out).size == (WIDTH, HEIGHT)
    # the key (and URL) may come from settings instead
    pipeline = fake_pipeline(settings, fail=True)
    code = submit_cli(_args(common + ["--timeout", "30"]), settings=settings)
    pipeline.join(5)
    assert code == 1 and json.loads(capsys.readouterr().out.splitlines()[-1])["status"] == "failed"
    # with no key configured, the one `maskserve up` wrote to the data directory
    stack_settings = load_settings(env={}, paths={"data_dir": str(tmp_path / "stack")})
    (tmp_path / "stack").mkdir()
    (tmp_path / "stack" / "api_key").write_text(KEY + "\n")
    pipeline = fake_pipeline(settings)
    keyed_out = ["--out", str(tmp_path / "keyed.png"), "--timeout", "30"]
    code = submit_cli(_args(common + keyed_out), settings=stack_settings)
    pipeline.join(5)
    assert code == 0 and json.loads(capsys.readouterr().out.splitlines()[-1])["status"] == "done"
    assert (tmp_path / "keyed.png").is_file()
    (tmp_path / "stack" / "api_key").unlink()  # no key anywhere: the server's 401, exit 2
    assert submit_cli(_args(common), settings=stack_settings) == 2
    assert "API key" in capsys.readouterr().err
    assert submit_cli(_args(common + ["--api-key", "wrong"])) == 2
    assert "not valid" in capsys.readouterr().err
    assert submit_cli(_args(common + ["--api-key", KEY, "--no-wait"])) == 0
    assert submit_cli(_args(common + ["--api-key", KEY, "--steps", "500"])) == 2
    assert "steps 500" in capsys.readouterr().err


def test_submit_cli_over_a_mask_folder_and_a_prompts_file(api, tmp_path, capsys):
    base, settings = api
    (tmp_path / "image.png").write_bytes(IMAGE)
    masks = tmp_path / "masks"
    masks.mkdir()
    for name in ("b-sofa.png", "a-lamp.png", "c-rug.png"):
        (masks / name).write_bytes(MASK)
    (masks / "notes.txt").write_text("not a mask")
    common = ["--url", base, "--api-key", KEY, "--image", str(tmp_path / "image.png")]
    common += ["--steps", "2", "--seed", "5", "--timeout", "30"]
    pipeline = fake_pipeline(settings, num_jobs=3, fail=lambda job: job.seed == 6)
    out = tmp_path / "out"
    code = submit_cli(_args([*common, "--masks", str(masks), "--prompt", "x", "--out", str(out)]))
    pipeline.join(5)
    captured = capsys.readouterr()
    accepted, report = (json.loads(line) for line in captured.out.splitlines())
    assert code == 1 and report["batch_id"] == accepted["batch_id"]  # one item failed
    assert [(i["mask"], i["status"]) for i in report["items"]] == [
        ("a-lamp.png", "done"),  # sorted by name; item i has seed 5 + i
        ("b-sofa.png", "failed"),
        ("c-rug.png", "done"),
    ]
    assert sorted(p.name for p in out.iterdir()) == ["0.png", "2.png", "manifest.json"]
    manifest = json.loads((out / "manifest.json").read_text())
    failed = manifest["items"][1]
    assert failed.pop("job_id") and failed == {
        "index": 1,
        "status": "failed",
        "prompt": "x",
        "seed": 6,
        "message": "boom",
    }
    assert "100%" in captured.err  # the progress bar over the whole batch reached its end
    # one mask and a prompts file: one item per prompt; counts that cannot pair are said first
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na dog\n")
    args = [*common, "--mask", str(masks / "a-lamp.png"), "--prompts", str(prompts), "--no-wait"]
    assert submit_cli(_args(args)) == 0
    assert (
        len(
            MaskServeClient(base, KEY).batch(json.loads(capsys.readouterr().out)["batch_id"])[
                "items"
            ]
        )
        == 2
    )
    prompts.write_text("one\ntwo\n")
    assert submit_cli(_args([*common, "--masks", str(masks), "--prompts", str(prompts)])) == 2
    assert "3 masks and 2 prompts" in capsys.readouterr().err
    assert submit_cli(_args(common)) == 2
    assert "--masks DIR" in capsys.readouterr().err


class ReplayingBatchClient:
    """A client whose batch of 3 items reports the progress given, in that order: as when the
    stream drops and its reconnect replays every item's events from the start."""

    def __init__(self, progress: list[float]):
        self.progress = progress

    def submit_batch(self, **_fields) -> dict:
        return {"batch_id": "b" * 32, "status": "queued", "status_url": "/v1/batches/b"} | {
            "items": [{}, {}, {}]
        }

    def wait_batch(self, _batch_id, timeout, on_event) -> dict:
        for progress in self.progress:
            on_event({"type": "batch", "progress": progress, "counts": {}})
        items = [{"index": i, "status": "done"} for i in range(3)]
        return {"status": "done", "counts": {"done": 3}, "progress": 1.0, "items": items}

    def batch_zip(self, _batch_id) -> bytes:
        buffer = io.BytesIO()
        zipfile.ZipFile(buffer, "w").close()
        return buffer.getvalue()


def test_the_batch_progress_bar_only_moves_forward_with_rounded_counts(tmp_path, capsys):
    masks = tmp_path / "masks"
    masks.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (masks / name).write_bytes(MASK)
    out = ["--out", str(tmp_path / "out")]
    args = _args(["--template-id", "t", "--masks", str(masks), "--prompt", "x", *out])
    client = ReplayingBatchClient([0.5, 0.91, 0.58, 0.9933, 1.0])  # 0.58: the replay
    assert run_batch(client, args, {}) == 0
    bar = capsys.readouterr().err
    shown = [int(percent) for percent in re.findall(r"(\d+)%\|", bar)]
    assert shown == sorted(shown) and 58 not in shown and shown[-1] == 100
    assert "2.97/3" in bar and "3/3" in bar and "2.9798" not in bar and "3.0/3" not in bar


def test_the_cli_prints_no_http_request_log_lines(api, tmp_path, caplog):
    base, _settings = api
    (tmp_path / "image.png").write_bytes(IMAGE)
    (tmp_path / "mask.png").write_bytes(MASK)
    argv = ["submit", "--url", base, "--api-key", KEY, "--no-wait", "--prompt", "a vase"]
    argv += ["--image", str(tmp_path / "image.png"), "--mask", str(tmp_path / "mask.png")]
    try:
        with caplog.at_level(logging.INFO):
            assert main(argv) == 0
    finally:
        logging.getLogger("httpx").setLevel(logging.NOTSET)
    assert not [record for record in caplog.records if record.name.startswith("httpx")]

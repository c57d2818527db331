"""Celery pre/post-processing against a real Redis broker and a real `maskserve cpu-worker` process,
with an engine worker in between: submit -> pre task -> hand-off stream -> worker -> post task ->
done."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

import pytest

from backend import protocol
from backend.blobs import BlobStore
from backend.config import load_settings
from backend.jobstate import JobStateStore
from backend.protocol import EditJob, JobEvent, ServiceLevel
from backend.protocol.keys import CPU_LEASES_KEY, CPU_TASK_LEVELS, cpu_task_key
from backend.services.redis_server import free_port
from backend.tasks.celery_app import (
    PREPARED_STREAM,
    cpu_leases,
    make_celery,
    resend_lapsed,
    submit_edit,
    task_stats,
)
from backend.tasks.leases import CLAIMED
from backend.worker.channels import LocalInbox
from backend.worker.loop import EngineWorker
from backend.worker.service import RedisSink
from templates_store.samples import sample_template
from tests.factories import make_engine, queued_tasks
from tests.test_cpu_stages import HEIGHT, WIDTH, assert_edited_inside_only, painted_mask, png

WAIT_S = 120  # the CPU worker loads its model on its first task


@pytest.fixture(scope="module")
def engine(models_dir, tmp_path_factory):
    # builds the model
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("celery-cache"))


def cpu_env(redis_url, models_dir, tmp_path) -> dict:
    """The environment of a `maskserve cpu-worker` of these tests (the tiny model, a free metrics
    port)."""
    return {
        **os.environ,
        "MASKSERVE_REDIS_URL": redis_url,
        "MASKSERVE_DATA_DIR": str(tmp_path),
        "MASKSERVE_MODELS_DIR": str(models_dir),
        "MASKSERVE_MODEL": "tiny-sd2-inpaint",
        "MASKSERVE_CPU_METRICS_PORT": str(free_port()),
    }


@contextmanager
def cpu_worker(env: dict, log_path):
    """A running `maskserve cpu-worker` subprocess, its output in ``log_path``."""
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "backend.cli", "cpu-worker"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def settings_of(env: dict):
    return load_settings(env={k: v for k, v in env.items() if k.startswith("MASKSERVE_")})


@pytest.fixture
def stack(redis_url, models_dir, tmp_path, engine):
    """Settings, Celery app, job state and a running `maskserve cpu-worker` subprocess."""
    env = cpu_env(redis_url, models_dir, tmp_path)
    settings = settings_of(env)
    app = make_celery(settings)
    from redis import Redis

    client = Redis.from_url(redis_url)
    try:
        with cpu_worker(env, tmp_path / "cpu-worker.log"):
            yield settings, app, JobStateStore(client), client
    finally:
        client.close()


def submit(settings, app, jobstate, job_id, template_bytes, mask_bytes) -> EditJob:
    job = edit_job(settings, job_id, template_bytes, mask_bytes)
    jobstate.create(job_id, prompt=job.prompt, seed=job.seed)
    submit_edit(app, job)
    return job


def edit_job(
    settings, job_id, template_bytes, mask_bytes, service: ServiceLevel | None = None
) -> EditJob:
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    return EditJob(
        job_id=job_id,
        model_id="tiny-sd2-inpaint",
        template_ref=blobs.put("uploads", f"{job_id}-t.png", template_bytes),
        mask_ref=blobs.put("uploads", f"{job_id}-m.png", mask_bytes),
        prompt="a blue vase",
        seed=9,
        steps=3,
        guidance=7.5,
        resolution=128,
        submitted_at=time.time(),
        service=service or ServiceLevel(),
    )


def wait_for(predicate, what: str, log_path):
    deadline = time.time() + WAIT_S
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(
        f"timed out waiting for {what}; cpu-worker log:\n{log_path.read_text()[-3000:]}"
    )


def handed_off(client) -> list:
    return [protocol.decode(fields[b"msg"]) for _, fields in client.xrange(PREPARED_STREAM)]


def test_a_job_runs_pre_and_post_on_celery_around_the_worker(stack, engine, tmp_path):
    settings, app, jobstate, client = stack
    template = sample_template(WIDTH, HEIGHT, seed=12)
    job = submit(settings, app, jobstate, "celery-1", png(template), png(painted_mask()))
    (prepared,) = wait_for(
        lambda: handed_off(client), "the pre-processed job", tmp_path / "cpu-worker.log"
    )
    assert prepared.job_id == job.job_id and jobstate.status(job.job_id) == "preprocessing"

    blobs = BlobStore(settings.paths.data_dir / "blobs")
    inbox = LocalInbox()
    worker = EngineWorker(engine, blobs, inbox, RedisSink(jobstate, app, settings))
    inbox.put(prepared)
    while not inbox.acked:
        worker.iterate()
    wait_for(
        lambda: jobstate.status(job.job_id) == "done",
        "the job to finish",
        tmp_path / "cpu-worker.log",
    )
    record = jobstate.get(job.job_id)
    assert set(record["timings"]) >= {
        "queue_s",
        "pre_s",
        "wait_s",
        "denoise_s",
        "post_s",
        "total_s",
    }
    assert record["step"] == record["num_steps"] == 3
    assert_edited_inside_only(blobs.get(record["result_ref"]), template)
    statuses = [e["status"] for _, e in jobstate.events(job.job_id)]
    assert statuses[0] == "preprocessing" and statuses[-2:] == ["postprocessing", "done"]
    url = f"http://127.0.0.1:{settings.celery.metrics_port}/metrics"
    # the task counts itself just after it marks the job done
    wait_for(
        lambda: task_stats(client)["tasks_total"].get("postprocess.done"),
        "the task count",
        tmp_path / "cpu-worker.log",
    )
    metrics = urllib.request.urlopen(url, timeout=5).read().decode()
    assert 'maskserve_cpu_tasks_total{key="preprocess.done"} 1.0' in metrics
    assert 'maskserve_cpu_tasks_total{key="postprocess.done"} 1.0' in metrics
    # the tasks waiting at each level of each CPU queue: none now
    for stage in ("pre", "post"):
        for level in CPU_TASK_LEVELS:
            assert f'maskserve_cpu_queued_tasks{{key="{stage}.{level}"}} 0.0' in metrics


def test_a_redelivered_pre_task_hands_its_job_off_once(stack, tmp_path):
    settings, app, jobstate, client = stack
    job = submit(
        settings,
        app,
        jobstate,
        "celery-twice",
        png(sample_template(WIDTH, HEIGHT)),
        png(painted_mask()),
    )
    submit_edit(app, job)  # the same task again, as a broker redelivery would
    submit(
        settings,
        app,
        jobstate,
        "celery-after",
        png(sample_template(WIDTH, HEIGHT)),
        png(painted_mask()),
    )
    # the queue is FIFO with one CPU process: once the later job is out, both copies have run
    wait_for(
        lambda: any(p.job_id == "celery-after" for p in handed_off(client)),
        "the later job",
        tmp_path / "cpu-worker.log",
    )
    assert [p.job_id for p in handed_off(client)].count("celery-twice") == 1


def test_a_bad_upload_fails_its_job_with_the_reason(stack, tmp_path):
    settings, app, jobstate, client = stack
    job = submit(
        settings, app, jobstate, "celery-bad", b"this is not a picture", png(painted_mask())
    )
    wait_for(
        lambda: jobstate.status(job.job_id) == "failed",
        "the job to fail",
        tmp_path / "cpu-worker.log",
    )
    assert "not an image" in jobstate.get(job.job_id)["message"]
    wait_for(
        lambda: task_stats(client)["tasks_total"] == {"preprocess.failed": 1.0},
        "the task count",
        tmp_path / "cpu-worker.log",
    )


def test_the_cpu_worker_builds_the_default_models_stages_before_its_first_task(stack, tmp_path):
    """A fresh worker warms its encoders as it starts, so the first job does not wait for them."""
    log_path = tmp_path / "cpu-worker.log"
    wait_for(
        lambda: "CPU stages of tiny-sd2-inpaint ready" in log_path.read_text(errors="replace"),
        "the CPU stages to be warmed",
        log_path,
    )
    _, _, _, client = stack
    assert client.xlen(PREPARED_STREAM) == 0  # before any task ran


def test_a_warm_up_that_fails_is_logged_and_the_task_reports_it(caplog, tmp_path):
    from backend.models import UnknownModelError
    from backend.tasks.celery_app import _Process

    state = _Process(load_settings(env={"MASKSERVE_DATA_DIR": str(tmp_path)}))
    state.warm("no-such-model").join(timeout=30)
    assert "warming the CPU stages of no-such-model failed" in caplog.text
    with pytest.raises(UnknownModelError):
        state.stages("no-such-model")


def test_a_pre_task_lost_with_its_worker_is_re_enqueued_and_hands_off_once(stack, tmp_path):
    settings, app, jobstate, client = stack
    template = sample_template(WIDTH, HEIGHT, seed=12)
    job = edit_job(settings, "lost-pre", png(template), png(painted_mask()))
    jobstate.create(job.job_id)
    # a CPU worker took the task and died mid-task: its lease is claimed and never renewed
    leases = cpu_leases(client, settings)
    assert leases.claim(job.job_id, "pre", protocol.encode(job), "dead", 3) == CLAIMED
    jobstate.record_event(JobEvent(job_id=job.job_id, status="preprocessing", at=time.time()))
    client.zadd(CPU_LEASES_KEY, {job.job_id: time.time() - 1})
    assert resend_lapsed(app, client, settings, jobstate) == 1
    assert "retrying" in jobstate.record(job.job_id).message
    (prepared,) = wait_for(
        lambda: handed_off(client), "the re-enqueued task", tmp_path / "cpu-worker.log"
    )
    assert prepared.job_id == job.job_id
    assert not client.exists(cpu_task_key(job.job_id))  # released: the stage is over
    submit_edit(app, job)  # the broker's own redelivery, after its visibility timeout
    wait_for(
        lambda: task_stats(client)["tasks_total"].get("preprocess.skipped"),
        "the late duplicate to be skipped",
        tmp_path / "cpu-worker.log",
    )
    assert [p.job_id for p in handed_off(client)] == [job.job_id]  # handed off once
    assert jobstate.record(job.job_id).redeliveries == 1


def test_a_task_that_raises_fails_its_job_instead_of_leaving_it_in_its_stage(stack, tmp_path):
    settings, app, jobstate, client = stack
    blobs = BlobStore(settings.paths.data_dir / "blobs")
    job = edit_job(settings, "poison-pre", b"", b"")
    blobs.local_path(job.template_ref).unlink()
    # reading it raises IsADirectoryError, every time
    (blobs.objects.root / job.template_ref).mkdir()
    jobstate.create(job.job_id)
    submit_edit(app, job)
    wait_for(
        lambda: jobstate.status(job.job_id) == "failed",
        "the job to fail",
        tmp_path / "cpu-worker.log",
    )
    assert "IsADirectoryError" in jobstate.record(job.job_id).message
    assert not client.exists(cpu_task_key(job.job_id)) and handed_off(client) == []


def test_queued_jobs_are_pre_processed_in_service_order_not_arrival_order(
    redis_url, models_dir, tmp_path, engine
):
    """A burst of batch jobs queued ahead of an interactive one: the CPU worker, started once
    all are queued, takes the interactive job (and a batch job of priority 9) first."""
    env = cpu_env(redis_url, models_dir, tmp_path)
    settings = settings_of(env)
    app = make_celery(settings)
    from redis import Redis

    client = Redis.from_url(redis_url)
    jobstate = JobStateStore(client)
    template, mask = png(sample_template(WIDTH, HEIGHT, seed=12)), png(painted_mask())
    levels = {f"bulk-{i}": ServiceLevel("batch") for i in range(4)}
    levels |= {"studio": ServiceLevel("interactive"), "urgent": ServiceLevel("batch", priority=9)}
    for job_id, level in levels.items():  # submitted in this order
        jobstate.create(job_id)
        submit_edit(app, edit_job(settings, job_id, template, mask, level))
    served_order = ["urgent", "studio", "bulk-0", "bulk-1", "bulk-2", "bulk-3"]
    queue = settings.celery.pre_queue
    assert [job.job_id for job in queued_tasks(client, queue)] == served_order
    queued = task_stats(client, {"pre": queue})["queued_tasks"]
    assert {k: v for k, v in queued.items() if v} == {"pre.1": 1.0, "pre.8": 1.0, "pre.9": 4.0}
    log_path = tmp_path / "cpu-worker.log"
    with cpu_worker(env, log_path):  # one process: it takes one task at a time
        wait_for(lambda: len(handed_off(client)) == len(levels), "every job handed off", log_path)
    assert [p.job_id for p in handed_off(client)] == served_order
    assert [p.service for p in handed_off(client)] == [levels[j] for j in served_order]
    assert not any(task_stats(client, {"pre": queue})["queued_tasks"].values())
    client.close()

"""The whole stack on this machine, every role its own process (`maskserve up`'s launcher): a job
submitted over REST comes back with the expected image and timings; a worker killed in the middle
of a job leaves it to the other worker, and it finishes exactly once."""

from __future__ import annotations

import io
import signal
import time

import pytest
from PIL import Image

from backend.client import MaskServeClient
from backend.jobstate import JobStateStore
from templates_store.samples import sample_template
from tests.stack_factory import running_stack
from tests.test_cpu_stages import HEIGHT, WIDTH, assert_edited_inside_only, painted_mask, png

API_KEY = "e2e-key"


@pytest.fixture
def stack(redis_url, redis_client, models_dir, tmp_path, monkeypatch):
    with running_stack(
        monkeypatch,
        tmp_path,
        redis_url,
        models_dir,
        ["w-a", "w-b"],
        {"MASKSERVE_API_KEYS": API_KEY},
    ) as (running, base):
        with MaskServeClient(base, API_KEY) as client:
            yield running, client, JobStateStore(redis_client)


def diagnose(running, jobstate, job_id) -> str:
    events = [event for _, event in jobstate.events(job_id)]
    logs = "\n".join(f"--- {name}\n{running.log_tail(name, 15)}" for name in running.processes)
    return f"job {jobstate.get(job_id)}\nevents {events}\n{logs}"


def wait_for_workers(client, count=2, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(list(client.scan_iter(match="maskserve:worker:*"))) >= count:
            return
        time.sleep(0.2)
    raise AssertionError("the engine workers did not start")


def test_a_job_over_rest_finishes_with_the_expected_image_and_timings(stack, redis_client):
    running, client, jobstate = stack
    wait_for_workers(redis_client)
    template = sample_template(WIDTH, HEIGHT, seed=21)
    accepted = client.submit(
        png(painted_mask()),
        prompt="a blue vase",
        image=png(template),
        steps=4,
        seed=5,
        resolution=128,
    )
    final = client.wait(accepted["job_id"], timeout=120)
    assert final["status"] == "done", final
    assert set(final["timings"]) >= {"queue_s", "pre_s", "wait_s", "denoise_s", "post_s", "total_s"}
    assert final["seed"] == 5 and final["worker_id"] in ("w-a", "w-b")
    assert_edited_inside_only(client.result_bytes(accepted["job_id"]), template)


def test_a_worker_killed_mid_job_leaves_it_to_the_other_which_finishes_it_once(stack, redis_client):
    running, client, jobstate = stack
    wait_for_workers(redis_client)
    template = sample_template(256, 256, seed=22)
    accepted = client.submit(
        png(painted_mask(size=(256, 256))),
        prompt="a red chair",
        image=png(template),
        steps=150,
        seed=6,
        resolution=256,
    )
    job_id = accepted["job_id"]
    deadline = time.time() + 120
    while time.time() < deadline:
        record = jobstate.get(job_id)
        if record["status"] == "running" and record.get("step", 0) >= 2:
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"the job never ran: {jobstate.get(job_id)}")
    victim = record["worker_id"]
    running.processes["worker-0" if victim == "w-a" else "worker-1"].send_signal(signal.SIGKILL)
    try:
        final = client.wait(job_id, timeout=60)
    except TimeoutError:
        raise AssertionError(diagnose(running, jobstate, job_id)) from None
    assert final["status"] == "done", diagnose(running, jobstate, job_id)
    assert final["worker_id"] != victim
    statuses = [event["status"] for _, event in jobstate.events(job_id)]
    assert statuses.count("done") == 1 and "waiting" in statuses[statuses.index("running") :]
    assert Image.open(io.BytesIO(client.result_bytes(job_id))).size == (256, 256)

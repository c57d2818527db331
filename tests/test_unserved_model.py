"""A job for a model no live worker serves (issue 17, item 5), over the real API app, a real Redis
and the real dispatcher loop; the pre-processing task is played by handing its ``PreparedJob`` off
exactly as the task does (``hand_off``), so no model runs.

* a model that no live worker serves and that the deployment does not configure is refused at
  submission (422), naming the models live workers serve and how to serve it;
* a configured model (the default, or listed in ``api.models``) is accepted before any worker of it
  beats; while it waits, its message and its event stream say it waits for a worker of its model
  and which models live workers serve (once, not at every retry of the dispatcher), and when a
  worker of its model beats it is routed and its message says where.
"""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from backend.api.app import create_app
from backend.config import load_settings
from backend.dispatch.router import WorkerView, waiting_note
from backend.dispatch.service import Dispatcher
from backend.models.catalog import DEFAULT_MODEL
from backend.protocol import JobEvent, PreparedJob
from backend.tasks.celery_app import hand_off
from tests.api_factory import IMAGE, KEY, make_settings, pre_queue_jobs, sse_events, submit
from tests.factories import queued_tasks
from tests.test_dispatcher import beat, inbox_jobs

FLUX = "tiny-flux-fill"
TINY_SD2 = "tiny-sd2-inpaint"


def app_client(settings, redis_client) -> TestClient:
    return TestClient(create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY})


def pre_process(redis_client, settings, jobstate) -> PreparedJob:
    """What the pre-processing task does with the one queued job: ``preprocessing``, then the
    prepared job handed off to the dispatcher's stream."""
    (job,) = pre_queue_jobs(redis_client, settings)
    jobstate.record_event(JobEvent(job_id=job.job_id, status="preprocessing", at=time.time()))
    prepared = PreparedJob(
        job_id=job.job_id,
        model_id=job.model_id,
        prepared_ref=f"prepared/{job.job_id}.safetensors",
        template_ref=job.template_ref,
        num_steps=job.steps,
        mask_ratio=0.2,
        cache_digest="",
        submitted_at=job.submitted_at,
    )
    assert hand_off(redis_client, prepared) is not None
    return prepared


def dispatch(settings, redis_client, dispatcher: Dispatcher | None = None, times: int = 3):
    dispatcher = dispatcher or Dispatcher(settings, redis_client, consumer="d")
    for _ in range(times):
        time.sleep(0.011)  # let the worker check come due
        dispatcher.iterate(block_ms=10)
    return dispatcher


def messages(jobstate, job_id) -> list[str]:
    """The messages in the job's event stream (what its server-sent events replay)."""
    return [event["message"] for _, event in jobstate.events(job_id) if event.get("message")]


def test_an_unconfigured_model_no_live_worker_serves_is_refused_saying_what_is_served(
    redis_url, redis_client, tmp_path
):
    settings = make_settings(redis_url, tmp_path)
    assert settings.engine.model_id == DEFAULT_MODEL and not settings.api.models
    with app_client(settings, redis_client) as client:
        refused = submit(client, model=FLUX)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert f"no worker serves model '{FLUX}'" in error and "no worker is live" in error
        assert f"maskserve worker --model {FLUX}" in error and "MASKSERVE_API_MODELS" in error
        beat(redis_client, "demo-worker", model_id=DEFAULT_MODEL)
        beat(redis_client, "sd2-worker", model_id=TINY_SD2)
        refused = submit(client, model=FLUX)
        assert refused.status_code == 422
        assert f"live workers serve {DEFAULT_MODEL}, {TINY_SD2}" in refused.json()["error"]
        assert queued_tasks(redis_client, settings.celery.pre_queue) == []  # nothing queued
        # an erase never reaches a worker: its model is not asked for
        assert submit(client, model=FLUX, mode="erase").status_code == 202
        # a model a live worker serves is accepted, configured or not; so is the default
        assert submit(client, model=TINY_SD2).status_code == 202
        assert submit(client).status_code == 202
        # a template's cache recording for an unserved model is refused the same way
        template_id = client.post(
            "/v1/templates", files={"file": ("t.png", IMAGE, "image/png")}
        ).json()["id"]
        prepare = client.post(f"/v1/templates/{template_id}/prepare", data={"model": FLUX})
        assert prepare.status_code == 422 and "no worker serves model" in prepare.json()["error"]


def test_the_default_model_is_accepted_before_any_worker_beats(redis_url, redis_client, tmp_path):
    settings = make_settings(redis_url, tmp_path)
    with app_client(settings, redis_client) as client:
        response = submit(client, model=DEFAULT_MODEL)
        assert response.status_code == 202, response.text


def test_a_configured_model_waits_for_its_worker_saying_so_then_is_routed(
    redis_url, redis_client, tmp_path
):
    settings = make_settings(redis_url, tmp_path, models=(DEFAULT_MODEL, FLUX))
    quick = settings.dispatcher.model_copy(update={"check_every_s": 0.01})  # re-reads workers
    settings = settings.model_copy(update={"dispatcher": quick})
    with app_client(settings, redis_client) as client:
        accepted = submit(client, model=FLUX)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["job_id"]
        jobstate = client.app.state.service.jobstate
        pre_process(redis_client, settings, jobstate)
        beat(redis_client, "demo-worker", model_id=DEFAULT_MODEL)
        dispatcher = dispatch(settings, redis_client, times=5)
        waiting = f"waiting for a worker that serves {FLUX} (live workers serve: {DEFAULT_MODEL})"
        shown = client.get(f"/v1/jobs/{job_id}").json()
        assert shown["status"] == "waiting" and shown["message"] == waiting
        assert messages(jobstate, job_id) == [waiting]  # said once, not at every retry
        assert inbox_jobs(redis_client, "demo-worker") == []
        beat(redis_client, "flux-worker", model_id=FLUX)
        dispatch(settings, redis_client, dispatcher)
        assert inbox_jobs(redis_client, "flux-worker") == [job_id]
        routed = f"routed to worker flux-worker, which serves {FLUX}"
        shown = client.get(f"/v1/jobs/{job_id}").json()
        assert shown["worker_id"] == "flux-worker" and shown["message"] == routed
        assert messages(jobstate, job_id) == [waiting, routed]
        # the server-sent events say the same (the stream ends with the job)
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
        events = sse_events(client.get(f"/v1/jobs/{job_id}/events").text)
        said = [event["message"] for event in events if event.get("message")]
        assert said == [waiting, routed, "cancelled by the user"]


def test_the_waiting_note_names_the_served_models_or_none():
    def view(worker_id: str, model_id: str) -> WorkerView:
        return WorkerView(worker_id, model_id, "cpu", 8)

    assert waiting_note(FLUX, []) == f"waiting for a worker that serves {FLUX} (no worker is live)"
    workers = [view("b", TINY_SD2), view("a", DEFAULT_MODEL), view("c", TINY_SD2)]
    assert waiting_note(FLUX, workers) == (
        f"waiting for a worker that serves {FLUX} (live workers serve: {DEFAULT_MODEL}, {TINY_SD2})"
    )
    assert waiting_note(TINY_SD2, workers) is None  # served: only busy


@pytest.mark.parametrize("late_binding", [False, True])
def test_a_served_but_busy_model_says_nothing_new_until_it_had_said_it_waits(
    redis_url, redis_client, late_binding
):
    """A job told it waits for a worker of its model, whose worker then beats full (late
    binding), says it waits for a free slot; one never told says nothing (it is only busy)."""
    from backend import protocol

    settings = load_settings(
        env={},
        redis={"url": redis_url},
        dispatcher={"check_every_s": 0.01, "late_binding": late_binding},
    )
    jobstate = Dispatcher(settings, redis_client, consumer="d").jobstate
    jobstate.create("lonely", model_id=TINY_SD2)
    hand_off(
        redis_client,
        PreparedJob(
            job_id="lonely",
            model_id=TINY_SD2,
            prepared_ref="prepared/lonely.safetensors",
            template_ref="uploads/t.png",
            num_steps=4,
            mask_ratio=0.1,
            cache_digest="",
        ),
    )
    dispatcher = dispatch(settings, redis_client)
    rows = [
        protocol.RunningRow(job_id=f"r{i}", mask_ratio=0.1, remaining_steps=3, template="")
        for i in range(8)
    ]
    beat(redis_client, "full", model_id=TINY_SD2, running=rows)  # max_batch 8: no slack
    dispatch(settings, redis_client, dispatcher)
    said = [e.get("message", "") for _, e in jobstate.events("lonely")]
    if late_binding:
        assert said[-1] == f"waiting for a free slot on a worker that serves {TINY_SD2}"
        assert inbox_jobs(redis_client, "full") == []
    else:  # queued on the least loaded worker at once
        assert said[-1] == f"routed to worker full, which serves {TINY_SD2}"
        assert inbox_jobs(redis_client, "full") == ["lonely"]

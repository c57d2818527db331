"""Service classes, deadlines and priorities through the real API app on a real Redis (issue 20):
the request's fields and their defaults, 422 for bad ones with nothing stored, admission control's
429 (``Retry-After``, the reason, nothing stored) or late acceptance, the job record's deadline,
forecast and ``met_deadline``, the metrics, the client and CLI flags, and pre-processing carrying
the service level onto the prepared job."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from backend import protocol
from backend.api.app import create_app
from backend.api.service_levels import MAX_DEADLINE_S, mask_ratio_estimate, service_level
from backend.client import MaskServeClient, MaskServeError, add_submit_arguments, submit_cli
from backend.config import load_settings
from backend.config_deadlines import DeadlineSettings
from backend.jobstate import JobStateStore
from backend.models.catalog import DEFAULT_MODEL
from backend.protocol import JobEvent, RunningRow, ServiceLevel, WaitingRow, WorkerHeartbeat
from backend.protocol.keys import JOB_PATTERN, UNSTARTED_KEY, heartbeat_key
from tests.api_factory import IMAGE, KEY, make_settings, pre_queue_jobs, submit

LIFECYCLE = ("preprocessing", "waiting", "running", "postprocessing")


# ``settings`` and ``client``: the fixtures of tests/api_factory.py


def stored_blobs(settings) -> list:
    root = settings.paths.data_dir / "blobs"
    return [path for path in root.rglob("*") if path.is_file()] if root.exists() else []


def job_keys(redis_client) -> list:
    return list(redis_client.scan_iter(match=JOB_PATTERN))


def crowded_worker(redis_client, worker_id="w1", rows=10, due_s=2.0) -> None:
    """A live worker of the default model with one slot held for 150 steps and ``rows`` more
    waiting, every one due within ``due_s``: a new job waits for all of them."""
    now = time.time()
    beat = WorkerHeartbeat(
        worker_id=worker_id,
        model_id=DEFAULT_MODEL,
        device="cpu",
        at=now,
        max_batch=1,
        batching="continuous",
        running=[RunningRow("r0", 0.2, 150, deadline=now + due_s)],
        waiting=[WaitingRow(f"q{i}", 0.2, 150, deadline=now + due_s) for i in range(rows)],
        stats={"steps": 10, "mean_step_s": 0.05},
    )
    redis_client.set(heartbeat_key(worker_id), protocol.encode(beat), ex=30)


def metric(client, name: str, **labels) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ----- the request's fields ---------------------------------------------------------------------
def test_a_rest_job_defaults_to_batch_with_the_batch_target(client, redis_client, settings):
    before = time.time()
    accepted = submit(client)
    assert accepted.status_code == 202, accepted.text
    job = client.get(f"/v1/jobs/{accepted.json()['job_id']}").json()
    assert job["service_class"] == "batch" and job["priority"] == 0 and job["late"] is False
    target = settings.deadlines.batch_target_s
    assert before + target <= job["deadline"] <= time.time() + target
    (edit,) = pre_queue_jobs(redis_client, settings)
    assert edit.service == ServiceLevel("batch", job["deadline"], 0, False)
    assert edit.submitted_at == pytest.approx(job["deadline"] - target)


def test_each_field_is_taken_and_the_interactive_default_is_its_target(client, redis_client):
    given = submit(client, service_class="interactive", deadline_s="20", priority="5").json()
    shown = client.get(f"/v1/jobs/{given['job_id']}").json()
    assert (shown["service_class"], shown["priority"]) == ("interactive", 5)
    assert shown["deadline"] == pytest.approx(shown["created_at"] + 20.0, abs=1.0)
    default = submit(client, service_class="interactive").json()
    shown = client.get(f"/v1/jobs/{default['job_id']}").json()
    target = DeadlineSettings().interactive_target_s
    assert shown["deadline"] == pytest.approx(shown["created_at"] + target, abs=1.0)
    longer = submit(client, deadline_s="3600.5").json()  # batch, its own deadline
    shown = client.get(f"/v1/jobs/{longer['job_id']}").json()
    assert shown["deadline"] == pytest.approx(shown["created_at"] + 3600.5, abs=1.0)


BAD_LEVELS = [
    ({"service_class": "urgent"}, "service_class 'urgent' is not known: use interactive"),
    ({"deadline_s": "0"}, "deadline_s 0.0 is out of range: use a value in (0, 604800"),
    ({"deadline_s": "-5"}, "deadline_s -5.0 is out of range"),
    ({"deadline_s": str(MAX_DEADLINE_S + 1)}, "deadline_s 604801.0 is out of range"),
    ({"deadline_s": "nan"}, "deadline_s must be a finite number"),
    ({"deadline_s": "soon"}, "deadline_s"),
    ({"priority": "10"}, "priority 10 is out of range: use a value in [0, 9]"),
    ({"priority": "-1"}, "priority -1 is out of range"),
    ({"priority": "high"}, "priority"),
]


@pytest.mark.parametrize("fields, message", BAD_LEVELS, ids=[str(f) for f, _ in BAD_LEVELS])
def test_bad_service_fields_are_422_saying_what_to_fix_and_store_nothing(
    client, redis_client, settings, fields, message
):
    response = submit(client, **fields)
    assert response.status_code == 422, response.text
    assert message in response.json()["error"]
    assert pre_queue_jobs(redis_client, settings) == []
    assert job_keys(redis_client) == [] and stored_blobs(settings) == []
    assert redis_client.zcard(UNSTARTED_KEY) == 0


def test_service_level_checks_without_http():
    levels = DeadlineSettings(interactive_target_s=12.0)
    assert service_level(None, None, None, levels, 100.0) == ServiceLevel("batch", 700.0, 0)
    assert service_level("interactive", None, 3.0, levels, 100.0).deadline == 112.0
    with pytest.raises(ValueError, match="priority must be a whole number"):
        service_level("batch", 5.0, 2.5, levels, 0.0)
    with pytest.raises(ValueError, match="deadline_s must be a number"):
        service_level("batch", True, 0, levels, 0.0)


def test_the_mask_ratio_estimate_is_the_painted_share_or_the_boxes_for_a_crop():
    import numpy as np

    painted = np.zeros((10, 20), dtype=bool)
    painted[2:4, 5:10] = True  # 10 of 200 pixels, all of its 2x5 box
    assert mask_ratio_estimate(painted, "whole") == pytest.approx(0.05)
    assert mask_ratio_estimate(painted, "masked") == 1.0
    assert mask_ratio_estimate(np.zeros((4, 4), dtype=bool), "whole") == 0.0


def test_a_prepare_job_is_batch(client, redis_client, settings):
    template_id = client.post(
        "/v1/templates", files={"file": ("t.png", IMAGE, "image/png")}, data={"name": "room"}
    ).json()["id"]
    accepted = client.post(f"/v1/templates/{template_id}/prepare")
    assert accepted.status_code == 202, accepted.text
    shown = client.get(f"/v1/jobs/{accepted.json()['job_id']}").json()
    assert shown["kind"] == "prepare" and shown["service_class"] == "batch"
    (job,) = pre_queue_jobs(redis_client, settings)
    assert job.service.service_class == "batch" and job.service.deadline == shown["deadline"]


# ----- admission control through the app --------------------------------------------------------
def test_a_batch_job_far_past_its_deadline_is_429_with_retry_after_and_nothing_stored(
    client, redis_client, settings
):
    crowded_worker(redis_client)
    response = submit(client, deadline_s="1")
    assert response.status_code == 429, response.text
    retry = int(response.headers["Retry-After"])
    body = response.json()
    assert body["reason"] == "deadline" and body["service_class"] == "batch"
    assert body["retry_after_s"] == retry >= 1
    assert body["predicted_latency_s"] > 2 * body["deadline_s"]
    for words in ("batch job refused (deadline bound)", "Retry in", "longer deadline_s"):
        assert words in body["error"], body["error"]
    assert pre_queue_jobs(redis_client, settings) == []
    assert job_keys(redis_client) == [] and stored_blobs(settings) == []
    assert client.get("/v1/jobs").json() == {"jobs": []}
    assert metric(client, "maskserve_api_shed_total", **{"class": "batch", "reason": "deadline"})
    # a deadline the queue fits is accepted, with the API's forecast on the record
    accepted = submit(client, deadline_s="3600")
    assert accepted.status_code == 202, accepted.text
    shown = client.get(f"/v1/jobs/{accepted.json()['job_id']}").json()
    assert shown["late"] is False
    assert shown["created_at"] < shown["predicted_start"] < shown["predicted_finish"]


def test_an_interactive_job_past_its_deadline_is_accepted_late(client, redis_client, settings):
    crowded_worker(redis_client)
    response = submit(client, service_class="interactive", deadline_s="1")
    assert response.status_code == 202, response.text
    shown = client.get(f"/v1/jobs/{response.json()['job_id']}").json()
    assert shown["late"] is True and shown["service_class"] == "interactive"
    assert shown["predicted_finish"] - shown["created_at"] > 2.0
    (edit,) = pre_queue_jobs(redis_client, settings)
    assert edit.service.late is True
    assert metric(client, "maskserve_api_accepted_late_total", **{"class": "interactive"}) == 1


def test_rows_due_later_do_not_refuse_a_tight_job(client, redis_client):
    crowded_worker(redis_client, due_s=86_400.0)  # a day of slack each: parked for it
    response = submit(client, deadline_s="5")
    assert response.status_code == 202, response.text
    shown = client.get(f"/v1/jobs/{response.json()['job_id']}").json()
    assert shown["late"] is False and shown["predicted_start"] <= time.time()


def test_without_a_live_worker_nothing_is_refused_on_prediction(client):
    response = submit(client, deadline_s="0.001", steps="150")
    assert response.status_code == 202, response.text
    shown = client.get(f"/v1/jobs/{response.json()['job_id']}").json()
    assert shown["late"] is False and "predicted_finish" not in shown


def test_the_queue_bound_refuses_batch_and_marks_interactive_late(
    redis_url, redis_client, tmp_path
):
    settings = make_settings(redis_url, tmp_path, deadlines={"max_queue": 2})
    app = create_app(settings, redis_client=redis_client)
    with TestClient(app, headers={"X-API-Key": KEY}) as client:
        first, second = submit(client), submit(client)
        assert (first.status_code, second.status_code) == (202, 202)
        refused = submit(client)
        assert refused.status_code == 429 and refused.json()["reason"] == "queue"
        assert int(refused.headers["Retry-After"]) >= 1
        assert "2 jobs are accepted and not running yet, the bound is 2" in refused.json()["error"]
        assert len(job_keys(redis_client)) == 2  # the two accepted jobs only
        late = submit(client, service_class="interactive")
        assert late.status_code == 202
        assert client.get(f"/v1/jobs/{late.json()['job_id']}").json()["late"] is True
        # a job that starts running leaves the queue: batch is accepted again
        store = JobStateStore(redis_client)
        store.record_event(
            JobEvent(job_id=first.json()["job_id"], status="running", at=time.time(), step=1)
        )
        store.record_event(JobEvent(job_id=late.json()["job_id"], status="failed", at=time.time()))
        assert submit(client).status_code == 202
        assert metric(client, "maskserve_api_shed_total", **{"class": "batch", "reason": "queue"})


def test_the_429_is_documented_on_submit(client):
    spec = client.get("/openapi.json").json()
    documented = spec["paths"]["/v1/jobs"]["post"]["responses"]["429"]
    assert "admission control" in documented["description"]
    assert "Retry-After" in documented["headers"]
    schema = documented["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    fields = spec["components"]["schemas"][schema]["properties"]
    assert {"error", "reason", "retry_after_s", "predicted_latency_s", "deadline_s"} <= set(fields)
    form = spec["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["multipart/form-data"]
    body = spec["components"]["schemas"][form["schema"]["$ref"].rsplit("/", 1)[1]]["properties"]
    assert {"service_class", "deadline_s", "priority"} <= set(body)


# ----- the record: forecast, queue position, met_deadline ---------------------------------------
def run_to(store: JobStateStore, job_id: str, status: str, at: float, **fields) -> None:
    for stage in LIFECYCLE:
        store.record_event(JobEvent(job_id=job_id, status=stage, at=at - 1.0, worker_id="w1"))
    store.record_event(JobEvent(job_id=job_id, status=status, at=at, **fields))


def test_met_deadline_is_set_when_the_job_is_done_and_counted_by_class(client, redis_client):
    store = JobStateStore(redis_client)
    on_time = submit(client, service_class="interactive", deadline_s="30").json()["job_id"]
    too_late = submit(client, deadline_s="30").json()["job_id"]
    failed = submit(client, deadline_s="30").json()["job_id"]
    running = client.get(f"/v1/jobs/{on_time}").json()
    assert "met_deadline" not in running
    run_to(store, on_time, "done", time.time())
    run_to(store, too_late, "done", time.time() + 60.0)
    run_to(store, failed, "failed", time.time(), message="boom")
    assert client.get(f"/v1/jobs/{on_time}").json()["met_deadline"] is True
    assert client.get(f"/v1/jobs/{too_late}").json()["met_deadline"] is False
    assert "met_deadline" not in client.get(f"/v1/jobs/{failed}").json()
    # the terminal status is applied once: a second done changes nothing
    store.record_event(JobEvent(job_id=on_time, status="done", at=time.time()))
    deadline_metric = "maskserve_jobs_deadline_total"
    assert metric(client, deadline_metric, **{"class": "interactive", "met": "true"}) == 1
    assert metric(client, deadline_metric, **{"class": "batch", "met": "false"}) == 1
    assert metric(client, deadline_metric, **{"class": "batch", "met": "true"}) == 0
    assert redis_client.zcard(UNSTARTED_KEY) == 0


def test_the_record_keeps_the_latest_forecast_its_worker_reports(client, redis_client):
    store = JobStateStore(redis_client)
    job_id = submit(client).json()["job_id"]
    start, finish = time.time() + 5.0, time.time() + 9.0
    store.record_event(JobEvent(job_id=job_id, status="preprocessing", at=time.time()))
    store.record_event(
        JobEvent(
            job_id=job_id,
            status="waiting",
            at=time.time(),
            worker_id="w1",
            queue_position=3,
            predicted_start=start,
            predicted_finish=finish,
        )
    )
    shown = client.get(f"/v1/jobs/{job_id}").json()  # no heartbeat lists it: the report's
    assert shown["queue_position"] == 3
    assert (shown["predicted_start"], shown["predicted_finish"]) == (start, finish)
    # an event without a forecast keeps the latest one
    store.record_event(JobEvent(job_id=job_id, status="waiting", at=time.time(), worker_id="w1"))
    assert client.get(f"/v1/jobs/{job_id}").json()["queue_position"] == 3
    # the heartbeat's live place wins
    beat = WorkerHeartbeat(
        worker_id="w1",
        model_id=DEFAULT_MODEL,
        device="cpu",
        at=time.time(),
        max_batch=1,
        batching="continuous",
        waiting=[WaitingRow(job_id, 0.2, 4)],
    )
    redis_client.set(heartbeat_key("w1"), protocol.encode(beat), ex=5)
    assert client.get(f"/v1/jobs/{job_id}").json()["queue_position"] == 1
    later = finish + 2.0
    store.record_event(
        JobEvent(
            job_id=job_id,
            status="running",
            at=time.time(),
            step=1,
            num_steps=4,
            worker_id="w1",
            predicted_finish=later,
        )
    )
    shown = client.get(f"/v1/jobs/{job_id}").json()
    assert "queue_position" not in shown and shown["predicted_finish"] == later
    events = [event for _, event in store.events(job_id)]  # what the event stream sends
    assert [e.get("queue_position") for e in events if e["status"] == "waiting"][0] == 3
    assert events[-1]["predicted_finish"] == later


def test_the_unstarted_set_follows_the_jobs_and_heals_itself(client, redis_client):
    store = JobStateStore(redis_client)
    ids = [submit(client, deadline_s=str(60 * (i + 1))).json()["job_id"] for i in range(3)]
    count, jobs = store.unstarted()
    assert count == 3 and [job.job_id for job in jobs] == ids  # earliest deadline first
    assert {job.model_id for job in jobs} == {DEFAULT_MODEL} and jobs[0].steps == 4
    store.record_event(JobEvent(job_id=ids[0], status="running", at=time.time(), step=1))
    assert store.unstarted()[0] == 2
    # a requeued job (its worker died) is waiting again: back in the set
    assert store.requeue(ids[0], "its worker was lost", max_redeliveries=3) == 1
    assert store.unstarted()[0] == 3
    # an entry whose job is gone is dropped when met
    redis_client.delete(f"maskserve:job:{ids[1]}")
    assert store.unstarted()[0] == 2 and redis_client.zcard(UNSTARTED_KEY) == 2


# ----- the client and `maskserve submit` --------------------------------------------------------
def test_the_client_sends_the_service_fields_and_reads_a_429():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        return httpx.Response(
            429,
            json={"error": "batch job refused (queue bound)", "reason": "queue"},
            headers={"Retry-After": "12"},
        )

    client = MaskServeClient("http://api", "k", transport=httpx.MockTransport(handler))
    with pytest.raises(MaskServeError) as err:
        client.submit(b"mask", image=b"img", service_class="interactive", deadline_s=20, priority=5)
    assert err.value.status == 429 and err.value.retry_after == 12.0
    assert err.value.detail == {"reason": "queue"} and "queue bound" in err.value.message
    body = seen[0]
    for name, value in (
        ("service_class", b"interactive"),
        ("deadline_s", b"20"),
        ("priority", b"5"),
    ):
        assert f'name="{name}"'.encode() in body and value in body


def test_the_cli_flags_reach_the_request(monkeypatch, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_submit_arguments(parser)
    args = parser.parse_args(
        ["--image", "i.png", "--mask", "m.png", "--class", "interactive", "--deadline-s", "20"]
        + ["--priority", "5", "--no-wait", "--url", "http://api", "--api-key", "k"]
    )
    assert (args.service_class, args.deadline_s, args.priority) == ("interactive", 20.0, 5)
    sent = {}

    class Recording(MaskServeClient):
        def submit(self, mask, prompt="", template_id=None, image=None, **params):
            sent.update(params)
            raise MaskServeError(429, "refused", retry_after=7.0)

    monkeypatch.setattr("backend.client.MaskServeClient", Recording)
    assert submit_cli(args) == 2
    assert (sent["service_class"], sent["deadline_s"], sent["priority"]) == ("interactive", 20.0, 5)
    assert "retry after 7 s" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--image", "i", "--mask", "m", "--class", "urgent"])


# ----- pre-processing carries the service level -------------------------------------------------
def test_pre_processing_copies_the_service_level_onto_the_prepared_job(models_dir, tmp_path):
    import io

    from backend.blobs import BlobStore
    from backend.protocol import EditJob
    from backend.tasks.core import CpuStages
    from templates_store.samples import sample_template
    from tests.factories import make_engine

    settings = load_settings(
        env={}, paths={"data_dir": str(tmp_path), "models_dir": str(models_dir)}
    )
    engine = make_engine("sd2-inpaint", models_dir, tmp_path / "cache")
    stages = CpuStages(settings, engine, blobs=BlobStore(tmp_path / "blobs"))
    buffer = io.BytesIO()
    sample_template(64, 64, seed=1).save(buffer, format="PNG")
    mask = io.BytesIO()
    from PIL import Image

    painted = Image.new("L", (64, 64), 0)
    painted.paste(255, (8, 8, 40, 40))
    painted.save(mask, format="PNG")
    level = ServiceLevel("interactive", 1234.5, 7, True)
    common = dict(
        model_id=engine.spec.model_id,
        template_ref=stages.blobs.put("uploads", "t.png", buffer.getvalue()),
        prompt="a vase",
        seed=1,
        steps=2,
        guidance=7.5,
        resolution=64,
        service=level,
    )
    mask_ref = stages.blobs.put("uploads", "m.png", mask.getvalue())
    edit = stages.preprocess(EditJob(job_id="e1", mask_ref=mask_ref, **common))
    recording = stages.preprocess(EditJob(job_id="p1", mask_ref="", prepare=True, **common))
    assert edit.service == level and recording.service == level

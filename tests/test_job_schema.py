"""The job record as one typed schema (issue 17, item 12), over the real API app and a real Redis.

* the OpenAPI schema of ``GET /v1/jobs/{id}`` and ``GET /v1/jobs`` documents every field a client
  sees, typed (status an enum, counts integers, timings an object of numbers), and none of the
  services' own fields; ``JobView`` stays field for field in step with ``protocol.JobRecord``;
* what the routes answer matches that schema, leaving out only what the job does not have yet;
* a cancelled or failed job reports the timings of the stages it went through and ``total_s``
  (creation to the end), in its record and in its terminal event, as a done job does.
"""

from __future__ import annotations

import dataclasses
import time
import typing

import pytest
from fastapi.testclient import TestClient

from backend.api.app import create_app
from backend.api.schemas import JobStatus, JobView
from backend.jobstate import JobStateStore
from backend.protocol import INTERNAL_JOB_FIELDS, JOB_STATES, JobEvent, JobRecord
from backend.protocol.keys import job_key
from backend.protocol.records import STAGE_TIMINGS, UNSET_JOB_FIELDS
from tests.test_api import KEY, make_settings, sse_events, submit

# what the API adds to the record: its links
API_FIELDS = {"status_url", "events_url", "result_url", "thumbnail_url"}
# left out until the job has them: its place in a worker's queue, its forecast, met_deadline
# fields a job leaves out until it has them (batch_index: shown with its batch_id only)
UNSET = set(UNSET_JOB_FIELDS) | {"batch_index"}


@pytest.fixture
def client(redis_url, redis_client, tmp_path):
    app = create_app(make_settings(redis_url, tmp_path), redis_client=redis_client)
    with TestClient(app, headers={"X-API-Key": KEY}) as test_client:
        yield test_client


def resolve(spec: dict, node: dict) -> dict:
    ref = node.get("$ref")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else node


def ok_schema(spec: dict, path: str) -> dict:
    content = spec["paths"][path]["get"]["responses"]["200"]["content"]
    return resolve(spec, content["application/json"]["schema"])


def test_the_openapi_schema_types_every_field_a_client_sees(client):
    spec = client.get("/openapi.json").json()
    job = ok_schema(spec, "/v1/jobs/{job_id}")
    fields = job["properties"]
    assert fields["status"]["enum"] == list(JOB_STATES)
    assert fields["kind"]["enum"] == ["edit", "prepare"]
    for name in ("steps", "step", "num_steps", "seed", "width", "height", "redeliveries"):
        assert fields[name]["type"] == "integer", name
    for name in ("guidance", "strength", "created_at", "updated_at"):
        assert fields[name]["type"] == "number", name
    assert fields["use_cache"]["type"] == "boolean"
    timings = fields["timings"]
    assert timings["type"] == "object" and timings["additionalProperties"] == {"type": "number"}
    assert "total_s" in timings["description"]
    mask_ops = resolve(spec, fields["mask_ops"])["properties"]
    assert mask_ops["threshold"]["type"] == "integer" and mask_ops["invert"]["type"] == "boolean"
    assert not INTERNAL_JOB_FIELDS & set(fields)  # no template_ref, owner, ...
    assert {f"{status}_at" for status in JOB_STATES} <= set(fields)
    assert API_FIELDS <= set(fields)
    # always there: a field left out only when the job does not have it yet
    optional = {f"{status}_at" for status in JOB_STATES} | UNSET | {"thumbnail_url"}
    assert set(job["required"]) == set(fields) - optional
    listed = ok_schema(spec, "/v1/jobs")["properties"]["jobs"]
    assert resolve(spec, listed["items"]) == job
    accepted = spec["paths"]["/v1/jobs"]["post"]["responses"]["202"]["content"]
    assert {"job_id", "seed", "status_url"} <= set(
        resolve(spec, accepted["application/json"]["schema"])["properties"]
    )


def test_the_view_is_the_record_less_internal_fields_plus_what_the_api_adds():
    record = {f.name for f in dataclasses.fields(JobRecord)} - {"reached_at"}
    reached = {f"{status}_at" for status in JOB_STATES}
    assert set(JobView.model_fields) == (record - INTERNAL_JOB_FIELDS) | reached | API_FIELDS
    assert typing.get_args(JobStatus) == JOB_STATES


def test_a_job_as_answered_matches_its_schema_and_leaves_out_only_what_it_has_not(
    client, redis_client
):
    job_id = submit(client).json()["job_id"]
    shown = client.get(f"/v1/jobs/{job_id}").json()
    JobView.model_validate(shown)
    assert shown["status"] == "queued" and shown["timings"] == {}
    assert "queued_at" in shown and "running_at" not in shown and "done_at" not in shown
    assert "thumbnail_url" not in shown and "queue_position" not in shown
    assert None not in shown.values()  # absent, never null
    assert set(shown) == set(JobView.model_fields) - {
        f"{status}_at" for status in JOB_STATES if status != "queued"
    } - UNSET - {"thumbnail_url"}
    assert client.get("/v1/jobs").json() == {"jobs": [shown]}


def test_a_cancelled_job_reports_the_timings_of_its_stages_and_total(client, redis_client):
    store = JobStateStore(redis_client)
    job_id = submit(client).json()["job_id"]
    created = time.time() - 10.0  # submitted 10 s ago
    redis_client.hset(job_key(job_id), mapping={"created_at": created, "queued_at": created})
    store.record_event(JobEvent(job_id=job_id, status="preprocessing", at=created + 1.0))
    store.record_event(JobEvent(job_id=job_id, status="waiting", at=created + 3.0))
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
    shown = client.get(f"/v1/jobs/{job_id}").json()
    timings = shown["timings"]
    assert shown["status"] == "cancelled"
    assert set(timings) == {"queue_s", "pre_s", "wait_s", "total_s"}
    assert timings["queue_s"] == pytest.approx(1.0, abs=1e-3)
    assert timings["pre_s"] == pytest.approx(2.0, abs=1e-3)
    assert timings["total_s"] == pytest.approx(shown["cancelled_at"] - created, abs=1e-3)
    assert timings["wait_s"] == pytest.approx(timings["total_s"] - 3.0, abs=1e-3)
    final = sse_events(client.get(f"/v1/jobs/{job_id}/events").text)[-1]
    assert final["status"] == "cancelled" and final["timings"] == pytest.approx(timings)


def test_a_failed_job_reports_its_timings_and_keeps_those_it_was_given(redis_client):
    store = JobStateStore(redis_client)
    store.create("j1")
    created = store.get("j1")["created_at"]
    for offset, status in enumerate(("preprocessing", "waiting", "running"), start=1):
        store.record_event(JobEvent(job_id="j1", status=status, at=created + offset))
    store.record_event(
        JobEvent(
            job_id="j1", status="failed", at=created + 7.5, message="boom", timings={"pre_s": 0.25}
        )
    )
    timings = store.get("j1")["timings"]
    names = [stage for _, stage in STAGE_TIMINGS]
    assert timings == pytest.approx(
        {names[0]: 1.0, "pre_s": 0.25, names[2]: 1.0, names[3]: 4.5, "total_s": 7.5}, abs=1e-6
    )
    (_, final) = store.events("j1")[-1]
    assert final["status"] == "failed" and final["timings"] == pytest.approx(timings)
    # a job failed before it left the queue: its whole life was queueing
    store.create("j2")
    assert store.fail("j2", "could not be queued")
    timings = store.get("j2")["timings"]
    assert set(timings) == {"queue_s", "total_s"} and timings["queue_s"] == timings["total_s"]


def test_a_done_job_keeps_the_timings_its_services_measured(redis_client):
    store = JobStateStore(redis_client)
    store.create("j3")
    store.record_event(JobEvent(job_id="j3", status="running", at=time.time()))
    measured = {"pre_s": 0.5, "denoise_s": 2.0, "post_s": 0.25, "total_s": 3.0}
    store.record_event(JobEvent(job_id="j3", status="done", at=time.time(), timings=measured))
    assert store.get("j3")["timings"] == measured
    assert store.events("j3")[-1][1]["timings"] == measured

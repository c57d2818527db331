"""The wire format: every message round-trips; bad payloads give ProtocolError, never a crash."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from backend import protocol
from backend.protocol import (
    CancelJob,
    DenoisedJob,
    EditJob,
    JobEvent,
    MaskOps,
    PastePlan,
    PreparedJob,
    ProtocolError,
    RunningRow,
    WaitingRow,
    WorkerHeartbeat,
)

MESSAGES = [
    EditJob(
        job_id="j1",
        model_id="tiny-sd2-inpaint",
        template_ref="templates/a.png",
        mask_ref="masks/a.png",
        prompt="a lamp",
        seed=3,
        steps=20,
        guidance=7.5,
        mask_ops=MaskOps(invert=True, grow_px=4),
    ),
    PreparedJob(
        job_id="j1",
        model_id="tiny-sd2-inpaint",
        prepared_ref="prepared/j1.safetensors",
        template_ref="templates/j1.png",
        num_steps=20,
        mask_ratio=0.12,
        cache_digest="abc",
        paste=PastePlan(mask_ref="masks/j1.png", crop_box=[0, 8, 200, 158], feather_px=2.0),
        timings={"pre_s": 0.1},
        prompt="a lamp",
    ),
    DenoisedJob(
        job_id="j1",
        model_id="m",
        latents_ref="latents/j1.safetensors",
        prepared_ref="prepared/j1.safetensors",
        template_ref="templates/j1.png",
        used_cache=True,
    ),
    CancelJob(job_id="j1"),
    JobEvent(job_id="j1", status="running", at=1.5, step=3, num_steps=20),
    WorkerHeartbeat(
        worker_id="w0",
        model_id="m",
        device="cpu",
        at=2.0,
        max_batch=8,
        batching="continuous",
        running=[RunningRow(job_id="j1", mask_ratio=0.1, remaining_steps=4, template="abc")],
        waiting=[WaitingRow(job_id="j2", mask_ratio=0.3, num_steps=20)],
        resident_ram=["abc"],
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.TYPE)
def test_round_trip(message):
    assert protocol.decode(protocol.encode(message)) == message


def test_rejects_other_major_versions_and_unknown_types():
    payload = json.loads(protocol.encode(CancelJob(job_id="x")))
    for version in (99, "2.0", "x", None):
        with pytest.raises(ProtocolError, match="version"):
            protocol.decode(json.dumps({**payload, "version": version}))
    with pytest.raises(ProtocolError, match="unknown message type"):
        protocol.decode(json.dumps({**payload, "type": "pickle"}))


def test_a_newer_minor_version_with_extra_fields_is_read():
    """Within a major version a reader ignores fields it does not know, at every nesting level,
    so processes can be upgraded one at a time."""
    beat = MESSAGES[-1]
    payload = json.loads(protocol.encode(beat))
    payload |= {"version": f"{protocol.SCHEMA_MAJOR}.99", "gpu_temperature": 61}
    payload["running"][0]["adapter"] = "lora-7"
    assert protocol.decode(json.dumps(payload)) == beat
    legacy = json.loads(protocol.encode(CancelJob(job_id="x"))) | {"version": 1}
    assert protocol.decode(json.dumps(legacy)) == CancelJob(job_id="x")  # the first schema


def test_a_heartbeat_from_before_the_device_tier_reads_with_no_template_on_the_device():
    """A 1.10 worker's heartbeat has no ``resident_device``: it reads as holding none there."""
    payload = json.loads(protocol.encode(MESSAGES[-1])) | {"version": "1.10"}
    del payload["resident_device"]
    beat = protocol.decode(json.dumps(payload))
    assert isinstance(beat, WorkerHeartbeat)
    assert beat.resident_device == [] and beat.resident_ram == ["abc"]
    on_device = replace(beat, resident_device=["abc"])
    assert protocol.decode(protocol.encode(on_device)) == on_device


def test_bad_nested_values_are_protocol_errors():
    payload = json.loads(protocol.encode(MESSAGES[-1]))
    for bad in ({"running": "j1"}, {"running": [7]}, {"waiting": [{"job_id": "j"}]}):
        with pytest.raises(ProtocolError, match="worker_heartbeat"):
            protocol.decode(json.dumps(payload | bad))


def test_job_id_of_reads_the_job_of_an_undecodable_message():
    payload = json.loads(protocol.encode(MESSAGES[1]))
    del payload["num_steps"]
    with pytest.raises(ProtocolError, match="num_steps"):
        protocol.decode(json.dumps(payload))
    assert protocol.job_id_of(json.dumps(payload)) == "j1"
    assert protocol.job_id_of(b"\x80garbage") is None
    assert protocol.job_id_of(json.dumps({"job_id": 5})) is None


def test_rejects_missing_fields_non_json_and_bad_statuses():
    with pytest.raises(ProtocolError, match="missing"):
        protocol.decode(json.dumps({"type": "cancel_job", "version": protocol.PROTOCOL_VERSION}))
    with pytest.raises(ProtocolError, match="not JSON"):
        protocol.decode(b"\x80\x04pickle")
    with pytest.raises(ProtocolError, match="unknown job status"):
        JobEvent(job_id="x", status="exploded", at=0.0)

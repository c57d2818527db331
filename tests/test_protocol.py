"""The wire format: every message round-trips; bad payloads give ProtocolError, never a crash."""

from __future__ import annotations

import json

import pytest

from backend import protocol
from backend.protocol import (
    CancelJob,
    DenoisedJob,
    EditJob,
    JobEvent,
    MaskOps,
    PreparedJob,
    ProtocolError,
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
        timings={"pre_s": 0.1},
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
        running=[{"job_id": "j1", "mask_ratio": 0.1, "remaining_steps": 4}],
        resident_ram=["abc"],
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.TYPE)
def test_round_trip(message):
    assert protocol.decode(protocol.encode(message)) == message


def test_rejects_other_versions_unknown_types_and_fields():
    payload = json.loads(protocol.encode(CancelJob(job_id="x")))
    with pytest.raises(ProtocolError, match="version"):
        protocol.decode(json.dumps({**payload, "version": 99}))
    with pytest.raises(ProtocolError, match="unknown message type"):
        protocol.decode(json.dumps({**payload, "type": "pickle"}))
    with pytest.raises(ProtocolError, match="unexpected fields"):
        protocol.decode(json.dumps({**payload, "evil": 1}))
    with pytest.raises(ProtocolError, match="missing"):
        protocol.decode(json.dumps({"type": "cancel_job", "version": protocol.PROTOCOL_VERSION}))
    with pytest.raises(ProtocolError, match="not JSON"):
        protocol.decode(b"\x80\x04pickle")
    with pytest.raises(ProtocolError, match="unknown job status"):
        JobEvent(job_id="x", status="exploded", at=0.0)

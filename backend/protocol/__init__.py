"""The wire contract: every name and payload that crosses a process, defined once.

* ``keys``: every Redis key, stream, consumer group, Celery task and queue name;
* ``messages``: the typed messages and their versioned JSON format (``encode`` / ``decode``);
* ``records``: the job record (the job hash) and the events stored with it;
* ``heartbeats``: the one reader of workers' heartbeats;
* ``wire``: text from Redis replies and messages from stream entries.

Pure: no torch, no Redis library (clients are passed in).
"""

from backend.protocol import keys
from backend.protocol.messages import (
    JOB_STATES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    SCHEMA_MAJOR,
    SCHEMA_MINOR,
    AdapterUse,
    CancelJob,
    DenoisedJob,
    EditJob,
    JobEvent,
    MaskOps,
    PastePlan,
    PreparedJob,
    ProtocolError,
    RunningRow,
    ServiceLevel,
    WaitingRow,
    WorkerHeartbeat,
    decode,
    encode,
    from_dict,
    job_id_of,
    to_dict,
)
from backend.protocol.records import (
    INTERNAL_JOB_FIELDS,
    TERMINAL,
    JobRecord,
    event_fields,
    event_payload,
)
from backend.protocol.wire import entry_fields, entry_message, to_text

__all__ = [
    "AdapterUse",
    "JOB_STATES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "SCHEMA_MAJOR",
    "SCHEMA_MINOR",
    "INTERNAL_JOB_FIELDS",
    "TERMINAL",
    "CancelJob",
    "DenoisedJob",
    "EditJob",
    "JobEvent",
    "JobRecord",
    "MaskOps",
    "PastePlan",
    "PreparedJob",
    "ProtocolError",
    "RunningRow",
    "ServiceLevel",
    "WaitingRow",
    "WorkerHeartbeat",
    "decode",
    "encode",
    "entry_fields",
    "entry_message",
    "event_fields",
    "event_payload",
    "from_dict",
    "job_id_of",
    "keys",
    "to_dict",
    "to_text",
]

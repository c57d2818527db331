"""The stores a role opens from its settings: blobs, the template gallery and the adapter registry,
each on a local directory or, when ``paths.blob_url`` is ``s3://bucket/prefix``, under
``prefix/<area>/`` in that bucket (``backend.blobs.s3``).

With an object store, a role needs no directory shared with another: its own data directory holds
only this host's temporary files and downloaded copies (``<data_dir>/blob_cache``), the activation
cache and the logs. The gallery's and the adapter registry's bookkeeping lock is then a Redis lock
(``keys.object_store_lock_key``), held across hosts.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from backend.blobs.objects import LocalObjects, ObjectStore
from backend.blobs.store import BlobStore
from backend.blobs.url import parse_blob_url
from backend.config import Settings
from backend.protocol.keys import object_store_lock_key

AREAS = ("blobs", "templates", "adapters")
LOCK_TIMEOUT_S = 60  # a holder that died releases the gallery lock after this
LOCK_WAIT_S = 30  # an upload waits this long for another host's bookkeeping


def local_dir(settings: Settings, area: str) -> Path:
    """Where ``area`` lives on a local directory (today's layout under the data directory)."""
    paths = settings.paths
    location = parse_blob_url(paths.blob_url)
    return {
        "blobs": location.directory or paths.data_dir / "blobs",
        "templates": paths.data_dir / "templates",
        "adapters": paths.resolved_adapters_dir(),
    }[area]


def open_objects(settings: Settings, area: str) -> ObjectStore:
    """The object store of ``area`` (one of ``AREAS``) as ``settings`` place it."""
    if area not in AREAS:
        raise ValueError(f"object store area must be one of {AREAS}, got {area!r}")
    location = parse_blob_url(settings.paths.blob_url)
    if not location.remote:
        return LocalObjects(local_dir(settings, area))
    from backend.blobs.s3 import S3Objects

    paths = settings.paths
    return S3Objects(
        s3_client(paths.s3_endpoint_url, paths.s3_region),
        location.bucket,
        f"{location.prefix}{area}/",
        paths.data_dir / "blob_cache" / area,
        locker=_redis_locker(settings.redis.url, area),
    )


def open_blob_store(settings: Settings) -> BlobStore:
    return BlobStore(open_objects(settings, "blobs"))


@lru_cache(maxsize=4)
def s3_client(endpoint_url: str, region: str):
    """One boto3 client per process and endpoint (clients are thread-safe). Credentials come from
    boto3's own chain: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, an instance
    role."""
    import boto3
    from botocore.config import Config

    config = Config(
        # MinIO, moto and most self-hosted stores serve buckets by path, not by host name
        s3={"addressing_style": "path" if endpoint_url else "auto"},
        retries={"max_attempts": 5, "mode": "standard"},
    )
    return boto3.client(
        "s3", endpoint_url=endpoint_url or None, region_name=region or None, config=config
    )


@lru_cache(maxsize=4)
def _redis(url: str):
    from redis import Redis

    return Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)


def _redis_locker(url: str, area: str):
    def locker():
        if not url:
            raise RuntimeError(
                "the template gallery and adapter registry in an object store lock through "
                "Redis: set MASKSERVE_REDIS_URL"
            )
        return _redis(url).lock(
            object_store_lock_key(area), timeout=LOCK_TIMEOUT_S, blocking_timeout=LOCK_WAIT_S
        )

    return locker

"""The S3 back end of ``ObjectStore``: any S3-compatible object store (AWS S3, MinIO, Ceph RGW,
moto) through boto3, so several hosts share blobs, the template gallery and the adapter registry
with nothing but the object store (and Redis for the gallery's lock).

How the interface's invariants hold here (``backend.blobs.objects``):
* atomic writes: a PUT (or the multipart upload ``upload_file`` uses for large files) makes the
  whole object visible when it completes, never part of it; the same bytes twice give the same
  object;
* ``touch``: S3 cannot set a modification time, so the object is copied onto itself with new
  metadata, which makes ``LastModified`` now (server-side: no bytes travel);
* modification times are whole seconds (what S3 lists), truncated the same way when listed and
  when checked by ``delete_if_unchanged``. A blob the janitor lists as expired is hours old, so any
  write or touch after the listing gives another second and is seen;
* ``local_path`` downloads into this host's cache directory once (objects read by path are
  immutable under their key: results, thumbnails and gallery content are named by job id or
  content hash), checks the object still exists on every call, and keeps the cache under
  ``LOCAL_COPIES_BYTES`` by dropping the least recently used copies.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import BotoCoreError, ClientError

from backend.atomic import atomic_path
from backend.blobs.objects import (
    BlobMissing,
    BlobStoreUnavailable,
    ObjectStore,
    StoredObject,
    check_key,
)

LOCAL_COPIES_BYTES = 2 * 2**30  # this host's downloaded copies (served results, adapters) kept
_MISSING = ("404", "NoSuchKey", "NotFound")


def _seconds(when) -> float:
    return float(int(when.timestamp()))


class S3Objects(ObjectStore):
    """Objects under ``prefix`` in ``bucket``. ``cache_dir``: this host's local disk for temporary
    files and downloaded copies. ``locker``: makes the lock every host shares (a Redis lock; None:
    ``lock`` raises, for roles that only read)."""

    def __init__(
        self,
        client,
        bucket: str,
        prefix: str,
        cache_dir: Path,
        locker: Callable[[], AbstractContextManager[None]] | None = None,
    ):
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self.cache_dir, self.locker = Path(cache_dir), locker

    def __repr__(self) -> str:
        return f"S3Objects('s3://{self.bucket}/{self.prefix}')"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    @contextmanager
    def _answers(self, key: str) -> Iterator[None]:
        """boto3's errors as the interface's: a missing object is BlobMissing, anything else
        (unreachable, refused credentials, no such bucket) BlobStoreUnavailable."""
        try:
            yield
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code"))
            if code in _MISSING:
                raise BlobMissing(f"blob {key} does not exist (expired or never written)") from None
            raise BlobStoreUnavailable(
                f"the object store refused a request for {key} in {self!r}: {code}"
            ) from exc
        except (BotoCoreError, S3UploadFailedError) as exc:
            raise BlobStoreUnavailable(f"the object store of {self!r} failed: {exc}") from exc

    def _head(self, key: str) -> dict:
        with self._answers(key):
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))

    def put(self, key: str, data: bytes) -> None:
        with self._answers(key):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get(self, key: str) -> bytes:
        with self._answers(key):
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            with contextlib.closing(answer["Body"]) as body:
                return body.read()

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except BlobMissing:
            return False
        return True

    def delete(self, key: str) -> None:
        with self._answers(key):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def touch(self, key: str) -> None:
        full = self._key(key)
        with self._answers(key):
            self.client.copy_object(
                Bucket=self.bucket,
                Key=full,
                CopySource={"Bucket": self.bucket, "Key": full},
                Metadata={"touched-at": f"{time.time():.6f}"},
                MetadataDirective="REPLACE",  # a copy onto itself must change something
            )

    def listing(self, folder: str) -> Iterator[StoredObject]:
        start = self._key(folder) + "/"
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=start, Delimiter="/"
        )
        with self._answers(folder):
            for page in pages:
                for item in page.get("Contents", ()):
                    key = item["Key"][len(self.prefix) :]
                    yield StoredObject(key, int(item["Size"]), _seconds(item["LastModified"]))

    def delete_if_unchanged(self, key: str, modified_at: float) -> bool:
        try:
            head = self._head(key)
        except BlobMissing:
            return False
        if _seconds(head["LastModified"]) != modified_at:
            return False
        self.delete(key)
        return True

    def _temporary(self, key: str) -> Path:
        """An empty file in this host's cache directory, named like ``key`` ends (readers such as
        diffusers' LoRA loader tell a format by its extension)."""
        folder = self.cache_dir / "tmp"
        folder.mkdir(parents=True, exist_ok=True)
        suffix = "-" + check_key(key).rpartition("/")[2]
        handle, name = tempfile.mkstemp(prefix=".", suffix=suffix, dir=folder)
        os.close(handle)
        return Path(name)

    @contextmanager
    def writing(self, key: str) -> Iterator[Path]:
        full, tmp = self._key(key), self._temporary(key)
        try:
            yield tmp
            with self._answers(key):
                self.client.upload_file(str(tmp), self.bucket, full)
        finally:
            tmp.unlink(missing_ok=True)

    @contextmanager
    def reading(self, key: str) -> Iterator[Path]:
        tmp = self._temporary(key)
        try:
            self._download(key, tmp)
            yield tmp
        finally:
            tmp.unlink(missing_ok=True)

    def _download(self, key: str, target: Path) -> None:
        with self._answers(key):
            self.client.download_file(self.bucket, self._key(key), str(target))

    def local_path(self, key: str) -> Path:
        self._head(key)  # deleted (expired) objects are not served from an old copy
        copy = self.cache_dir / "copies" / check_key(key)
        if copy.is_file():
            os.utime(copy)  # recently used: pruned last
            return copy
        with atomic_path(copy) as tmp:
            self._download(key, tmp)
        self._prune(keep=copy)
        return copy

    def _prune(self, keep: Path) -> None:
        """Drop the least recently used copies while they hold more than ``LOCAL_COPIES_BYTES``."""
        copies = []
        for path in (self.cache_dir / "copies").rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                if path.is_file() and not path.name.startswith("."):
                    stat = path.stat()
                    copies.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in copies)
        for _, size, path in sorted(copies):
            if total <= LOCAL_COPIES_BYTES:
                break
            if path != keep:
                path.unlink(missing_ok=True)
                total -= size

    def lock(self) -> AbstractContextManager[None]:
        if self.locker is None:
            raise RuntimeError(f"{self!r} has no shared lock here: this role only reads it")
        return self.locker()

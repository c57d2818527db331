"""Blobs and other shared files, on a local directory or an S3-compatible object store.

``objects``: the ``ObjectStore`` interface and its local back end; ``s3``: the S3 back end;
``store``: ``BlobStore``, blob refs over an object store; ``factory``: the stores a role opens from
its settings (``paths.blob_url``). Design notes: docs/design/blobs.md.
"""

from backend.blobs.objects import (
    BlobError,
    BlobMissing,
    BlobStoreUnavailable,
    LocalObjects,
    ObjectStore,
    StoredObject,
)
from backend.blobs.store import JOB_BLOB_NAMES, KINDS, BlobStore, job_blob_name, job_blob_refs

__all__ = [
    "JOB_BLOB_NAMES",
    "KINDS",
    "BlobError",
    "BlobMissing",
    "BlobStoreUnavailable",
    "BlobStore",
    "LocalObjects",
    "ObjectStore",
    "StoredObject",
    "job_blob_name",
    "job_blob_refs",
]

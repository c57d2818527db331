"""What ``paths.blob_url`` names: a local directory or an S3 bucket and key prefix (pure parsing).

Accepted: empty (the default: ``<data_dir>/blobs``), ``file:///abs/dir`` or a plain path (a local
directory), ``s3://bucket`` or ``s3://bucket/prefix`` (an S3-compatible object store).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

# S3's bucket naming rules (3-63 lowercase letters, digits, '.', '-'); prefix segments as keys
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class BlobLocation:
    directory: Path | None  # a local directory (None: the default, or an object store)
    bucket: str = ""  # set for an object store
    prefix: str = ""  # key prefix inside the bucket: "" or "a/b/" (ends with '/')

    @property
    def remote(self) -> bool:
        return bool(self.bucket)


def parse_blob_url(url: str) -> BlobLocation:
    """The location ``url`` names; ValueError saying what a valid one looks like."""
    url = (url or "").strip()
    if not url:
        return BlobLocation(None)
    if "://" not in url:
        return BlobLocation(Path(url))
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"blob URL {url!r}: a file URL names a local path, file:///abs/dir")
        return BlobLocation(Path(parts.path))
    if parts.scheme != "s3":
        raise ValueError(
            f"blob URL {url!r} has scheme {parts.scheme!r}: use s3://bucket/prefix for an "
            "S3-compatible object store, or a local directory (a path or file:///abs/dir)"
        )
    if not _BUCKET.match(parts.netloc):
        raise ValueError(
            f"blob URL {url!r}: bucket {parts.netloc!r} is not a valid S3 bucket name (3-63 "
            "lowercase letters, digits, '.' or '-')"
        )
    segments = [segment for segment in parts.path.split("/") if segment]
    if parts.query or parts.fragment or not all(_PREFIX.match(s) for s in segments):
        raise ValueError(
            f"blob URL {url!r}: the prefix after the bucket must be '/'-separated names of "
            "letters, digits, '.', '_' or '-' (no query)"
        )
    return BlobLocation(None, parts.netloc, "".join(f"{segment}/" for segment in segments))

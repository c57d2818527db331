"""The template gallery's storage: images users upload once and edit many times.

Layout in its object store (``backend.blobs``: the local directory ``<data_dir>/templates``, or
``<prefix>/templates/`` in the bucket of ``paths.blob_url``, which every API host reads)::

    content/<sha256>.png   the template, decoded, EXIF-oriented, flattened to RGB, re-encoded as PNG
    thumbs/<sha256>.webp   its thumbnail
    records/<id>.json      one record per upload (``TemplateRecord``)

Invariants:
* ids are generated here (uuid4 hex) and validated before any path is built from one, so no id a
  caller passes can name a file outside the store; names and tags are display strings, never paths;
* every record has an ``owner`` (a tenant, ``backend.api.security.Caller.owner``) and every read,
  listing and delete names one: another owner's record is ``TemplateNotFound`` word for word like
  an id that never existed, and never listed. A record without an owner (written before owners
  existed) belongs to nobody: fail closed;
* content is deduplicated: the same image uploaded twice (even as a JPEG and as a PNG of the same
  pixels, even by two owners) gives two records that share one content file, which is deleted with
  its last record. Only records are looked up by callers, never content, so sharing it shows no
  tenant anything of another's;
* every file is written atomically (temp file + rename, or one PUT), and a record is written last,
  so a record that can be read always has its image and thumbnail; a crash leaves at most an
  unreferenced content file behind, never a record without one;
* ``add`` and ``delete`` hold the store's lock (a file lock; with an object store a Redis lock
  every host shares) around the record/content bookkeeping, so a delete racing an upload of the
  same pixels cannot remove the file the new record points at.

The REST API and the Studio UI share this class; neither touches the files directly.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
import unicodedata
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from PIL import UnidentifiedImageError

from backend.blobs import BlobMissing, LocalObjects, ObjectStore
from backend.imaging.uploads import (
    UploadError,
    decode_image,
    encode_image,
    require_edit_size,
    thumbnail,
)

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 120
MAX_TAGS = 16
MAX_TAG_CHARS = 32
THUMBNAIL_SIDE = 256
_ID = re.compile(r"^[0-9a-f]{32}$")
_TAG = re.compile(r"^\w[\w.-]*$")  # letters (any script), digits, '_' then also '.', '-'


class TemplateError(ValueError):
    """A template upload the user must fix; the message says what and how.

    ``code`` says what kind of problem it is, for callers that map it to a status:
    ``invalid`` (a bad name, tags, an image that cannot be decoded or is too small to edit:
    ``uploads.require_edit_size``), ``too_large`` (over the byte or pixel limit),
    ``unsupported_format`` (not one of the allowed image formats).
    """

    def __init__(self, message: str, code: str = "invalid"):
        super().__init__(message)
        self.code = code


class TemplateNotFound(LookupError):
    """No template with this id (never created, deleted, or not an id at all)."""

    def __init__(self, template_id: str):
        super().__init__(f"no template with id {template_id!r}: list templates to see the ids")
        self.template_id = template_id


@dataclass(frozen=True)
class TemplateRecord:
    id: str
    name: str
    tags: tuple[str, ...]
    sha256: str  # of the stored PNG (the content file's name)
    width: int
    height: int
    bytes: int  # size of the stored PNG
    created_at: float  # seconds since the epoch
    owner: str = ""  # the tenant that uploaded it; "" (a legacy record): nobody's

    def to_dict(self) -> dict:
        return asdict(self) | {"tags": list(self.tags)}

    @classmethod
    def from_dict(cls, data: dict) -> TemplateRecord:
        return cls(
            id=data["id"],
            name=data["name"],
            tags=tuple(data["tags"]),
            sha256=data["sha256"],
            width=int(data["width"]),
            height=int(data["height"]),
            bytes=int(data["bytes"]),
            created_at=float(data["created_at"]),
            owner=str(data.get("owner", "")),
        )


def upload_error_code(exc: UploadError) -> str:
    """``unsupported_format`` when no allowed decoder recognised the bytes, ``too_large`` for the
    pixel limit, ``invalid`` for anything else (empty, truncated, corrupt)."""
    if isinstance(exc.__cause__, UnidentifiedImageError):
        return "unsupported_format"
    if "the limit is" in str(exc):
        return "too_large"
    return "invalid"


def clean_name(name: str, what: str = "template") -> str:
    """The display name of a ``what`` (template, adapter), NFC-normalised and stripped;
    TemplateError when empty, too long or holding control characters."""
    name = unicodedata.normalize("NFC", str(name)).strip()
    if not name:
        raise TemplateError(f"{what} name is empty: give the {what} a name")
    if len(name) > MAX_NAME_CHARS:
        raise TemplateError(
            f"{what} name is {len(name)} characters long, the limit is {MAX_NAME_CHARS}: shorten it"
        )
    if any(unicodedata.category(ch).startswith("C") for ch in name):
        raise TemplateError(
            f"{what} name contains control characters (newlines, tabs, ...): "
            "use printable characters only"
        )
    return name


def split_tags(values) -> list[str]:
    """Tags from form fields (a string or a list of them), each of which may hold several
    comma-separated tags; ``clean_tags`` then validates them."""
    values = [values] if isinstance(values, str) else list(values or ())
    return [tag for value in values for tag in str(value).split(",")]


def clean_tags(tags) -> tuple[str, ...]:
    """Tags lower-cased and stripped, empties and duplicates dropped (first order kept)."""
    cleaned: list[str] = []
    for raw in tags or ():
        tag = unicodedata.normalize("NFC", str(raw)).strip().lower()
        if not tag or tag in cleaned:
            continue
        if len(tag) > MAX_TAG_CHARS or not _TAG.match(tag):
            raise TemplateError(
                f"tag {tag[:40]!r} is not allowed: tags are 1-{MAX_TAG_CHARS} letters, digits, "
                "'_', '.' or '-', starting with a letter or digit"
            )
        cleaned.append(tag)
    if len(cleaned) > MAX_TAGS:
        raise TemplateError(f"{len(cleaned)} tags given, the limit is {MAX_TAGS}: drop some")
    return tuple(cleaned)


class TemplateStore:
    def __init__(self, objects: ObjectStore | Path | str, max_pixels: int, max_bytes: int):
        """``objects``: the gallery's object store (a path: a local directory)."""
        self.objects = objects if isinstance(objects, ObjectStore) else LocalObjects(objects)
        self.max_pixels, self.max_bytes = int(max_pixels), int(max_bytes)

    # ----- keys -----------------------------------------------------------------------------------
    @staticmethod
    def _record_key(template_id: str) -> str:
        if not isinstance(template_id, str) or not _ID.match(template_id):
            raise TemplateNotFound(str(template_id)[:80])
        return f"records/{template_id}.json"

    @staticmethod
    def _content_key(sha256: str) -> str:
        return f"content/{sha256}.png"

    @staticmethod
    def _thumb_key(sha256: str) -> str:
        return f"thumbs/{sha256}.webp"

    # ----- operations -----------------------------------------------------------------------------
    def add(
        self, data: bytes, name: str, owner: str, tags: list[str] | tuple[str, ...] = ()
    ) -> TemplateRecord:
        """Validate and store one upload of ``owner``'s. Raises TemplateError (see its ``code``)."""
        if not owner:
            raise ValueError("a template needs an owner")  # a caller's bug, never a user's
        name, tags = clean_name(name), clean_tags(tags)
        if len(data) > self.max_bytes:
            raise TemplateError(
                f"template file is {len(data) / 2**20:.1f} MiB, the limit is "
                f"{self.max_bytes / 2**20:.1f} MiB: upload a smaller file",
                "too_large",
            )
        try:
            image = decode_image(data, self.max_pixels, what="template")
            require_edit_size(image.size, "template")
        except UploadError as exc:
            raise TemplateError(str(exc), upload_error_code(exc)) from exc
        png = encode_image(image, "png")
        sha256 = hashlib.sha256(png).hexdigest()
        thumb = thumbnail(image, THUMBNAIL_SIDE)
        record = TemplateRecord(
            id=uuid.uuid4().hex,
            name=name,
            tags=tags,
            sha256=sha256,
            width=image.width,
            height=image.height,
            bytes=len(png),
            created_at=time.time(),
            owner=owner,
        )
        with self.objects.lock():
            for key, data in ((self._content_key(sha256), png), (self._thumb_key(sha256), thumb)):
                if not self.objects.exists(key):
                    self.objects.put(key, data)
            self.objects.put(self._record_key(record.id), json.dumps(record.to_dict()).encode())
        return record

    def get(self, template_id: str, owner: str) -> TemplateRecord:
        """``owner``'s template; TemplateNotFound when it does not exist or is another's."""
        key = self._record_key(template_id)
        try:
            record = TemplateRecord.from_dict(json.loads(self.objects.get(key)))
        except BlobMissing:
            raise TemplateNotFound(template_id) from None
        # compare_digest: how long the check takes does not say how much of an owner matched
        if not owner or not hmac.compare_digest(record.owner, owner):
            raise TemplateNotFound(template_id)
        return record

    def list(self, owner: str, query: str = "", tag: str = "") -> list[TemplateRecord]:
        """``owner``'s records whose name contains ``query`` (case-insensitive) and that carry
        ``tag`` (when given), newest first."""
        needle = unicodedata.normalize("NFC", query or "").strip().casefold()
        wanted = (tag or "").strip().lower()
        records = [
            record
            for record in self._all_records()
            if owner
            and record.owner == owner
            and (not needle or needle in record.name.casefold())
            and (not wanted or wanted in record.tags)
        ]
        records.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        return records

    def _all_records(self) -> list[TemplateRecord]:
        """Every owner's records. Unreadable record files are skipped (and logged)."""
        records = []
        for stored in self.objects.listing("records"):
            if not stored.key.endswith(".json"):
                continue
            try:
                records.append(TemplateRecord.from_dict(json.loads(self.objects.get(stored.key))))
            except BlobMissing:
                continue  # deleted while we listed
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("skipping unreadable template record %s: %s", stored.key, exc)
        return records

    def delete(self, template_id: str, owner: str) -> None:
        """Remove ``owner``'s record, and its content and thumbnail when no other record (of any
        owner) shares them."""
        record = self.get(template_id, owner)
        with self.objects.lock():
            self.objects.delete(self._record_key(template_id))
            if not any(other.sha256 == record.sha256 for other in self._all_records()):
                self.objects.delete(self._content_key(record.sha256))
                self.objects.delete(self._thumb_key(record.sha256))

    def image_path(self, template_id: str, owner: str) -> Path:
        """A local file holding the stored PNG of one of ``owner``'s templates (with an object
        store, this host's copy)."""
        return self._local(self._content_key(self.get(template_id, owner).sha256), template_id)

    def thumbnail_path(self, template_id: str, owner: str) -> Path:
        """A local file holding the WebP thumbnail of one of ``owner``'s templates."""
        return self._local(self._thumb_key(self.get(template_id, owner).sha256), template_id)

    def _local(self, key: str, template_id: str) -> Path:
        try:
            return self.objects.local_path(key)
        except BlobMissing:  # deleted between reading the record and here
            raise TemplateNotFound(template_id) from None

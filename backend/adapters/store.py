"""The adapter registry's storage: LoRA adapters users upload once and name in many edits.

Layout in its object store (``backend.blobs``: a local directory, ``paths.adapters_dir``, or
``<prefix>/adapters/`` in the bucket of ``paths.blob_url``, which every host reads)::

    content/<sha256>.safetensors   the adapter in the normalized format (``backend.adapters.files``)
    records/<id>.json              one record per upload (``AdapterRecord``)

Invariants (those of ``templates_store.store``, for adapters):
* ids are generated here (uuid4 hex) and validated before any path is built from one, so no id a
  caller passes can name a file outside the store; names are display strings, never paths;
* every record has an ``owner`` (a tenant) and every read, listing and delete names one: another
  owner's record is ``AdapterNotFound`` word for word like an id that never existed, and never
  listed; a record without an owner belongs to nobody (fail closed);
* content is deduplicated by the sha256 of the normalized file: the same adapter uploaded twice (by
  one owner or two) gives two records sharing one content file, deleted with its last record;
* every file is written atomically, and a record is written last, so a record that can be read
  always has its content; a crash leaves at most an unreferenced content file, never a record
  without one;
* ``add`` and ``delete`` hold the store's lock (a file lock; with an object store a Redis lock every
  host shares) around the record/content bookkeeping.

No torch here: the API imports this module; what a record says of an adapter (family, ranks, size)
comes from the CPU worker that read the file (``AdapterFacts``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import shutil
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from backend.blobs import BlobMissing, LocalObjects, ObjectStore
from templates_store.store import TemplateError, clean_name

log = logging.getLogger(__name__)

_ID = re.compile(r"^[0-9a-f]{32}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_INDEX = re.compile(r"\.\d+(?=\.|$)")
SOURCE_LAYOUTS = ("peft", "kohya")
CHUNK = 1 << 20


class AdapterError(ValueError):
    """An adapter the user must fix; ``code`` as ``templates_store.store.TemplateError``'s."""

    def __init__(self, message: str, code: str = "invalid"):
        super().__init__(message)
        self.code = code


class AdapterNotFound(LookupError):
    """No adapter with this id (never created, deleted, another owner's, or not an id at all)."""

    def __init__(self, adapter_id: str):
        super().__init__(f"no adapter with id {adapter_id!r}: list adapters to see the ids")
        self.adapter_id = adapter_id


@dataclass(frozen=True)
class AdapterFacts:
    """What reading an adapter file established (the CPU worker's answer)."""

    family: str
    model_id: str  # the model it was validated against
    source_layout: str  # peft | kohya
    ranks: dict[str, int]  # denoiser module -> rank
    nbytes: int  # bytes of its tensors


def layer_kinds(modules) -> dict[str, int]:
    """Targeted modules counted by kind: block indices as ``N`` (``down_blocks.N.attentions.N.
    transformer_blocks.N.attn1.to_q``), sorted by kind."""
    counts = Counter(_INDEX.sub(".N", module) for module in modules)
    return dict(sorted(counts.items()))


@dataclass(frozen=True)
class AdapterRecord:
    adapter_id: str
    owner: str
    name: str
    family: str
    model_id: str
    rank: int  # the highest rank of any module
    ranks: dict[str, int]  # module -> rank (the modules it targets)
    num_pairs: int
    nbytes: int  # bytes of its tensors
    sha256: str  # of the normalized file (the content file's name)
    created_at: float
    source_layout: str  # peft | kohya

    @property
    def targets(self) -> dict[str, int]:
        return layer_kinds(self.ranks)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> AdapterRecord:
        return cls(
            adapter_id=str(data["adapter_id"]),
            owner=str(data.get("owner", "")),
            name=str(data["name"]),
            family=str(data["family"]),
            model_id=str(data["model_id"]),
            rank=int(data["rank"]),
            ranks={str(k): int(v) for k, v in data["ranks"].items()},
            num_pairs=int(data["num_pairs"]),
            nbytes=int(data["nbytes"]),
            sha256=str(data["sha256"]),
            created_at=float(data["created_at"]),
            source_layout=str(data["source_layout"]),
        )


def adapter_name(name: str) -> str:
    """The display name, cleaned as template names are; AdapterError when unusable."""
    try:
        return clean_name(name, "adapter")
    except TemplateError as exc:
        raise AdapterError(str(exc)) from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


class AdapterStore:
    def __init__(self, objects: ObjectStore | Path | str):
        """``objects``: the store's object store (a path: a local directory)."""
        self.objects = objects if isinstance(objects, ObjectStore) else LocalObjects(objects)

    # ----- keys -----------------------------------------------------------------------------------
    @staticmethod
    def _record_key(adapter_id: str) -> str:
        if not isinstance(adapter_id, str) or not _ID.match(adapter_id):
            raise AdapterNotFound(str(adapter_id)[:80])
        return f"records/{adapter_id}.json"

    @staticmethod
    def _content_key(sha256: str) -> str:
        return f"content/{sha256}.safetensors"

    # ----- operations -----------------------------------------------------------------------------
    def add(self, normalized: Path, facts: AdapterFacts, name: str, owner: str) -> AdapterRecord:
        """Store one of ``owner``'s uploads from its normalized file (left in place: the caller
        removes it). Raises AdapterError for a bad name or facts."""
        if not owner:
            raise ValueError("an adapter needs an owner")  # a caller's bug, never a user's
        name = adapter_name(name)
        if not facts.ranks or facts.source_layout not in SOURCE_LAYOUTS:
            raise ValueError(f"adapter facts are incomplete: {facts}")  # a worker's bug
        sha256 = _sha256(normalized)
        record = AdapterRecord(
            adapter_id=uuid.uuid4().hex,
            owner=owner,
            name=name,
            family=facts.family,
            model_id=facts.model_id,
            rank=max(facts.ranks.values()),
            ranks=dict(sorted(facts.ranks.items())),
            num_pairs=len(facts.ranks),
            nbytes=int(facts.nbytes),
            sha256=sha256,
            created_at=time.time(),
            source_layout=facts.source_layout,
        )
        with self.objects.lock():
            content = self._content_key(sha256)
            if not self.objects.exists(content):
                with self.objects.writing(content) as tmp:
                    shutil.copyfile(normalized, tmp)
            self.objects.put(
                self._record_key(record.adapter_id), json.dumps(record.to_dict()).encode()
            )
        return record

    def get(self, adapter_id: str, owner: str) -> AdapterRecord:
        """``owner``'s adapter; AdapterNotFound when it does not exist or is another's."""
        key = self._record_key(adapter_id)
        try:
            record = AdapterRecord.from_dict(json.loads(self.objects.get(key)))
        except BlobMissing:
            raise AdapterNotFound(adapter_id) from None
        # compare_digest: how long the check takes does not say how much of an owner matched
        if not owner or not hmac.compare_digest(record.owner, owner):
            raise AdapterNotFound(adapter_id)
        return record

    def list(self, owner: str) -> list[AdapterRecord]:
        """``owner``'s records, newest first."""
        records = [r for r in self._all_records() if owner and r.owner == owner]
        records.sort(key=lambda r: (r.created_at, r.adapter_id), reverse=True)
        return records

    def _all_records(self) -> list[AdapterRecord]:
        """Every owner's records. Unreadable record files are skipped (and logged)."""
        records = []
        for stored in self.objects.listing("records"):
            if not stored.key.endswith(".json"):
                continue
            try:
                records.append(AdapterRecord.from_dict(json.loads(self.objects.get(stored.key))))
            except BlobMissing:
                continue  # deleted while we listed
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("skipping unreadable adapter record %s: %s", stored.key, exc)
        return records

    def delete(self, adapter_id: str, owner: str) -> None:
        """Remove ``owner``'s record, and its content when no other record (of any owner)
        shares it."""
        record = self.get(adapter_id, owner)
        with self.objects.lock():
            self.objects.delete(self._record_key(adapter_id))
            if not any(other.sha256 == record.sha256 for other in self._all_records()):
                self.objects.delete(self._content_key(record.sha256))

    def content_of(self, sha256: str) -> Path:
        """A local file holding the content ``sha256`` names (engine workers load adapters by
        content; with an object store, a copy on this host's disk); AdapterNotFound when no such
        content is stored."""
        if not isinstance(sha256, str) or not _SHA256.match(sha256):
            raise AdapterNotFound(str(sha256)[:80])
        try:
            return self.objects.local_path(self._content_key(sha256))
        except BlobMissing:
            raise AdapterNotFound(sha256) from None

    def content_path(self, record: AdapterRecord) -> Path:
        """The normalized file of a record; AdapterNotFound when it is gone (deleted since)."""
        try:
            return self.objects.local_path(self._content_key(record.sha256))
        except BlobMissing:
            raise AdapterNotFound(record.adapter_id) from None

"""On-disk template activation cache: one safetensors file per denoising step plus a manifest.

Layout of one entry (directory named by the key hash)::

    manifest.json            written last; format version, key, tensor shapes/dtypes, file checksums
    trajectory.safetensors   per-step template latents, template noise, template conditioning
    step_000.safetensors     tensors "u{unit:03d}.{name}" (name in k, v, out, delta) for step 0
    ...

Invariants: an entry is visible only once complete (written in a hidden partial directory
``.<entry>.<owner pid>.<random>``, renamed into place; ``partial_owner`` reads the pid back so that
start-up removes only the partials of processes that are gone);
every (step, unit, name) tensor can be read on its own (safetensors is memory-mapped); a file the
manifest lists but the directory lacks is reported as ``CacheCorruptError`` when the entry is
opened, and a file whose SHA-256 differs from the manifest before any of its tensors is used. The
error names the entry directory, so a reader can drop that entry and compute without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from backend.cache.key import CacheKey, adapter_set

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAJECTORY = "trajectory.safetensors"
# what a failed write raises: safetensors reports the OS error (ENOSPC, EFBIG, EIO) as its own type
DISK_ERRORS = (OSError, SafetensorError)
# a safetensors file's size beyond its tensor data: the 8-byte length and the JSON header (padded
# to 8 bytes), bounded from above per file and per tensor (name, dtype, shape, two offsets)
FILE_OVERHEAD_BYTES = 64
TENSOR_OVERHEAD_BYTES = 128


class CacheError(ValueError):
    """A template cache cannot be used; the message says why and what to do."""


class CacheFullError(CacheError):
    """A recording found no room in the disk tier's budget, even after evicting what it may."""


class CacheMismatchError(CacheError):
    """The cache was recorded for other inputs (model, resolution, steps, ...)."""


class CacheCorruptError(CacheError):
    """A cache file is missing, truncated or fails its checksum; ``entry_path`` is the entry's
    directory."""

    def __init__(self, message: str, entry_path: Path | None = None):
        super().__init__(message)
        self.entry_path = entry_path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def partial_owner(name: str) -> int | None:
    """The pid of the process writing the partial directory ``name`` (``.<entry>.<pid>.<random>``,
    see ``CacheWriter``); None for any other name (an entry, or a partial of an older build)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "" and parts[2].isdigit():
        return int(parts[2])
    return None


def file_bytes_bound(tensors: dict[str, torch.Tensor]) -> int:
    """An upper bound of the size of the safetensors file holding ``tensors``."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    header = sum(TENSOR_OVERHEAD_BYTES + len(name) + 21 * t.dim() for name, t in tensors.items())
    return FILE_OVERHEAD_BYTES + header + data


@dataclass(frozen=True)
class WriteBudget:
    """How a recording asks the disk tier for room before its first byte, and gives it back.

    ``reserve(bytes)`` is called once, with an upper bound of the whole entry (``num_steps`` step
    files the size of the first, plus the trajectory of ``num_steps + 1`` latents of
    ``latent_bytes``), before the first file is written; False ends the recording
    (``CacheFullError``). ``release(error)`` is called once if the recording ends without a
    commit: ``error`` is the write error that ended it, or None (aborted, or refused room)."""

    num_steps: int
    latent_bytes: int
    reserve: Callable[[int], bool]
    release: Callable[[Exception | None], None]

    def entry_bound(self, first_step: dict[str, torch.Tensor]) -> int:
        trajectory = FILE_OVERHEAD_BYTES + TENSOR_OVERHEAD_BYTES + 64
        return (
            self.num_steps * file_bytes_bound(first_step)
            + trajectory
            + (self.num_steps + 1) * self.latent_bytes
        )


def step_file(step: int) -> str:
    return f"step_{step:03d}.safetensors"


def tensor_name(unit: int, name: str) -> str:
    return f"u{unit:03d}.{name}"


class CacheWriter:
    """The one writer of the entry layout (module docstring): collects an entry step by step in a
    temporary directory, then publishes it atomically with ``commit``. Used for recordings (by
    the engine, and by the tiered cache) and for RAM entries spilled back to disk.

    With a ``budget`` (the tiered cache's recordings) a recording reserves its room before its
    first byte (``WriteBudget``), and ends, not the edit, when refused room or on the first disk
    error (``DISK_ERRORS``: ENOSPC, EFBIG, EIO, EACCES...): the reason is kept in ``failed``, the
    partial directory is removed, the budget released and later writes are skipped (a caller then
    does not commit). Without one, a disk error is raised.
    """

    def __init__(
        self,
        root: Path,
        key: CacheKey,
        num_units: int,
        halves: int,
        storage_dtype: torch.dtype | None,
        budget: WriteBudget | None = None,
    ):
        self.root, self.key = Path(root), key
        self.root.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{key.digest()}.{os.getpid()}.", dir=self.root))
        self._tensors: dict[str, dict] = {}
        # storage_dtype None: tensors are stored in their own dtype
        self._num_units, self._halves, self._dtype = num_units, halves, storage_dtype
        self._steps = 0
        self.budget = budget
        self.failed: Exception | None = None
        self._ended = False  # committed or aborted: the budget was settled

    def write_step(self, step: int, recorded: dict[tuple[int, str], torch.Tensor]) -> None:
        """One step's tensors, keyed (unit, name); steps in order from 0."""
        self.write_step_tensors(step, {tensor_name(u, n): t for (u, n), t in recorded.items()})

    def write_step_tensors(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """One step's tensors, keyed by their stored names (``tensor_name``)."""
        if self.failed is not None:
            return  # the recording already ended (refused room, or a disk error)
        if step != self._steps:
            raise ValueError(f"steps must be written in order: expected {self._steps}, got {step}")
        stored = {name: t.to("cpu", self._dtype).contiguous() for name, t in tensors.items()}
        if step == 0 and not self._reserve(stored):
            return
        if self._save(step_file(step), stored):
            self._steps += 1

    def _reserve(self, first_step: dict[str, torch.Tensor]) -> bool:
        """Ask the budget for the whole entry's room before the first file is written."""
        if self.budget is None:
            return True
        needed = self.budget.entry_bound(first_step)
        try:
            if self.budget.reserve(needed):
                return True
            self.failed = CacheFullError(
                f"recording of {self.key.digest()} needs up to {needed} bytes: no room in the "
                "cache's disk budget"
            )
        except DISK_ERRORS as exc:  # the cache directory itself is gone or unreadable
            self.failed = exc  # the budget's owner logs and counts it, once
        self.abort()
        return False

    def write_trajectory(self, tensors: dict[str, torch.Tensor]) -> None:
        self._save(TRAJECTORY, {k: v.to("cpu").contiguous() for k, v in tensors.items()})

    def _save(self, file_name: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Write one file; False when it was skipped or failed (with a ``budget``)."""
        if self.failed is not None:
            return False
        try:
            save_file(tensors, str(self._tmp / file_name))
        except DISK_ERRORS as exc:
            if self.budget is None:
                raise
            self.failed = exc  # the budget's owner logs and counts it, once
            self.abort()
            return False
        self._tensors[file_name] = {
            k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in tensors.items()
        }
        return True

    def _check_complete(self) -> None:
        """Every step must hold, for every unit, what an edit in this cache mode reads (K and V, or
        the unit's output): a recording that missed some (a forward that skipped them) is refused
        here rather than failing the edits that would read it."""
        needed = ("k", "v") if self.key.mode == "kv" else ("out",)
        for step in range(self._steps):
            held = self._tensors.get(step_file(step), {})
            missing = [
                tensor_name(u, n)
                for u in range(self._num_units)
                for n in needed
                if tensor_name(u, n) not in held
            ]
            if missing:
                raise CacheError(
                    f"recording of {self.key.digest()} is incomplete: step {step} lacks "
                    f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                )

    def commit(self) -> TemplateCache:
        self._check_complete()
        files = {name: _sha256(self._tmp / name) for name in self._tensors}
        manifest = {
            "format_version": FORMAT_VERSION,
            "key": asdict(self.key),
            "key_digest": self.key.digest(),
            "num_steps": self._steps,
            "num_units": self._num_units,
            "halves": self._halves,
            "tensors": self._tensors,
            "files": files,
            "bytes_total": sum((self._tmp / n).stat().st_size for n in files),
        }
        (self._tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        final = self.root / self.key.digest()
        if final.exists():
            shutil.rmtree(final)  # a stale or corrupt entry for the same key is replaced
        os.replace(self._tmp, final)
        self._ended = True
        return TemplateCache.open(final, self.key)

    def abort(self) -> None:
        """Remove the partial directory and release the budget (once); safe after a commit."""
        shutil.rmtree(self._tmp, ignore_errors=True)
        if not self._ended and self.budget is not None:
            self.budget.release(self.failed)
        self._ended = True


class ManifestView:
    """What a committed entry's manifest says, for every reader of one (``TemplateCache`` here,
    ``backend.cache.MemoryTemplateCache`` in RAM): ``self.manifest`` is the parsed manifest."""

    manifest: dict
    # the compute device the entry's tensors live on (a device-tier copy: the cache feeder reads
    # them there without a copy); None: host memory or disk, copied to the device each step
    device: torch.device | None = None

    @property
    def num_steps(self) -> int:
        return self.manifest["num_steps"]

    @property
    def num_units(self) -> int:
        return self.manifest["num_units"]

    @property
    def bytes_total(self) -> int:
        return self.manifest["bytes_total"]

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.num_steps:
            raise CacheMismatchError(f"step {step} outside the cache's {self.num_steps} steps")


class TemplateCache(ManifestView):
    """Read access to one committed entry. Tensors are read lazily, one (step, unit, name) at a
    time."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest
        self.key = CacheKey(**manifest["key"])
        self._verified: set[str] = set()
        self._handles: dict[str, object] = {}

    @classmethod
    def open(cls, path: Path, expected: CacheKey | None = None) -> TemplateCache:
        path = Path(path)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError as exc:
            raise CacheCorruptError(
                f"no cache manifest at {path}: prepare the template again", path
            ) from exc
        except json.JSONDecodeError as exc:
            raise CacheCorruptError(
                f"cache manifest at {path} is not valid JSON: prepare the template again", path
            ) from exc
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CacheMismatchError(
                f"cache format {manifest.get('format_version')} at {path}, this build reads "
                f"{FORMAT_VERSION}: re-prepare"
            )
        cache = cls(path, manifest)
        if expected is not None and cache.key != expected:
            raise CacheMismatchError(
                "template cache was recorded for other inputs: "
                + "; ".join(expected.mismatches(cache.key))
            )
        cache._check_files_present()
        return cache

    def _check_files_present(self) -> None:
        """A stat per file: a deleted file is found before an edit starts on the entry, not midway
        (checksums are verified lazily, per file, on first read)."""
        for file_name in self.manifest["files"]:
            if not (self.path / file_name).is_file():
                raise CacheCorruptError(
                    f"cache file {self.path / file_name} is missing: prepare the template again",
                    self.path,
                )

    def _handle(self, file_name: str):
        if file_name not in self._verified:
            file_path = self.path / file_name
            if not file_path.exists():
                raise CacheCorruptError(
                    f"cache file {file_path} is missing: prepare the template again", self.path
                )
            if _sha256(file_path) != self.manifest["files"].get(file_name):
                raise CacheCorruptError(
                    f"cache file {file_path} fails its checksum: prepare the template again",
                    self.path,
                )
            self._verified.add(file_name)
        if file_name not in self._handles:
            self._handles[file_name] = safe_open(str(self.path / file_name), framework="pt")
        return self._handles[file_name]

    def step_tensor(self, step: int, unit: int, name: str) -> torch.Tensor:
        """(halves, num_tokens, C) tensor recorded for ``unit`` at denoising ``step``."""
        self._check_step(step)
        return self._handle(step_file(step)).get_tensor(tensor_name(unit, name))

    def has(self, step: int, unit: int, name: str) -> bool:
        return tensor_name(unit, name) in self.manifest["tensors"].get(step_file(step), {})

    def trajectory(self, name: str) -> torch.Tensor:
        return self._handle(TRAJECTORY).get_tensor(name)

    def unit_bytes(self, unit: int) -> int:
        """Bytes of one step's tensors for ``unit`` (same for every step)."""
        entries = self.manifest["tensors"].get(step_file(0), {})
        total = 0
        for key, meta in entries.items():
            if key.startswith(f"u{unit:03d}."):
                numel = 1
                for dim in meta["shape"]:
                    numel *= dim
                total += (
                    numel
                    * torch.empty(
                        0, dtype=getattr(torch, meta["dtype"].split(".")[-1])
                    ).element_size()
                )
        return total


def lookup(root: Path, key: CacheKey) -> TemplateCache | None:
    """The committed entry for ``key`` under ``root``, or None when there is none."""
    path = Path(root) / key.digest()
    if not (path / MANIFEST).exists():
        return None
    return TemplateCache.open(path, key)


def check_recording(states: Sequence, reads_cache: bool) -> bool:
    """Whether a row of a batch (``EditState``s) records its template's cache; ``ValueError`` when
    it cannot: it applies adapters other than its cache's, or the batch also reads caches."""
    for s in states:
        if s.writer is not None and s.writer.key.adapters != adapter_set(s.adapters):
            raise ValueError(
                f"a row applies adapters {adapter_set(s.adapters) or 'none'} while recording "
                f"a cache for {s.writer.key.adapters or 'none'}: record a pinned cache for them"
            )
    recording = any(s.writer is not None for s in states)
    if recording and reads_cache and any(s.cache is not None for s in states):
        # a cached unit computes only masked tokens, so it could not record a full K/V
        raise ValueError(
            "a batch cannot both record a template cache and read caches: step them apart"
        )
    return recording

"""On-disk template activation cache: one safetensors file per denoising step plus a manifest.

Layout of one entry (directory named by the key hash)::

    manifest.json            written last; format version, key, tensor shapes/dtypes, file checksums
    trajectory.safetensors   per-step template latents, template noise, template conditioning
    step_000.safetensors     tensors "u{unit:03d}.{name}" (name in k, v, out, delta) for step 0
    ...

Invariants: an entry is visible only once complete (written in a temp dir, renamed into place);
every (step, unit, name) tensor can be read on its own (safetensors is memory-mapped); a file the
manifest lists but the directory lacks is reported as ``CacheCorruptError`` when the entry is
opened, and a file whose SHA-256 differs from the manifest before any of its tensors is used. The
error names the entry directory, so a reader can drop that entry and compute without it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAJECTORY = "trajectory.safetensors"


class CacheError(ValueError):
    """A template cache cannot be used; the message says why and what to do."""


class CacheMismatchError(CacheError):
    """The cache was recorded for other inputs (model, resolution, steps, ...)."""


class CacheCorruptError(CacheError):
    """A cache file is missing, truncated or fails its checksum; ``entry_path`` is the entry's
    directory."""

    def __init__(self, message: str, entry_path: Path | None = None):
        super().__init__(message)
        self.entry_path = entry_path


@dataclass(frozen=True)
class CacheKey:
    """Everything that determines a template's recorded activations."""

    image_sha256: str
    model_id: str
    model_revision: str
    height: int
    width: int
    num_steps: int
    scheduler: str
    strength: float
    template_seed: int
    mode: str
    prompt: str = ""
    negative_prompt: str = ""
    guidance: float = 0.0
    mask_sha256: str = "none"

    def digest(self) -> str:
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:
        """Computed once per key (the worker asks for it for every waiting row at every step);
        the key is frozen, so it never goes stale."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def mismatches(self, other: CacheKey) -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [
            f"{k}: cache has {theirs[k]!r}, request needs {mine[k]!r}"
            for k in mine
            if mine[k] != theirs[k]
        ]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def step_file(step: int) -> str:
    return f"step_{step:03d}.safetensors"


def tensor_name(unit: int, name: str) -> str:
    return f"u{unit:03d}.{name}"


class CacheWriter:
    """The one writer of the entry layout (module docstring): collects an entry step by step in a
    temporary directory, then publishes it atomically with ``commit``. Used for recordings (by
    the engine, and by the tiered cache) and for RAM entries spilled back to disk.

    ``stop_on_disk_error`` (the tiered cache's recordings): the first OSError (e.g. ENOSPC) while
    writing ends the recording, not the edit: it is kept in ``failed``, the temporary directory is
    removed and later writes are skipped (a caller then does not commit). Otherwise it is raised.
    """

    def __init__(
        self,
        root: Path,
        key: CacheKey,
        num_units: int,
        halves: int,
        storage_dtype: torch.dtype | None,
        stop_on_disk_error: bool = False,
    ):
        self.root, self.key = Path(root), key
        self.root.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{key.digest()}.", dir=self.root))
        self._tensors: dict[str, dict] = {}
        # storage_dtype None: tensors are stored in their own dtype
        self._num_units, self._halves, self._dtype = num_units, halves, storage_dtype
        self._steps = 0
        self.stop_on_disk_error = stop_on_disk_error
        self.failed: OSError | None = None

    def write_step(self, step: int, recorded: dict[tuple[int, str], torch.Tensor]) -> None:
        """One step's tensors, keyed (unit, name); steps in order from 0."""
        self.write_step_tensors(step, {tensor_name(u, n): t for (u, n), t in recorded.items()})

    def write_step_tensors(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """One step's tensors, keyed by their stored names (``tensor_name``)."""
        if self.failed is not None:
            return  # the recording already ended (``stop_on_disk_error``)
        if step != self._steps:
            raise ValueError(f"steps must be written in order: expected {self._steps}, got {step}")
        stored = {name: t.to("cpu", self._dtype).contiguous() for name, t in tensors.items()}
        if self._save(step_file(step), stored):
            self._steps += 1

    def write_trajectory(self, tensors: dict[str, torch.Tensor]) -> None:
        self._save(TRAJECTORY, {k: v.to("cpu").contiguous() for k, v in tensors.items()})

    def _save(self, file_name: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Write one file; False when it was skipped or failed (``stop_on_disk_error``)."""
        if self.failed is not None:
            return False
        try:
            save_file(tensors, str(self._tmp / file_name))
        except OSError as exc:
            if not self.stop_on_disk_error:
                raise
            self.failed = exc
            log.warning(
                "cache recording failed entry=%s error=%s: the edit continues without it",
                self.key.digest(),
                exc,
            )
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
        return TemplateCache.open(final, self.key)

    def abort(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)


class ManifestView:
    """What a committed entry's manifest says, for every reader of one (``TemplateCache`` here,
    ``backend.cache.MemoryTemplateCache`` in RAM): ``self.manifest`` is the parsed manifest."""

    manifest: dict

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

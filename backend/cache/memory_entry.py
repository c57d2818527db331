"""One template cache entry resident in memory (``MemoryTemplateCache``): what the tiered cache
(``backend.cache.store``) holds in its RAM tier, read from and spilled to the disk entries that
``backend.engine.cache_store`` writes, and in its device tier (a copy on the compute device)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from backend.engine.cache_store import (
    TRAJECTORY,
    CacheCorruptError,
    CacheKey,
    CacheWriter,
    ManifestView,
    TemplateCache,
    step_file,
    tensor_name,
)


class MemoryTemplateCache(ManifestView):
    """One entry with every tensor resident in memory; the read API of ``TemplateCache``. In host
    memory (``device`` None) or, a device-tier copy, on the compute device ``device``.

    Invariants: built only from files whose SHA-256 matches the manifest, or copied from such an
    entry; reads return the resident tensors themselves (no copy), so callers must not modify them
    in place (the engine merges into clones).
    """

    def __init__(self, path: Path, manifest: dict, files: dict[str, dict[str, torch.Tensor]]):
        # path: the disk entry it came from (an identity)
        self.path, self.manifest = Path(path), manifest
        self.key = CacheKey(**manifest["key"])
        self._files = files

    @classmethod
    def load(cls, path: Path, pin_memory: bool = False) -> MemoryTemplateCache:
        """Read and verify every file of the entry at ``path``; raises one of ``UNUSABLE``."""
        manifest = TemplateCache.open(path).manifest
        files = {}
        for file_name, digest in manifest["files"].items():
            data = (Path(path) / file_name).read_bytes()
            if hashlib.sha256(data).hexdigest() != digest:
                raise CacheCorruptError(
                    f"cache file {Path(path) / file_name} fails its checksum", Path(path)
                )
            tensors = load_safetensors(data)
            files[file_name] = (
                {name: t.pin_memory() for name, t in tensors.items()} if pin_memory else tensors
            )
        return cls(path, manifest, files)

    def to_device(self, device: torch.device) -> MemoryTemplateCache:
        """A copy of the entry on the compute ``device`` (a copy even when that is the CPU). On
        CUDA it runs on a side stream from the pinned host tensors and has finished when this
        returns, so any stream may read it."""
        if device.type != "cuda":
            return self._copy(lambda t: t.to(device, copy=True), device)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            copy = self._copy(lambda t: t.to(device, non_blocking=True), device)
        stream.synchronize()
        return copy

    def to_host(self, pin_memory: bool = False) -> MemoryTemplateCache:
        """A copy of the entry in host memory (a demotion from the device tier), pinned when
        ``pin_memory``."""
        if pin_memory:  # one copy, straight into pinned memory
            return self._copy(
                lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t), None
            )
        return self._copy(lambda t: t.to("cpu", copy=True), None)

    def _copy(
        self, move: Callable[[torch.Tensor], torch.Tensor], device: torch.device | None
    ) -> MemoryTemplateCache:
        files = {
            file_name: {name: move(t) for name, t in tensors.items()}
            for file_name, tensors in self._files.items()
        }
        copy = MemoryTemplateCache(self.path, self.manifest, files)
        if device is not None:  # as the tensors say it ("cuda:0" for "cuda"): feeders compare it
            copy.device = next((t.device for f in files.values() for t in f.values()), device)
        return copy

    def step_tensor(self, step: int, unit: int, name: str) -> torch.Tensor:
        self._check_step(step)
        return self._files[step_file(step)][tensor_name(unit, name)]

    def has(self, step: int, unit: int, name: str) -> bool:
        return tensor_name(unit, name) in self._files.get(step_file(step), {})

    def trajectory(self, name: str) -> torch.Tensor:
        return self._files[TRAJECTORY][name]

    def unit_bytes(self, unit: int) -> int:
        """Bytes of one step's tensors for ``unit`` (same for every step)."""
        prefix = tensor_name(unit, "")
        return sum(
            t.numel() * t.element_size()
            for n, t in self._files.get(step_file(0), {}).items()
            if n.startswith(prefix)
        )

    def save(self, root: Path) -> None:
        """Write the entry to ``root/<key digest>`` with ``CacheWriter`` (a spill)."""
        writer = CacheWriter(root, self.key, self.num_units, self.manifest["halves"], None)
        try:
            for step in range(self.num_steps):
                writer.write_step_tensors(step, self._files[step_file(step)])
            writer.write_trajectory(self._files[TRAJECTORY])
            writer.commit()
        except BaseException:
            writer.abort()
            raise

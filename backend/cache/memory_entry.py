"""One template cache entry resident in memory (``MemoryTemplateCache``): what the tiered cache
(``backend.cache.store``) holds in its RAM tier, read from and spilled to the disk entries that
``backend.engine.cache_store`` writes, and in its device tier (a copy on the compute device)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class StepBlock:
    """One step's tensors (each (halves, tokens, C)) laid out in one (halves, N) block: tensor
    ``name`` is ``block[:, start:stop]`` viewed as its ``shape``, names in sorted order (so the
    entries of one model and mode share one layout)."""

    block: torch.Tensor
    places: dict[str, tuple[int, int, tuple[int, ...]]]

    @classmethod
    def pack(cls, tensors: dict[str, torch.Tensor], pin_memory: bool = False) -> StepBlock | None:
        """The block of ``tensors``, or None when they differ in dtype, device or halves."""
        first = next(iter(tensors.values()), None)
        if first is None or any(
            t.dtype != first.dtype or t.device != first.device or t.shape[0] != first.shape[0]
            for t in tensors.values()
        ):
            return None
        places, start = {}, 0
        for name, t in sorted(tensors.items()):  # one layout for every entry of a model
            width = t[0].numel()
            places[name] = (start, start + width, tuple(t.shape))
            start += width
        block = torch.empty(
            (first.shape[0], start), dtype=first.dtype, device=first.device, pin_memory=pin_memory
        )
        for name, t in tensors.items():
            block[:, places[name][0] : places[name][1]] = t.reshape(t.shape[0], -1)
        return cls(block, places)

    def views(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(self.block, name) for name in self.places}

    def tensor(self, block: torch.Tensor, name: str) -> torch.Tensor:
        """Tensor ``name`` of ``block`` (this block, or rows of blocks laid out like it)."""
        start, stop, shape = self.places[name]
        return block[:, start:stop].view(block.shape[0], *shape[1:])

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> StepBlock:
        return StepBlock(move(self.block), self.places)


class MemoryTemplateCache(ManifestView):
    """One entry with every tensor resident in memory; the read API of ``TemplateCache``. In host
    memory (``device`` None) or, a device-tier copy, on the compute device ``device``.

    Invariants: built only from files whose SHA-256 matches the manifest, or copied from such an
    entry; reads return the resident tensors themselves (no copy), so callers must not modify them
    in place (the engine merges into clones). Each step's tensors are views of one block
    (``step_block``) when they share a dtype and their halves: a batch's rows of every unit are
    then one concatenation per step, and a move to the device one copy per step.
    """

    def __init__(
        self,
        path: Path,
        manifest: dict,
        files: dict[str, dict[str, torch.Tensor]],
        pin_memory: bool = False,
    ):
        # path: the disk entry it came from (an identity)
        self.path, self.manifest = Path(path), manifest
        self.key = CacheKey(**manifest["key"])
        self._blocks: dict[str, StepBlock] = {}
        self._files = {}
        for file_name, tensors in files.items():
            block = StepBlock.pack(tensors, pin_memory) if file_name != TRAJECTORY else None
            if block is not None:
                self._blocks[file_name] = block
                tensors = block.views()
            elif pin_memory:
                tensors = {name: t.pin_memory() for name, t in tensors.items()}
            self._files[file_name] = tensors

    def step_block(self, step: int) -> StepBlock | None:
        """The block holding every tensor of ``step``, or None when they could not share one."""
        return self._blocks.get(step_file(step))

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
            files[file_name] = load_safetensors(data)
        return cls(path, manifest, files, pin_memory)

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
            file_name: (
                self._blocks[file_name].moved(move).views()
                if file_name in self._blocks
                else {name: move(t) for name, t in tensors.items()}
            )
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

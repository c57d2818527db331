"""Supplies a batch's cached activations to the compute device for one denoising step.

Invariants: each (template, step, unit, tensor) is read and copied once per step however many rows
share it (CFG halves, or several requests on one template); on CUDA the copies run in unit order on
a side stream from pinned host memory and ``wait_for(unit)`` makes the compute stream wait only
for that unit's copies, so loading overlaps the compute of earlier units; a template whose cache
lives on the compute device already (a device-tier copy, ``cache.device``) is read there: no host
read, no copy, nothing counted in ``bytes_loaded``. When every row's step lies in one block on
the compute device (``MemoryTemplateCache.step_block``), the rows of all units are gathered by one
concatenation per step (``rows_block``) and each unit's tensor is a view of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend.engine.cache_store import TemplateCache, tensor_name
from backend.engine.context import cat_once

MODE_TENSORS = {"kv": ("k", "v", "delta"), "hidden": ("out", "delta")}


@dataclass(frozen=True)
class RowCacheRef:
    """Row r of a batch reads half ``half`` of ``cache`` at denoising step ``step``."""

    cache: TemplateCache
    step: int
    half: int


class BatchCacheFeeder:
    def __init__(
        self,
        rows: Sequence[RowCacheRef | None],
        units: Sequence[int],
        mode: str,
        device: torch.device | str,
    ):
        self.device = torch.device(device)
        self._names = MODE_TENSORS[mode]
        self._groups: dict[tuple[str, int], RowCacheRef] = {}
        self._row_group: list[tuple[tuple[str, int], int] | None] = []
        for ref in rows:
            if ref is None:
                self._row_group.append(None)
                continue
            group = (str(ref.cache.path), ref.step)
            self._groups.setdefault(group, ref)
            self._row_group.append((group, ref.half))
        self._loaded: dict[tuple[tuple[str, int], int, str], torch.Tensor] = {}
        self._events: dict[int, torch.cuda.Event] = {}
        self._blocks: dict[tuple, tuple | None] = {}
        self.bytes_loaded = 0
        if self.device.type == "cuda":
            self._start_async(units)

    def _cache_tensor(self, group, unit: int, name: str) -> torch.Tensor | None:
        ref = self._groups[group]
        if not ref.cache.has(ref.step, unit, name):
            return None
        return ref.cache.step_tensor(ref.step, unit, name)

    def _on_device(self, group) -> bool:
        return self._groups[group].cache.device == self.device

    def _start_async(self, units: Sequence[int]) -> None:
        stream = torch.cuda.Stream(device=self.device)
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)  # copies must not overtake work already queued on these buffers
        with torch.cuda.stream(stream):
            for unit in units:
                for group in self._groups:
                    for name in self._names:
                        cached = self._cache_tensor(group, unit, name)
                        if cached is None:
                            continue
                        if self._on_device(group):
                            # the cache frees it only once the compute queued meanwhile is done
                            cached.record_stream(compute)
                            self._loaded[(group, unit, name)] = cached
                            continue
                        loaded = cached.pin_memory().to(self.device, non_blocking=True)
                        # the compute stream reads it: keep the allocator from reusing it too early
                        loaded.record_stream(compute)
                        self._loaded[(group, unit, name)] = loaded
                        self.bytes_loaded += cached.numel() * cached.element_size()
                event = torch.cuda.Event()
                event.record(stream)
                self._events[unit] = event

    def wait_for(self, unit: int) -> None:
        event = self._events.get(unit)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _group_tensor(self, group, unit: int, name: str) -> torch.Tensor:
        key = (group, unit, name)
        if key not in self._loaded:
            cached = self._cache_tensor(group, unit, name)
            if cached is None:
                raise KeyError(f"cache has no tensor {name!r} for unit {unit}")
            if self._on_device(group):
                self._loaded[key] = cached
                return cached
            self._loaded[key] = cached.to(self.device)
            self.bytes_loaded += cached.numel() * cached.element_size()
        return self._loaded[key]

    def rows_tensor(
        self, unit: int, name: str, rows: tuple[int, int], fill: bool = False
    ) -> torch.Tensor:
        entries = self._row_group[rows[0] : rows[1]]
        if any(entry is None for entry in entries) and not fill:
            raise KeyError(f"rows {rows} include a row with no template cache")
        in_block = self.rows_block(rows, fill)
        if in_block is not None:
            block, layout = in_block
            if tensor_name(unit, name) not in layout.places:
                raise KeyError(f"cache has no tensor {name!r} for unit {unit}")
            return layout.tensor(block, tensor_name(unit, name))
        # runs of consecutive halves of one group (the CFG halves of one request) are one slice
        # each: one request is a view, a batch one concatenation of its requests' slices; rows
        # without a cache (``fill``) are one run of zeros
        runs = _runs(entries)
        like = next(self._group_tensor(g, unit, name) for g, _, _ in runs if g is not None)
        return cat_once(
            [
                _rows(self._group_tensor(g, unit, name), a, b)
                if g is not None
                else like.new_zeros((b - a, *like.shape[1:]))
                for g, a, b in runs
            ]
        )

    def rows_block(self, rows: tuple[int, int], fill: bool):
        """(rows' block, its layout): every row's step block, in row order, concatenated once per
        step (zeros for a row without a cache, with ``fill``); None unless every row's template is
        resident on the compute device (a device-tier copy) with its step in one block, all laid
        out alike."""
        key = (rows, fill)
        if key not in self._blocks:
            self._blocks[key] = None
            runs = _runs(self._row_group[rows[0] : rows[1]])
            steps = {g: self._groups[g].cache for g, _, _ in runs if g is not None}
            blocks = {
                g: getattr(cache, "step_block", lambda _step: None)(self._groups[g].step)
                for g, cache in steps.items()
            }
            layouts = list(blocks.values())
            if all(self._on_device(g) for g in blocks) and all(
                b is not None and b.places == layouts[0].places for b in layouts
            ):
                like = layouts[0].block
                parts = [
                    _rows(blocks[g].block, a, b)
                    if g is not None
                    else like.new_zeros((b - a, like.shape[1]))
                    for g, a, b in runs
                ]
                self._blocks[key] = (cat_once(parts), layouts[0])
        return self._blocks[key]


def _runs(entries) -> list[tuple[object, int, int]]:
    """Runs (group, first half, stop half) of consecutive rows reading consecutive halves of one
    group's tensors (the CFG halves of one request); rows without a cache (None) form runs of
    group None."""
    runs: list[tuple[object, int, int]] = []
    for entry in entries:
        group, half = entry if entry is not None else (None, 0)
        if runs and runs[-1][0] == group and (group is None or runs[-1][2] == half):
            runs[-1] = (group, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((group, half, half + 1))
    return runs


def _rows(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``tensor[start:stop]``; the tensor itself when that is all of it (no slicing operator)."""
    return tensor if start == 0 and stop == tensor.shape[0] else tensor[start:stop]

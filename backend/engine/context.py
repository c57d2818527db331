"""What one denoiser forward of a batch needs beyond the model inputs.

The engine sets a ``ForwardContext`` around the model call (``active_context``); the mask-aware
stacks read it. Without an active context the patched modules run their ordinary diffusers forward,
so the same pipeline object still serves ordinary (dense) runs.

Invariants: ``use_cache[u]`` is False for every unit when ``cache`` is None; a recording context
selects every token of every row (the recording run is the ordinary dense computation).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from backend.engine.attention import replace_rows
from backend.engine.graph_book import GraphBook
from backend.engine.layout import RowLayout, full_layout, make_layout
from backend.engine.lora import BatchLora

# Row r's token mask on a grid (gh, gw) -> flat bool tensor (gh * gw,), True = computed fresh.
TokenMaskFn = Callable[[tuple[int, int]], torch.Tensor]


def cat_once(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat``, without the copy when there is only one tensor (one row group: the usual
    case)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


class CacheSource(Protocol):
    """Cached activations for the rows of one batch, already placed on the compute device."""

    def rows_tensor(
        self, unit: int, name: str, rows: tuple[int, int], fill: bool = False
    ) -> torch.Tensor:
        """(rows, num_tokens, C): tensor ``name`` of ``unit`` recorded for each row's template, step
        and half, for the rows ``range(*rows)``; with ``fill``, zeros for a row without a cache
        (else such a row is an error)."""
        ...

    def wait_for(self, unit: int) -> None:
        """Block the compute stream until ``unit``'s cache is on the device (no-op on the CPU)."""
        ...


class LayoutSource(Protocol):
    """The layouts of one batch, from elsewhere than its row masks (``step_layouts``)."""

    def layout(self, grid_hw: tuple[int, int]) -> RowLayout: ...

    def dense_layout(self, num_tokens: int) -> RowLayout: ...


@dataclass
class ForwardContext:
    row_token_masks: Sequence[TokenMaskFn | None]  # None: the row computes every token
    use_cache: Sequence[bool]
    mode: str  # "kv" | "hidden"
    cache: CacheSource | None = None
    recorder: dict[tuple[int, str], torch.Tensor] | None = None
    device: torch.device | str = "cpu"
    unit_seconds: dict[int, float] | None = None  # filled by profiling runs: unit -> seconds
    lora: BatchLora | None = None  # the rows' adapters (None: every row runs the base model)
    padded_attention: bool = False  # every row in one attention call (``ragged_attention``)
    # static shapes: the batch's bucketed layouts, built when its rows were admitted (None: built
    # here from ``row_token_masks``, each row with its own token count)
    layouts: LayoutSource | None = None
    compile_steps: str = "off"  # the mode a bucketed step's forward runs compiled in (``compiled``)
    graphs: GraphBook | None = None  # which unit graphs may be compiled (None: any)
    _layouts: dict[tuple[int, int], RowLayout] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.row_token_masks)

    def require_rows(self, num_rows: int) -> None:
        """Refuse a model input whose row count is not the context's (row masks would misalign)."""
        if num_rows != self.num_rows:
            raise ValueError(
                f"the model input has {num_rows} rows but the forward context has "
                f"{self.num_rows} row masks: build one context per batch, one mask per row"
            )

    def layout(self, grid_hw: tuple[int, int]) -> RowLayout:
        """Masked-token layout of the batch on one token grid (memoised per forward)."""
        if self.layouts is not None:
            return self.layouts.layout(grid_hw)
        if grid_hw not in self._layouts:
            num_tokens = grid_hw[0] * grid_hw[1]
            masks = [
                torch.ones(num_tokens, dtype=torch.bool) if fn is None else fn(grid_hw)
                for fn in self.row_token_masks
            ]
            self._layouts[grid_hw] = make_layout(masks, self.device)
        return self._layouts[grid_hw]

    def dense_layout(self, num_tokens: int) -> RowLayout:
        if self.layouts is not None:
            return self.layouts.dense_layout(num_tokens)
        key = (-1, num_tokens)  # a slot apart from masked layouts (grid sizes are positive)
        if key not in self._layouts:
            self._layouts[key] = full_layout(self.num_rows, num_tokens, self.device)
        return self._layouts[key]

    def uses_cache(self, unit: int) -> bool:
        return self.cache is not None and self.use_cache[unit]

    def cached(
        self, unit: int, name: str, group: tuple[int, int], fill: bool = False
    ) -> torch.Tensor:
        assert self.cache is not None
        return self.cache.rows_tensor(unit, name, group, fill)

    def merge_cached(
        self, unit: int, name: str, layout: RowLayout, fresh: torch.Tensor
    ) -> torch.Tensor:
        """(rows, L, C): cached ``name`` of ``unit`` with each row's selected tokens replaced by
        ``fresh`` (packed in ``layout``). Rows that select every token read no cache."""
        if layout.regular or (len(layout.groups) > 1 and layout.every_row_partial):
            # every row reads the cache (a regular layout's rows without one read zeros, all of
            # them replaced): all rows' tokens replaced by one index copy, not per group
            cached = self.cached(unit, name, (0, layout.num_rows), layout.regular)
            return merge_all_rows(cached, layout, fresh)
        return cat_once(
            [
                self.merge_group(unit, name, layout, group, layout.group_tokens(fresh, group))
                for group in layout.groups
            ]
        )

    def merge_group(
        self, unit: int, name: str, layout: RowLayout, group: tuple[int, int], fresh: torch.Tensor
    ) -> torch.Tensor:
        """(g, L, ...): one group's cached tensor with its selected tokens replaced by ``fresh``
        (g, n, ...)."""
        indices = layout.indices[group[0]]
        if layout.row_is_full(group[0]):
            return fresh
        cached = self.cached(unit, name, group)
        return replace_rows(cached.reshape(*cached.shape[:2], *fresh.shape[2:]), indices, fresh)

    def merge_group_after(
        self,
        unit: int,
        name: str,
        layout: RowLayout,
        group: tuple[int, int],
        fresh: torch.Tensor,
        prefix: torch.Tensor,
    ) -> torch.Tensor:
        """(g, P + L, ...): ``prefix`` (g, P, ...) then what ``merge_group`` gives, built in one
        buffer, so the cached tokens are copied once (not merged, then copied again by a
        concatenation)."""
        indices = layout.indices[group[0]]
        if layout.row_is_full(group[0]):
            return torch.cat([prefix, fresh], dim=1)
        out = self._prefixed_cache(unit, name, group, fresh.shape[2:], prefix)
        return out.index_copy_(1, indices + prefix.shape[1], fresh)

    def merge_cached_after(
        self, unit: int, name: str, layout: RowLayout, fresh: torch.Tensor, prefix: torch.Tensor
    ) -> torch.Tensor:
        """(rows, P + L, ...): ``merge_group_after`` for every row of ``layout`` at once, with
        ``fresh`` packed (total, ...) and ``prefix`` (rows, P, ...)."""
        if not (layout.regular or layout.every_row_partial):  # a full row reads no cache
            return cat_once(
                [
                    self.merge_group_after(
                        unit, name, layout, g, layout.group_tokens(fresh, g), prefix[g[0] : g[1]]
                    )
                    for g in layout.groups
                ]
            )
        cached = self.cached(unit, name, (0, layout.num_rows), layout.regular)
        return merge_all_rows_after(cached, layout, fresh, prefix)

    def _prefixed_cache(self, unit, name, rows: tuple[int, int], per_token, prefix) -> torch.Tensor:
        """(g, P + L, *per_token): ``prefix`` then the rows' cached ``name``, in one new buffer."""
        return _prefixed(self.cached(unit, name, rows), per_token, prefix)

    def timed_unit(self, unit: int):
        """Context manager timing one unit when profiling (synchronising CUDA around it)."""
        if self.unit_seconds is None:
            return contextlib.nullcontext()
        return _UnitTimer(self.unit_seconds, unit, torch.device(self.device))

    def record(self, unit: int, name: str, value: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder[(unit, name)] = value.detach().clone()


def merge_all_rows(cached: torch.Tensor, layout: RowLayout, fresh: torch.Tensor) -> torch.Tensor:
    """(rows, L, ...): ``cached`` (rows, L, C) with every row's selected tokens replaced by
    ``fresh`` (packed in ``layout``), in one operator, also when ``cached`` is a strided view (of
    a step block: ``feeder``), which is indexed as it is, not copied to contiguous rows first."""
    base = cached.reshape(*cached.shape[:2], -1).to(fresh.dtype)
    values = fresh.reshape(fresh.shape[0], -1)
    if layout.is_full:
        return values.reshape(*cached.shape[:2], *fresh.shape[1:])
    merged = base.index_put((layout.row_of_token, layout.packed_tokens), values)
    return merged.view(*cached.shape[:2], *fresh.shape[1:])


def merge_all_rows_after(
    cached: torch.Tensor, layout: RowLayout, fresh: torch.Tensor, prefix: torch.Tensor
) -> torch.Tensor:
    """(rows, P + L, ...): ``prefix`` (rows, P, ...) then what ``merge_all_rows`` gives, built in
    one buffer."""
    out = _prefixed(cached, fresh.shape[1:], prefix)
    out.view(-1, *fresh.shape[1:]).index_copy_(0, layout.places_after(prefix.shape[1]), fresh)
    return out


def _prefixed(cached: torch.Tensor, per_token, prefix: torch.Tensor) -> torch.Tensor:
    """(g, P + L, *per_token): ``prefix`` then ``cached`` (g, L, C), in one new buffer."""
    return torch.cat([prefix, cached.reshape(*cached.shape[:2], *per_token).to(prefix.dtype)], 1)


class UnitIO:
    """What one unit's forward reads and records beyond its inputs, through the forward's
    context: its cached tensors merged with the fresh tokens, its recorded tensors, the rows'
    adapters and how attention is batched."""

    def __init__(self, ctx: ForwardContext, unit: int):
        self.lora, self.padded = ctx.lora, ctx.padded_attention
        self._ctx, self._unit = ctx, unit

    def merge(self, name: str, layout: RowLayout, fresh: torch.Tensor) -> torch.Tensor:
        return self._ctx.merge_cached(self._unit, name, layout, fresh)

    def merge_after(
        self, name: str, layout: RowLayout, fresh: torch.Tensor, prefix: torch.Tensor
    ) -> torch.Tensor:
        return self._ctx.merge_cached_after(self._unit, name, layout, fresh, prefix)

    def merge_group_after(
        self,
        name: str,
        layout: RowLayout,
        group: tuple[int, int],
        fresh: torch.Tensor,
        prefix: torch.Tensor,
    ) -> torch.Tensor:
        return self._ctx.merge_group_after(self._unit, name, layout, group, fresh, prefix)

    def record(self, name: str, value: torch.Tensor) -> None:
        self._ctx.record(self._unit, name, value)


class _UnitTimer:
    def __init__(self, sink: dict[int, float], unit: int, device: torch.device):
        self.sink, self.unit, self.device = sink, unit, device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        self._sync()
        self.started = time.perf_counter()

    def __exit__(self, *exc):
        self._sync()
        self.sink[self.unit] = self.sink.get(self.unit, 0.0) + time.perf_counter() - self.started


_ACTIVE: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "maskserve_ctx", default=None
)


# The context of a forward that ``torch.compile`` traces whole (``traced_call``; None: the
# model's ordinary forward): the compiler cannot trace a ContextVar, but it follows module globals
# that the traced function sets. One traced forward at a time per process (the caller holds
# ``compiled.STEP_LOCK``).
_TRACING = False
_TRACED: ForwardContext | None = None


def current_context() -> ForwardContext | None:
    return _TRACED if _TRACING else _ACTIVE.get()


def traced_call(ctx: ForwardContext | None, call: Callable, *args, **kwargs):
    """``call(*args, **kwargs)`` with ``ctx`` active, in a form ``torch.compile`` traces whole."""
    global _TRACING, _TRACED
    _TRACING, _TRACED = True, ctx
    try:
        return call(*args, **kwargs)
    finally:
        _TRACING, _TRACED = False, None


@contextlib.contextmanager
def active_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _ACTIVE.set(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.reset(token)

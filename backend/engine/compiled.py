"""Compiled steps: a bucketed step's whole denoiser forward as one ``torch.compile`` graph.

A step's forward (the UNet's ResNets, resamplers and mask-aware stacks, or every Flux block) is
traced whole (``fullgraph=True``, static shapes) with its context made of plain tensors and
constants: the cached tensors of every row fetched first (``FetchedCache``) and the layouts of
every grid resolved first (``FixedLayouts``). A graph therefore depends only on the step's shape
(rows bucket, token bucket of each grid, cache mode, which units read the cache, the inputs'
shapes) and every template, mask and step of that shape replays it. Without CUDA graphs the graph
still fuses the forward's small operators, which on a device bound by launching operators is
most of the gain; one graph per step, not one per block, also pays the compiled call's fixed
costs (guards, input checks) once.

Modes (``engine.compile_steps``): ``auto`` (``compile_mode``); ``off``; ``default`` (inductor's
fused kernels); ``reduce-overhead`` (those kernels replayed from CUDA graphs that the compiler
captures per shape, copying inputs into its static buffers: CUDA only); ``max-autotune`` (CUDA
graphs and kernels tuned at compile time, much longer to compile).

Rules: a step runs compiled only when its layouts are bucketed and no row has an adapter and no
unit is timed (``step_compiles``), and when the engine's graph book admits its shape; everything
else runs eagerly through the same forward functions, so compiled and eager compute the same
operations. One traced forward runs at a time per process (``STEP_LOCK``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

import torch

from backend.engine.cache_store import tensor_name
from backend.engine.context import ForwardContext, traced_call
from backend.engine.graph_book import GraphBook
from backend.engine.layout import RowLayout

log = logging.getLogger(__name__)

# graphs the compiled step keeps: models x resolutions x row and token buckets x cache modes
RECOMPILE_LIMIT = 256
COMPILE_MODES = ("auto", "off", "default", "reduce-overhead", "max-autotune")
STEP_LOCK = threading.Lock()  # the traced forward's context is a module global


def check_compile_mode(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} is not known: use {', '.join(COMPILE_MODES)}")
    return mode


def compile_mode(choice: str, device_type: str) -> str:
    """The mode steps on a ``device_type`` device compile in: ``auto`` replays CUDA graphs on
    CUDA, whose steps are bound by launching operators, and compiles nothing on the CPU (a first
    step of each shape would wait tens of seconds there)."""
    if choice != "auto":
        return choice
    return "reduce-overhead" if device_type == "cuda" else "off"


_compiled: dict[str, Callable] = {}


def _compiled_forward(mode: str) -> Callable:
    """``_step_forward`` compiled whole with static shapes in ``mode`` (made once per mode)."""
    if mode not in _compiled:
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        _compiled[mode] = torch.compile(_step_forward, fullgraph=True, dynamic=False, mode=mode)
    return _compiled[mode]


def _step_forward(ctx: ForwardContext | None, forward: Callable, *args):
    return traced_call(ctx, forward, *args)


class FetchedCache:
    """A step's cached tensors of every row, fetched before its compiled forward runs
    (``context.CacheSource``): plain tensors by (unit, name), or every row's step block and its
    layout (``feeder.BatchCacheFeeder.rows_block``: one input, each tensor a view of it made in
    the graph). Read by the traced forward."""

    def __init__(self, tensors: dict[tuple[int, str], torch.Tensor], block=None):
        self.tensors, self.block = tensors, block

    def rows_tensor(self, unit: int, name: str, rows: tuple[int, int], fill: bool = False):
        if self.block is not None:
            block, layout = self.block
            tensor = layout.tensor(block, tensor_name(unit, name))
        else:
            tensor = self.tensors[(unit, name)]
        return tensor if rows == (0, tensor.shape[0]) else tensor[rows[0] : rows[1]]

    def wait_for(self, unit: int) -> None:
        pass


class FixedLayouts:
    """A step's layouts on each of its grids, resolved before its compiled forward runs
    (``context.LayoutSource``)."""

    def __init__(self, source, grids: list[tuple[int, int]]):
        self.masked = {grid: source.layout(grid) for grid in grids}
        self.dense = {h * w: source.dense_layout(h * w) for h, w in grids}

    def layout(self, grid_hw: tuple[int, int]) -> RowLayout:
        return self.masked[grid_hw]

    def dense_layout(self, num_tokens: int) -> RowLayout:
        return self.dense[num_tokens]

    def grid_of(self, num_tokens: int) -> tuple[int, int]:
        """The grid of ``num_tokens`` tokens (a traced Flux forward reads its grid here, not off
        its position ids: the engine built them for this grid)."""
        return next(grid for grid in self.masked if grid[0] * grid[1] == num_tokens)


def _fetch(ctx: ForwardContext, names: tuple[str, ...]) -> FetchedCache:
    """Every tensor ``names`` the context's cached units hold, of all rows (zeros for a row
    without a cache): their step block when the rows have one on the device."""
    tensors: dict[tuple[int, str], torch.Tensor] = {}
    if ctx.cache is None:
        return FetchedCache(tensors)
    rows = (0, ctx.num_rows)
    rows_block = getattr(ctx.cache, "rows_block", None)
    block = rows_block(rows, True) if rows_block is not None else None
    if block is not None:
        return FetchedCache(tensors, block)
    for unit in range(len(ctx.use_cache)):
        if not ctx.uses_cache(unit):
            continue
        ctx.cache.wait_for(unit)
        for name in names:
            try:
                tensors[(unit, name)] = ctx.cache.rows_tensor(unit, name, rows, True)
            except KeyError:  # a tensor only some units keep (a stack's last ``delta``)
                continue
    return FetchedCache(tensors)


def step_compiles(ctx: ForwardContext) -> bool:
    """Whether a step over ``ctx`` runs compiled: bucketed, compiling, no adapter, no timing."""
    return (
        ctx.compile_steps != "off"
        and ctx.layouts is not None
        and ctx.lora is None
        and ctx.unit_seconds is None
    )


def compiled_step(
    ctx: ForwardContext,
    ordinary: bool,
    forward: Callable,
    grids: list[tuple[int, int]],
    names: tuple[str, ...],
    *args,
) -> torch.Tensor | None:
    """``forward(*args)`` (``FamilyAdapter.forward``) of a bucketed step, compiled whole in
    ``ctx.compile_steps``: with ``ctx`` active (its cached tensors ``names`` fetched and its
    layouts on ``grids`` resolved first), or, ``ordinary``, as the model's own forward (a dense
    step that records nothing). None when the graph book refuses the step's shape: the caller
    runs it eagerly, as when the compiler fails on it (the shape is then never tried again).
    On CUDA a new graph's first run measures the device memory it took."""
    layouts = FixedLayouts(ctx.layouts, grids)
    shape = tuple((g, lay.max_tokens, lay.is_full) for g, lay in layouts.masked.items())
    graph = (forward.__qualname__, ordinary, ctx.num_rows, shape, ctx.mode, tuple(ctx.use_cache))
    graph += (ctx.recorder is not None, ctx.compile_steps)
    graph += tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))
    book = ctx.graphs
    new = book is not None and graph not in book.shapes
    if book is not None and not book.admits(graph):
        return None
    traced = None
    if not ordinary:
        fetched = _fetch(ctx, names)
        traced = dataclasses.replace(ctx, cache=fetched, layouts=layouts, compile_steps="off")
    run = _compiled_forward(ctx.compile_steps)
    if new and torch.device(ctx.device).type == "cuda":
        run = _measured(run, book, graph, torch.device(ctx.device))
    try:
        with STEP_LOCK:  # what the traced forward records goes to ``ctx.recorder`` (one dict)
            return run(traced, forward, *args)
    except torch._dynamo.exc.TorchDynamoException as exc:
        # a model the compiler cannot take (its error names why) is served eagerly, not failed;
        # raised before the graph ran, so nothing was recorded or changed
        log.warning("step shape not compiled, runs eagerly: %s", str(exc).splitlines()[0])
        if book is not None:
            book.fail(graph)
        return None


def _measured(run: Callable, book, graph, device: torch.device) -> Callable:
    """``run``, recording in ``book`` the device memory its first call (a graph made) reserved."""

    def measured(*args):
        before = torch.cuda.memory_reserved(device)
        out = run(*args)
        book.record_bytes(graph, torch.cuda.memory_reserved(device) - before)
        return out

    return measured


def release_graphs(book: GraphBook | None) -> int:
    """Drop every compiled graph (and the memory of their CUDA graphs) and empty ``book``; the
    bytes the book had recorded for them. Compiled again as steps need them."""
    torch.compiler.reset()
    _compiled.clear()
    return book.clear() if book is not None else 0

"""Compiled unit forwards: one ``torch.compile`` graph per shape of a bucketed step.

A unit's forward (one transformer block on its packed tokens) is compiled whole
(``fullgraph=True``, static shapes): its inputs are plain tensors and constants
(``context.FetchedUnitIO``), so a graph depends only on the step's shape (rows, tokens, width)
and every template, mask and step of that shape replays it. Without CUDA graphs captured by the
compiler (``mode="reduce-overhead"`` or ``"max-autotune"`` on CUDA) the graph still fuses the
unit's small operators, which on a device bound by launching operators is most of the gain.

Modes (``engine.compile_units``): ``off``; ``default`` (inductor's fused kernels);
``reduce-overhead`` (those kernels replayed from CUDA graphs that the compiler captures per shape,
copying inputs into its static buffers: CUDA only); ``max-autotune`` (CUDA graphs and kernels
tuned at compile time, much longer to compile).

Rules: a unit runs compiled only when the context asks for it and its layout is regular (a
bucketed step), with no adapter, nothing recorded and no per-unit timing
(``compiles``); everything else runs eagerly through the same forward function, so compiled and
eager compute the same operations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backend.engine.context import FetchedUnitIO, ForwardContext, UnitIO
from backend.engine.graph_book import GraphBook
from backend.engine.layout import RowLayout

# graphs a compiled forward keeps: units of a few widths x row and token buckets x cache modes
RECOMPILE_LIMIT = 256
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")


def check_compile_mode(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} is not known: use {', '.join(COMPILE_MODES)}")
    return mode


_compiled: dict[tuple[Callable, str], Callable] = {}


def compiled_units(forward: Callable, mode: str = "default") -> Callable:
    """``forward`` compiled whole with static shapes (made once per function and mode)."""
    key = (forward, mode)
    if key not in _compiled:
        _allow_recompiles()
        _compiled[key] = torch.compile(forward, fullgraph=True, dynamic=False, mode=mode)
    return _compiled[key]


def compile_module(module: torch.nn.Module, mode: str) -> None:
    """``module`` compiled whole in ``mode``, a graph per input shape (once per module)."""
    if not getattr(module, "_maskserve_compiled", False):
        _allow_recompiles()
        module.compile(fullgraph=True, dynamic=False, mode=mode)
        module._maskserve_compiled = True


def _allow_recompiles() -> None:
    """Blocks of one class share one code object, compiled again per shape: allow them all."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)


def unit_forward(
    ctx: ForwardContext,
    unit: int,
    layout: RowLayout,
    forward,
    reads: tuple[str, ...],
    block: torch.nn.Module,
):
    """(forward, io) of one unit: ``forward`` compiled, with the unit's cached tensors ``reads``
    of every row fetched ahead (``FetchedUnitIO``), when ``compiles`` and the context's graph
    book admits the graph (its signature: the forward, the block's width, the layout's shape and
    the tensors read); else ``forward`` itself, reading and recording through the context
    (``UnitIO``). On CUDA a graph's first run measures the device memory it took."""
    if compiles(ctx, layout):
        book = ctx.graphs
        width = tuple(next(block.parameters()).shape)
        graph = (forward.__qualname__, width, layout.num_rows, layout.max_tokens, layout.num_tokens)
        graph += (reads, ctx.compile_units)
        new = book is not None and graph not in book.shapes
        if book is None or book.admits(graph):
            rows = (0, layout.num_rows)
            io = FetchedUnitIO({name: ctx.cached(unit, name, rows, True) for name in reads})
            run = compiled_units(forward, ctx.compile_units)
            if new and torch.device(ctx.device).type == "cuda":
                run = _measured(run, book, graph, torch.device(ctx.device))
            return run, io
    return forward, UnitIO(ctx, unit)


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


def compiles(ctx: ForwardContext, layout: RowLayout) -> bool:
    """Whether a unit of ``ctx``'s forward over ``layout`` runs compiled."""
    return (
        ctx.compile_units != "off"
        and layout.regular
        and ctx.lora is None
        and ctx.recorder is None
        and ctx.unit_seconds is None
    )

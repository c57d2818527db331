"""Per-row LoRA adapters inside one denoiser forward.

Rows of one batch may carry different adapters (or none), each with its own scale. Every
LoRA-targeted projection computes its base output once for all packed tokens (the fused matmul of
``attention.fused_linear``) and then adds each adapter's low-rank delta
``scale * (x @ down.T) @ up.T`` to the tokens of the rows carrying it, in one of two forms
(``EngineSettings.lora_batching``):

* ``grouped``: per adapter, per run of consecutive tokens of rows carrying it, two thin matmuls on
  views (no gather, no scatter, no merged weight per row). The work is each row's own ranks, the
  operators grow with the adapters and runs of the batch.
* ``stacked``: every adapter of the batch on a module stacked into one down and one up matrix
  (``StackedWeights``, kept per adapter set across forwards), so a module's deltas are three
  operators whatever the batch: ``y += ((x @ downs.T) * scales) @ ups``, ``scales`` (tokens,
  ranks) holding each token's row scale on its row's adapters' columns and 0 elsewhere. Every
  token computes every adapter's ranks: fewer operators for more arithmetic, the trade a GPU bound
  by launching operators wants, and on the CPU measured within noise or faster up to 24
  adapters in a batch of 8 requests (docs/bench/batch-ops.md): the default.

Invariants: a ``BatchLora`` is built for one forward and never outlives it; a row without adapters
gets exactly the base output (grouped: its tokens are never touched; stacked: it adds exact
zeros); ``scale`` on a pair is the adapter's own ``alpha / rank`` (PEFT's ``scaling``), the
per-row scale the request's, so a row's delta is ``row_scale * pair.scale * up(down(x))`` as PEFT
computes it after ``set_adapters(weights=...)``.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.activations import GEGLU, GELU

from backend.engine.attention import fused_linear
from backend.engine.host import to_device
from backend.engine.layout import RowLayout

# Linear layers the mask-aware forwards route through ``BatchLora`` (module names inside the
# denoiser). Adapters may target these only: other layers (ResNet convolutions, norms' modulation
# linears, time embeddings) run through their stock forward, which knows nothing of rows.
_UNET_STACK = r"(down_blocks\.\d+|mid_block|up_blocks\.\d+)\.attentions\.\d+\."
_UNET_BLOCK = (
    r"transformer_blocks\.\d+\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"
)
_FLUX_DOUBLE = (
    r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
    r"|to_add_out)|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))"
)
_FLUX_SINGLE = r"single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out)"
TARGET_PATTERNS: dict[str, re.Pattern[str]] = {
    "unet": re.compile(rf"{_UNET_STACK}(proj_in|proj_out|{_UNET_BLOCK})"),
    "flux": re.compile(rf"(x_embedder|context_embedder|proj_out|{_FLUX_DOUBLE}|{_FLUX_SINGLE})"),
}

RowAdapters = tuple[tuple[str, float], ...]  # one row's (adapter id, scale) pairs
LORA_BATCHING = ("grouped", "stacked")


def check_lora_batching(choice: str) -> str:
    if choice not in LORA_BATCHING:
        raise ValueError(f"lora batching {choice!r} is not known: use {', '.join(LORA_BATCHING)}")
    return choice


@dataclass(frozen=True)
class LoraPair:
    """One adapter's low-rank update of one linear layer: ``delta(x) = scale * up(down(x))``."""

    down: torch.Tensor  # (rank, in_features): PEFT's lora_A
    up: torch.Tensor  # (out_features, rank): PEFT's lora_B
    scale: float  # alpha / rank

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's pairs by the name of the denoiser module each updates."""

    adapter_id: str
    pairs: Mapping[str, LoraPair]

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for p in self.pairs.values() for t in (p.down, p.up)
        )

    def to(
        self, device: torch.device | str, dtype: torch.dtype, non_blocking: bool = False
    ) -> LoraAdapter:
        def move(t: torch.Tensor) -> torch.Tensor:
            if non_blocking and t.device.type == "cpu":
                t = t.pin_memory()  # an asynchronous host -> device copy needs pinned memory
            return t.to(device, dtype, non_blocking=non_blocking)

        return LoraAdapter(
            self.adapter_id,
            {name: LoraPair(move(p.down), move(p.up), p.scale) for name, p in self.pairs.items()},
        )


def lora_targets(denoiser: torch.nn.Module, kind: str) -> dict[str, torch.nn.Linear]:
    """The denoiser's linear layers adapters may update, by module name (``kind``: unet | flux)."""
    pattern = TARGET_PATTERNS[kind]
    return {
        name: module
        for name, module in denoiser.named_modules()
        if type(module) is torch.nn.Linear and pattern.fullmatch(name)
    }


def check_adapter(adapter: LoraAdapter, targets: Mapping[str, torch.nn.Linear]) -> None:
    """Raise ``ValueError`` naming the first pair that does not fit a target layer's shape."""
    for name, pair in adapter.pairs.items():
        layer = targets.get(name)
        if layer is None:
            raise ValueError(
                f"adapter {adapter.adapter_id} updates {name}, which is not a layer adapters may "
                "update in this model (attention, feed-forward and projection linears of its "
                "transformer blocks)"
            )
        expected = (layer.in_features, layer.out_features)
        if (pair.down.shape[1], pair.up.shape[0]) != expected or pair.up.shape[1] != pair.rank:
            raise ValueError(
                f"adapter {adapter.adapter_id}'s {name} maps {pair.down.shape[1]} -> "
                f"{pair.up.shape[0]} features (rank {pair.rank}), the layer {expected[0]} -> "
                f"{expected[1]}: the adapter was trained for another model"
            )


@dataclass(frozen=True)
class Segments:
    """Where each row's tokens lie in a projection's flattened input: (row, start, stop) spans in
    input order (a row may have several: Flux's single-stream [text ; image] sequence)."""

    spans: tuple[tuple[int, int, int], ...]


# Row tokens of a projection's input: a packed layout, the segments of an input built from several
# parts (``BatchLora.text_then_packed``), or None when the input's leading dimension is the row
# (rows, tokens, C).
TokenRows = RowLayout | Segments | None


@dataclass(frozen=True)
class _Slice:
    """One adapter on one module: its pair and each batch row's scale (0: the row lacks it)."""

    key: str  # adapter id: token runs are memoised per adapter
    pair: LoraPair
    row_scale: tuple[float, ...]


@dataclass(frozen=True)
class _Stack:
    """The adapters of a batch on one module, stacked in slice order."""

    down: torch.Tensor  # (ranks, in_features): each adapter's down times its pair's scale
    up: torch.Tensor  # (ranks, out_features): each adapter's up, transposed
    ranks: tuple[int, ...]  # each slice's rank: its block of columns


class StackedWeights:
    """The stacked form's weights (``_Stack`` per module and slice order), kept per adapter set
    across forwards, so a set that lasts many steps is stacked once. The ``KEEP_SETS`` sets used
    last are kept (a worker stepping two groups of rows, two resolutions say, alternates two sets
    every step), older ones dropped: the device holds the batch's adapters at most that many
    times more."""

    KEEP_SETS = 2

    def __init__(self) -> None:
        self._sets: OrderedDict[frozenset[str], dict[tuple[int, tuple[str, ...]], _Stack]] = (
            OrderedDict()
        )

    def use(self, adapter_set: frozenset[str]) -> None:
        """The next forward's adapters: their stacks, made as its layers ask for them."""
        self._sets[adapter_set] = self._sets.pop(adapter_set, {})
        while len(self._sets) > self.KEEP_SETS:
            self._sets.popitem(last=False)

    def forget(self, adapter_id: str) -> None:
        """Drop the stacks holding ``adapter_id``'s weights (dropped, or put again)."""
        for adapter_set in [held for held in self._sets if adapter_id in held]:
            del self._sets[adapter_set]

    def stack(self, module: torch.nn.Module, slices: Sequence[_Slice]) -> _Stack:
        stacks = next(reversed(self._sets.values()))  # the set of the last ``use``
        key = (id(module), tuple(piece.key for piece in slices))
        if key not in stacks:
            stacks[key] = _Stack(
                down=torch.cat([piece.pair.down * piece.pair.scale for piece in slices]),
                up=torch.cat([piece.pair.up for piece in slices], dim=1).t().contiguous(),
                ranks=tuple(piece.pair.rank for piece in slices),
            )
        return stacks[key]


class BatchLora:
    """The per-row adapters of one batch, indexed by the module each pair updates.

    Rows of a batch lie in contiguous token spans of every projection input (a request's CFG
    halves next to each other), so an adapter's tokens are a few runs of consecutive tokens.
    Grouped (``stacked`` None), each run is a slice of the input and of the output (views, no
    gather or scatter), and its delta is two matmuls added in place: ``y[run] += (scale * x[run] @
    down.T) @ up.T``. Stacked, a module's adapters are one ``_Stack`` and each token's scales one
    row of a (tokens, ranks) matrix, memoised per input layout and slice order."""

    def __init__(
        self,
        slices: dict[int, list[_Slice]],
        device: torch.device | str,
        stacked: StackedWeights | None = None,
    ):
        self._slices, self._device, self._stacked = slices, torch.device(device), stacked
        self._runs: dict[tuple[int, str], list[tuple[int, int, float]]] = {}
        self._segments: dict[tuple, Segments] = {}
        self._token_rows: dict[int, torch.Tensor] = {}
        self._token_scales: dict[tuple[int, tuple[str, ...]], torch.Tensor] = {}

    @classmethod
    def build(
        cls,
        targets: Mapping[str, torch.nn.Module],
        adapters: Mapping[str, LoraAdapter],
        rows: Sequence[RowAdapters],
        device: torch.device | str,
        stacked: StackedWeights | None = None,
    ) -> BatchLora | None:
        """None when no row carries an adapter. ``adapters`` must hold every id the rows name,
        already on ``device`` in the model's dtype. With ``stacked`` the deltas run stacked, its
        weights kept for this set of adapters."""
        scales: dict[str, list[float]] = {}
        for row, row_adapters in enumerate(rows):
            for adapter_id, scale in row_adapters:
                if adapter_id not in adapters:
                    raise KeyError(f"adapter {adapter_id} is not loaded")
                per_row = scales.setdefault(adapter_id, [0.0] * len(rows))
                per_row[row] += float(scale)
        if not scales:
            return None
        slices: dict[int, list[_Slice]] = {}
        # adapters in id order: the stacks of one set keep one slice order whatever the rows' order
        for adapter_id, row_scale in sorted(scales.items()):
            for name, pair in adapters[adapter_id].pairs.items():
                module = targets[name]
                slices.setdefault(id(module), []).append(_Slice(adapter_id, pair, tuple(row_scale)))
        if stacked is not None:
            stacked.use(frozenset(scales))
        return cls(slices, device, stacked)

    def touches(self, *modules: torch.nn.Module) -> bool:
        return any(id(m) in self._slices for m in modules)

    def add(
        self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rows: TokenRows
    ) -> torch.Tensor:
        """``y`` (the base output of ``module`` on ``x``) plus each adapter's delta on its rows."""
        slices = self._slices.get(id(module))
        if not slices:
            return y
        segments = self._segments_of(x, rows)
        flat_x = x.reshape(-1, x.shape[-1])
        # a view of ``y`` where its layout allows (the caller's fresh projection output, or a
        # column block of the fused one: adding in place touches no other block), else a copy
        flat_y = y.reshape(-1, y.shape[-1])
        if self._stacked is not None:
            stack = self._stacked.stack(module, slices)
            scales = self._scales_of(segments, rows, slices, stack)
            low = F.linear(flat_x, stack.down).mul_(scales)
            return flat_y.addmm_(low, stack.up).reshape(y.shape)
        for piece in slices:
            for start, stop, scale in self._runs_of(segments, piece):
                low = F.linear(flat_x[start:stop], piece.pair.down).mul_(scale)
                flat_y[start:stop].addmm_(low, piece.pair.up.t())
        return flat_y.reshape(y.shape)

    def _scales_of(
        self, segments: Segments, rows: TokenRows, slices: Sequence[_Slice], stack: _Stack
    ) -> torch.Tensor:
        """(tokens, ranks): each token's row scale on the columns of the adapters its row carries,
        0 elsewhere; memoised per layout and slices. A packed layout's rows per token are its own
        (on the device already); other inputs' are built from their spans once per forward."""
        key = (id(segments), tuple(piece.key for piece in slices))
        if key not in self._token_scales:
            per_row = torch.tensor([piece.row_scale for piece in slices]).t()  # (rows, slices)
            columns = per_row.repeat_interleave(torch.tensor(stack.ranks), dim=1)
            row_scales = to_device(columns.to(stack.down.dtype), self._device)
            self._token_scales[key] = row_scales.index_select(
                0, self._rows_per_token(segments, rows)
            )
        return self._token_scales[key]

    def _rows_per_token(self, segments: Segments, rows: TokenRows) -> torch.Tensor:
        if isinstance(rows, RowLayout):
            return rows.row_of_token
        if id(segments) not in self._token_rows:
            owners = torch.tensor([row for row, _, _ in segments.spans])
            lengths = torch.tensor([stop - start for _, start, stop in segments.spans])
            self._token_rows[id(segments)] = to_device(
                owners.repeat_interleave(lengths), self._device
            )
        return self._token_rows[id(segments)]

    def _segments_of(self, x: torch.Tensor, rows: TokenRows) -> Segments:
        if isinstance(rows, Segments):
            return rows
        if isinstance(rows, RowLayout):
            key: tuple = ("layout", id(rows))
            if key not in self._segments:
                offsets = rows.offsets
                self._segments[key] = Segments(
                    tuple((r, offsets[r], offsets[r + 1]) for r in range(rows.num_rows))
                )
            return self._segments[key]
        length = x[0].numel() // x.shape[-1]
        key = ("leading", x.shape[0], length)
        if key not in self._segments:
            self._segments[key] = Segments(
                tuple((r, r * length, (r + 1) * length) for r in range(x.shape[0]))
            )
        return self._segments[key]

    def _runs_of(self, segments: Segments, piece: _Slice) -> list[tuple[int, int, float]]:
        """(start, stop, scale) runs of consecutive tokens of rows carrying ``piece``'s adapter
        at one scale (times the pair's own scale); memoised per input layout and adapter."""
        key = (id(segments), piece.key)
        if key not in self._runs:
            runs: list[tuple[int, int, float]] = []
            for row, start, stop in segments.spans:
                scale = piece.row_scale[row]
                if scale == 0 or start == stop:
                    continue
                if runs and runs[-1][1] == start and runs[-1][2] == scale:
                    runs[-1] = (runs[-1][0], stop, scale)
                else:
                    runs.append((start, stop, scale))
            self._runs[key] = runs
        return [(start, stop, scale * piece.pair.scale) for start, stop, scale in self._runs[key]]

    def text_then_packed(self, text: torch.Tensor, packed: RowLayout) -> Segments:
        """Segments of ``cat([text.flatten(0, 1), packed tokens])``: Flux's single-stream
        sequence of every row's text (rows, T, C), then the packed image tokens; memoised."""
        key = ("text+packed", id(packed), text.shape[0], text.shape[1])
        if key not in self._segments:
            rows, length = text.shape[0], text.shape[1]
            text_spans = tuple((r, r * length, (r + 1) * length) for r in range(rows))
            offset = rows * length
            image_spans = tuple(
                (r, offset + packed.offsets[r], offset + packed.offsets[r + 1])
                for r in range(packed.num_rows)
            )
            self._segments[key] = Segments(text_spans + image_spans)
        return self._segments[key]


def project(
    lora: BatchLora | None,
    x: torch.Tensor,
    modules: Sequence[torch.nn.Module],
    rows: TokenRows,
) -> tuple[torch.Tensor, ...]:
    """``fused_linear`` of ``modules`` on ``x``, each output plus its rows' adapter deltas."""
    outputs = fused_linear(x, modules)
    if lora is None:
        return outputs
    return tuple(lora.add(m, x, y, rows) for m, y in zip(modules, outputs))


def linear(
    lora: BatchLora | None, module: torch.nn.Module, x: torch.Tensor, rows: TokenRows
) -> torch.Tensor:
    """``module(x)`` plus the rows' adapter deltas."""
    y = module(x)
    return y if lora is None else lora.add(module, x, y, rows)


def feed_forward(
    lora: BatchLora | None, ff: torch.nn.Module, x: torch.Tensor, rows: TokenRows
) -> torch.Tensor:
    """diffusers ``FeedForward`` on ``x`` with adapter deltas on its two linears. Without an
    adapter on them the stock forward runs."""
    if lora is None or not lora.touches(*ff.modules()):
        return ff(x)
    hidden = x
    for module in ff.net:
        if type(module) is GEGLU:
            value, gate = linear(lora, module.proj, hidden, rows).chunk(2, dim=-1)
            hidden = value * module.gelu(gate)
        elif type(module) is GELU:
            hidden = module.gelu(linear(lora, module.proj, hidden, rows))
        elif type(module) is torch.nn.Linear:
            hidden = linear(lora, module, hidden, rows)
        elif isinstance(module, torch.nn.Dropout):
            hidden = module(hidden)
        else:
            raise TypeError(
                f"adapters on a feed-forward with a {type(module).__name__} are not supported"
            )
    return hidden


class ResidentAdapters:
    """The adapters on the compute device that rows may name, checked against the model's layers
    once when they arrive. The worker's adapter tiers decide what is here; the engine reads it."""

    def __init__(self, denoiser: torch.nn.Module, kind: str):
        self._denoiser, self._kind = denoiser, kind
        self._targets: dict[str, torch.nn.Linear] | None = None
        self._loaded: dict[str, LoraAdapter] = {}
        self._stacked = StackedWeights()

    @property
    def targets(self) -> dict[str, torch.nn.Linear]:
        if self._targets is None:
            self._targets = lora_targets(self._denoiser, self._kind)
        return self._targets

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._loaded

    def ids(self) -> tuple[str, ...]:
        return tuple(self._loaded)

    def put(self, adapter: LoraAdapter) -> None:
        """Check ``adapter`` against the model (``ValueError`` when it does not fit) and keep it
        on the model's device in the model's dtype."""
        check_adapter(adapter, self.targets)
        weight = next(iter(self.targets.values())).weight
        self._loaded[adapter.adapter_id] = adapter.to(weight.device, weight.dtype)
        self._stacked.forget(adapter.adapter_id)  # an id put again may bring other weights

    def drop(self, adapter_id: str) -> None:
        self._loaded.pop(adapter_id, None)
        self._stacked.forget(adapter_id)

    def batch(
        self, rows: Sequence[RowAdapters], device: torch.device | str, stacked: bool = False
    ) -> BatchLora | None:
        """The ``BatchLora`` of one forward (None when no row names an adapter); ``stacked``: in
        the stacked form (module docstring)."""
        if not any(rows):
            return None
        return BatchLora.build(
            self.targets, self._loaded, rows, device, self._stacked if stacked else None
        )

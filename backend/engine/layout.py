"""Ragged token layout of a batch: which tokens of each row are computed fresh.

A batch has ``num_rows`` rows over one token grid of ``num_tokens`` tokens per row. Row ``r``
computes the tokens ``indices[r]`` (sorted, unique). Token-wise ops run on a *packed* tensor
``(total, C)`` that concatenates the selected tokens of every row in row order, so no row is
padded to the largest mask. Invariants: ``offsets[r + 1] - offsets[r] == len(indices[r])`` and
``flat_index`` addresses the same tokens in a ``(num_rows * num_tokens, C)`` view.

A *bucketed* layout (``bucketed_layout``) has static shapes: every row holds the same number of
tokens, a bucket (``backend.engine.buckets``) at least its longest row's count; a row's places past
its own count repeat its last selected token. A repeated token reads the same input as the token it
repeats, so it computes the same values and writes them to the same place: it changes no real
output. ``counts`` keeps each row's own count, so a row is read as full (no cache merged) only when
it selects every token itself.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from backend.engine.host import to_device_together


@dataclass(frozen=True)
class RowLayout:
    num_tokens: int
    indices: tuple[torch.Tensor, ...]  # per row: LongTensor of selected token ids
    offsets: tuple[int, ...]  # len num_rows + 1; packed row r is [offsets[r], offsets[r+1])
    flat_index: torch.Tensor  # LongTensor (total,): row * num_tokens + token
    row_of_token: torch.Tensor  # LongTensor (total,): the row each packed token belongs to
    is_full: bool  # every row selects every token (dense)
    # Runs [start, stop) of consecutive rows selecting identical tokens (e.g. the CFG halves of one
    # request): ops that work per row can run once per run, batched.
    groups: tuple[tuple[int, int], ...] = ()
    # Each packed token's place in a (num_rows * max_tokens, ...) tensor whose rows are padded to
    # the longest row (``max_tokens``); None when every row has ``max_tokens`` tokens (the packed
    # tensor is that tensor already).
    padded_index: torch.Tensor | None = None
    counts: tuple[int, ...] = ()  # tokens each row selects itself (its padding not counted)
    tokens: torch.Tensor | None = None  # LongTensor (total,): each packed token's grid id
    # bucketed: every row holds one bucket of tokens, and ops over rows run once for all of them
    # (a row that reads no cache selects every token, so cache values under it are overwritten)
    regular: bool = False
    # derived index tensors, made once per layout (``places_after``)
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return len(self.indices)

    @property
    def total(self) -> int:
        return self.offsets[-1]

    @property
    def every_row_partial(self) -> bool:
        """Every row selects fewer than all tokens (so every row reads a cache, where one is)."""
        return all(count < self.num_tokens for count in self.counts)

    def places_after(self, num_prefix: int) -> torch.Tensor:
        """Each packed token's place in the flattened (rows, P + L) tensor of ``num_prefix``
        tokens before every row's grid (token t of row r at r * (P + L) + P + t); made once per
        layout and prefix length."""
        key = ("after", num_prefix)
        if torch.compiler.is_compiling():  # a compiled step computes it in its graph
            return self.flat_index + (self.row_of_token + 1) * num_prefix
        if key not in self._derived:
            self._derived[key] = self.flat_index + (self.row_of_token + 1) * num_prefix
        return self._derived[key]

    def row_is_full(self, row: int) -> bool:
        """Row ``row`` selects every token itself (it reads no cache)."""
        return self.counts[row] == self.num_tokens

    @property
    def packed_tokens(self) -> torch.Tensor:
        """Each packed token's grid id (total,)."""
        assert self.tokens is not None  # both constructors set it
        return self.tokens

    @property
    def max_tokens(self) -> int:
        """Tokens of the longest row."""
        return max(b - a for a, b in zip(self.offsets, self.offsets[1:]))

    def gather(self, full: torch.Tensor) -> torch.Tensor:
        """(num_rows, num_tokens, C) -> packed (total, C), in one operator also when ``full`` is a
        strided view (indexed in place, not copied to contiguous rows first)."""
        if self.is_full:
            return full.reshape(-1, full.shape[-1])
        if not full.is_contiguous():
            return full[self.row_of_token, self.packed_tokens]
        return full.reshape(-1, full.shape[-1]).index_select(0, self.flat_index)

    def scatter_into(self, base: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Return ``base`` (num_rows, num_tokens, C) with this layout's tokens replaced by
        ``packed``."""
        if self.is_full:
            return packed.reshape(base.shape)
        flat = base.reshape(-1, base.shape[-1])
        return flat.index_copy(0, self.flat_index, packed.to(flat.dtype)).reshape(base.shape)

    def group_tokens(self, packed: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
        """Packed rows of one group as (rows, tokens, ...)."""
        start, stop = group
        return packed[self.offsets[start] : self.offsets[stop]].reshape(
            stop - start, -1, *packed.shape[1:]
        )

    def by_row(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed (total, C) as (rows, tokens, C) when every row holds as many tokens (a view);
        else the packed tensor itself. Pairs with ``row_values``."""
        return packed.view(self.num_rows, -1, packed.shape[-1]) if self.regular else packed

    def row_values(self, per_row: torch.Tensor) -> torch.Tensor:
        """(num_rows, C) row values against ``by_row`` tokens: broadcast views when the layout is
        regular (no operator), else each packed token's row value (``expand_rows``)."""
        return per_row.unsqueeze(1) if self.regular else self.expand_rows(per_row)

    def expand_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        """(num_rows, C) row values -> each packed token's row value, for elementwise ops on packed
        (total, C) tensors: (total, C), or ``per_row`` itself when there is one row (it broadcasts,
        so no copy is made)."""
        if len(self.indices) == 1:
            return per_row
        return per_row.index_select(0, self.row_of_token)


def make_layout(row_masks: list[torch.Tensor], device: torch.device | str = "cpu") -> RowLayout:
    """Layout from one flat bool mask (num_tokens,) per row; True = computed fresh. Built on the
    host for all rows at once (a few operations whatever the number of rows: on a GPU bound by
    launching operators each is host time), moved to ``device`` in one copy."""
    if not row_masks:
        raise ValueError("a layout needs at least one row")
    num_tokens = int(row_masks[0].numel())
    if any(mask.numel() != num_tokens for mask in row_masks):
        raise ValueError("all rows of a layout must share one token grid")
    masks = torch.stack([mask if mask.dim() == 1 else mask.reshape(-1) for mask in row_masks])
    if masks.device.type != "cpu":  # a nonzero on the GPU would wait for it (data-sized result)
        masks = masks.cpu()
    # (row, token) of every selected token, rows in order and tokens sorted within each row
    row_of_token, tokens = torch.nonzero(masks).t().contiguous()
    counts = masks.sum(dim=1).tolist()
    offsets = [0, *itertools.accumulate(counts)]
    indices = tokens.split(counts)
    flat = row_of_token * num_tokens + tokens
    moved = to_device_together(
        [*indices, flat, row_of_token, tokens, *_padded_places(offsets, row_of_token)], device
    )
    indices, (flat_index, row_of_token, tokens, *padded) = (
        moved[: len(indices)],
        moved[len(indices) :],
    )
    return RowLayout(
        num_tokens,
        tuple(indices),
        tuple(offsets),
        flat_index,
        row_of_token,
        offsets[-1] == num_tokens * len(row_masks),
        _runs(masks),
        padded[0] if padded else None,
        tuple(counts),
        tokens,
    )


def _padded_places(offsets: list[int], row_of_token: torch.Tensor) -> list[torch.Tensor]:
    """``RowLayout.padded_index`` on the host (empty when every row has as many tokens): token j
    of row r at r * longest + j, in a few operations whatever the number of rows."""
    counts = [stop - start for start, stop in zip(offsets, offsets[1:])]
    width = max(counts)
    if min(counts) == width:
        return []
    starts = torch.tensor(offsets[:-1])
    return [torch.arange(offsets[-1]) + row_of_token * width - starts[row_of_token]]


def _runs(masks: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Runs [start, stop) of consecutive rows of ``masks`` (rows, num_tokens) that are equal."""
    differs = (masks[1:] != masks[:-1]).any(dim=1).tolist() if len(masks) > 1 else []
    starts = [0, *(row + 1 for row, changed in enumerate(differs) if changed)]
    return tuple(zip(starts, [*starts[1:], len(masks)]))


def full_layout(num_rows: int, num_tokens: int, device: torch.device | str = "cpu") -> RowLayout:
    ones = torch.ones(num_tokens, dtype=torch.bool)
    return make_layout([ones] * num_rows, device)


@dataclass(frozen=True, eq=False)
class RowTokens:
    """One request's selected tokens on one grid, on the compute device, built once when the
    request is admitted: ``ordered`` (num_tokens,) holds the ``count`` selected token ids, sorted,
    then the last of them repeated, so its first ``b`` entries are the request's row in a bucket of
    ``b >= count`` tokens (a view: no operator). ``pattern`` identifies the selection on the host
    (equal patterns: equal selections). Compared by identity (a layout memo keys on it)."""

    ordered: torch.Tensor
    count: int
    pattern: bytes

    @property
    def num_tokens(self) -> int:
        return int(self.ordered.numel())


def row_tokens(mask: torch.Tensor | None, num_tokens: int, device) -> RowTokens:
    """``RowTokens`` of a flat bool ``mask`` (None: every token), in one host -> device copy."""
    if mask is None:
        return RowTokens(to_device_together([torch.arange(num_tokens)], device)[0], num_tokens, b"")
    flat = mask.reshape(-1).cpu()
    if flat.numel() != num_tokens:
        raise ValueError(f"a token mask of {flat.numel()} tokens on a grid of {num_tokens}")
    selected = torch.nonzero(flat).reshape(-1)
    count = int(selected.numel())
    if count == 0:
        raise ValueError("a row selects at least one token")
    ordered = torch.cat([selected, selected[-1:].expand(num_tokens - count)])
    pattern = b"" if count == num_tokens else flat.numpy().tobytes()
    return RowTokens(to_device_together([ordered], device)[0], count, pattern)


class RowPlaces:
    """Per (rows, tokens per row, grid tokens): the device tensors of a regular batch that do not
    depend on which tokens the rows select (built once each, kept; a few shapes recur)."""

    def __init__(self, device) -> None:
        self.device = device
        self._memo: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, rows: int, width: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row_of_token, row start in the flat grid of each packed token), each (rows * width,)."""
        key = (rows, width, num_tokens)
        if key not in self._memo:
            row_of_token = torch.arange(rows).repeat_interleave(width)
            self._memo[key] = tuple(  # type: ignore[assignment]
                to_device_together([row_of_token, row_of_token * num_tokens], self.device)
            )
        return self._memo[key]


def bucketed_layout(rows: list[RowTokens], width: int, places: RowPlaces) -> RowLayout:
    """The regular layout of ``rows``, each holding ``width`` tokens (a bucket at least the longest
    row's count): two device operators (a concatenation and an add), no host -> device copy."""
    if not rows:
        raise ValueError("a layout needs at least one row")
    num_tokens = rows[0].num_tokens
    if any(row.num_tokens != num_tokens for row in rows):
        raise ValueError("all rows of a layout must share one token grid")
    if not max(row.count for row in rows) <= width <= num_tokens:
        raise ValueError(f"a bucket of {width} tokens cannot hold these rows on {num_tokens}")
    indices = tuple(row.ordered[:width] for row in rows)
    tokens = torch.cat(indices) if len(indices) > 1 else indices[0]
    row_of_token, row_start = places.get(len(rows), width, num_tokens)
    starts = [0, *(r + 1 for r in range(len(rows) - 1) if rows[r + 1].pattern != rows[r].pattern)]
    return RowLayout(
        num_tokens,
        indices,
        tuple(range(0, width * len(rows) + 1, width)),
        tokens + row_start,
        row_of_token,
        all(row.count == num_tokens for row in rows),
        tuple(zip(starts, [*starts[1:], len(rows)])),
        None,
        tuple(row.count for row in rows),
        tokens,
        regular=True,
    )

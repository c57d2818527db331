"""Ragged token layout of a batch: which tokens of each row are computed fresh.

A batch has ``num_rows`` rows over one token grid of ``num_tokens`` tokens per row. Row ``r``
computes the tokens ``indices[r]`` (sorted, unique). Token-wise ops run on a *packed* tensor
``(total, C)`` that concatenates the selected tokens of every row in row order, so no row is
padded to the largest mask. Invariants: ``offsets[r + 1] - offsets[r] == len(indices[r])`` and
``flat_index`` addresses the same tokens in a ``(num_rows * num_tokens, C)`` view.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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

    @property
    def num_rows(self) -> int:
        return len(self.indices)

    @property
    def total(self) -> int:
        return self.offsets[-1]

    @property
    def every_row_partial(self) -> bool:
        """Every row selects fewer than all tokens (so every row reads a cache, where one is)."""
        return all(idx.numel() < self.num_tokens for idx in self.indices)

    @property
    def max_tokens(self) -> int:
        """Tokens of the longest row."""
        return max(b - a for a, b in zip(self.offsets, self.offsets[1:]))

    def gather(self, full: torch.Tensor) -> torch.Tensor:
        """(num_rows, num_tokens, C) -> packed (total, C)."""
        if self.is_full:
            return full.reshape(-1, full.shape[-1])
        return full.reshape(-1, full.shape[-1]).index_select(0, self.flat_index)

    def scatter_into(self, base: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Return ``base`` (num_rows, num_tokens, C) with this layout's tokens replaced by
        ``packed``."""
        if self.is_full:
            return packed.reshape(base.shape)
        out = base.reshape(-1, base.shape[-1]).clone()
        out.index_copy_(0, self.flat_index, packed.to(out.dtype))
        return out.reshape(base.shape)

    def group_tokens(self, packed: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
        """Packed rows of one group as (rows, tokens, ...)."""
        start, stop = group
        return packed[self.offsets[start] : self.offsets[stop]].reshape(
            stop - start, -1, *packed.shape[1:]
        )

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
        [*indices, flat, row_of_token, *_padded_places(offsets, row_of_token)], device
    )
    indices, (flat_index, row_of_token, *padded) = moved[: len(indices)], moved[len(indices) :]
    return RowLayout(
        num_tokens,
        tuple(indices),
        tuple(offsets),
        flat_index,
        row_of_token,
        offsets[-1] == num_tokens * len(row_masks),
        _runs(masks),
        padded[0] if padded else None,
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

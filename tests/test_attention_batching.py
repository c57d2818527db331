"""Padded attention and the all-rows cache merges against their per-group forms (small tensors,
no model): the same values, whatever the rows' token counts."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from backend.config import AttentionBatching
from backend.engine.attention import (
    ATTENTION_BATCHING,
    attend,
    check_attention_batching,
    pad_rows,
    padded_attention,
    pads_attention,
    ragged_attention,
    unpad_rows,
)
from backend.engine.context import ForwardContext
from backend.engine.layout import make_layout

TOKENS, HEADS, DIM = 12, 2, 4


def _masks(*selected: tuple[int, ...]) -> list[torch.Tensor]:
    masks = []
    for tokens in selected:
        mask = torch.zeros(TOKENS, dtype=torch.bool)
        mask[list(tokens)] = True
        masks.append(mask)
    return masks


# three requests of two CFG rows each, selecting 3, 5 and 1 tokens
ROW_MASKS = _masks(*[(0, 1, 2)] * 2, *[(3, 5, 6, 7, 11)] * 2, *[(9,)] * 2)


class _Cache:
    """A cache source over one (rows, L, C) tensor per name."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def rows_tensor(
        self, unit: int, name: str, rows: tuple[int, int], fill: bool = False
    ) -> torch.Tensor:
        return self.tensors[name][rows[0] : rows[1]]

    def wait_for(self, unit: int) -> None:
        pass


def test_layout_places_each_row_in_the_padded_tensor():
    layout = make_layout(ROW_MASKS)
    assert layout.groups == ((0, 2), (2, 4), (4, 6)) and layout.max_tokens == 5
    packed = torch.arange(float(layout.total)).unsqueeze(1)
    padded = pad_rows(packed, layout)
    assert padded.shape == (6, 5, 1)
    assert padded[0, :, 0].tolist() == [0, 1, 2, 0, 0] and padded[5, :, 0].tolist() == [
        17,
        0,
        0,
        0,
        0,
    ]
    assert torch.equal(unpad_rows(padded, layout), packed)
    uniform = make_layout(_masks((1, 2), (4, 5)))
    assert uniform.padded_index is None and pad_rows(torch.ones(4, 3), uniform).shape == (2, 2, 3)


def test_padded_attention_equals_one_call_per_group():
    torch.manual_seed(0)
    layout = make_layout(ROW_MASKS)
    query = torch.randn(layout.total, HEADS, DIM)
    key, value = torch.randn(2, 6, TOKENS, HEADS, DIM)

    def kv_for_group(group):
        return key[group[0] : group[1]], value[group[0] : group[1]]

    grouped = ragged_attention(query, layout, kv_for_group)
    assert torch.allclose(padded_attention(query, layout, key, value), grouped, atol=1e-6)
    assert torch.allclose(ragged_attention(query, layout, kv_for_group, True), grouped, atol=1e-6)
    first = attend(query[:3].reshape(1, 3, HEADS, DIM), key[:1], value[:1]).reshape(3, HEADS, DIM)
    assert torch.allclose(grouped[:3], first, atol=1e-6)


def _context(layout_masks, cached: dict[str, torch.Tensor]) -> ForwardContext:
    return ForwardContext(layout_masks, [True], "kv", _Cache(cached))


def test_all_rows_cache_merges_equal_the_per_group_merges():
    torch.manual_seed(1)
    layout = make_layout(ROW_MASKS)
    cached = torch.randn(6, TOKENS, HEADS * DIM)
    fresh = torch.randn(layout.total, HEADS, DIM)
    prefix = torch.randn(6, 3, HEADS, DIM)
    ctx = _context([None] * 6, {"k": cached})
    per_group = [
        ctx.merge_group(0, "k", layout, g, layout.group_tokens(fresh, g)) for g in layout.groups
    ]
    assert torch.equal(ctx.merge_cached(0, "k", layout, fresh), torch.cat(per_group))
    after = [
        ctx.merge_group_after(0, "k", layout, g, layout.group_tokens(fresh, g), prefix[g[0] : g[1]])
        for g in layout.groups
    ]
    merged = ctx.merge_cached_after(0, "k", layout, fresh, prefix)
    assert torch.equal(merged, torch.cat(after))
    # each row: its prefix, then the cache with its own tokens replaced by its fresh ones
    assert torch.equal(merged[2, :3], prefix[2]) and torch.equal(merged[2, 3 + 5], fresh[6 + 1])
    assert torch.equal(merged[2, 3 + 4], cached[2, 4].reshape(HEADS, DIM))


def test_a_row_without_cache_merges_group_by_group():
    """A row that selects every token reads no cache: the merges fall back to one group at a
    time (its rows_tensor would have no cache to give)."""
    masks = ROW_MASKS[:2] + [torch.ones(TOKENS, dtype=torch.bool)] * 2
    layout = make_layout(masks)
    cached = torch.randn(4, TOKENS, HEADS * DIM)
    cached[2:] = float("nan")  # never read
    fresh = torch.randn(layout.total, HEADS, DIM)
    merged = _context([None] * 4, {"k": cached}).merge_cached_after(
        0, "k", layout, fresh, torch.zeros(4, 1, HEADS, DIM)
    )
    assert not merged.isnan().any() and torch.equal(
        merged[2:, 1:], fresh[6:].reshape(2, TOKENS, HEADS, DIM)
    )


def test_attention_batching_choices():
    assert get_args(AttentionBatching) == ATTENTION_BATCHING
    assert pads_attention("auto", torch.device("cuda", 0))
    assert not pads_attention("auto", torch.device("cpu"))
    assert pads_attention("padded", torch.device("cpu"))
    assert not pads_attention("grouped", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="use auto, grouped, padded"):
        check_attention_batching("dense")


def test_a_layout_built_for_all_rows_at_once_matches_one_built_row_by_row():
    """``make_layout`` works on all rows together: its indices, offsets, flat index, rows of the
    packed tokens and runs of equal rows are what a row-by-row construction gives, with empty and
    full rows and equal neighbours among them."""
    generator = torch.Generator().manual_seed(3)
    shared = torch.rand(40, generator=generator) < 0.3
    masks = [
        shared,
        shared.clone(),  # equal to the row before: one run
        torch.zeros(40, dtype=torch.bool),  # selects nothing
        torch.ones(40, dtype=torch.bool),  # selects every token
        torch.rand(40, generator=generator) < 0.5,
        torch.rand(40, generator=generator) < 0.5,
    ]
    layout = make_layout(masks)
    expected = [torch.nonzero(m).reshape(-1) for m in masks]
    assert [idx.tolist() for idx in layout.indices] == [idx.tolist() for idx in expected]
    counts = [len(idx) for idx in expected]
    assert list(layout.offsets) == [sum(counts[:r]) for r in range(len(masks) + 1)]
    assert layout.flat_index.tolist() == [
        row * 40 + token for row, idx in enumerate(expected) for token in idx.tolist()
    ]
    assert layout.row_of_token.tolist() == [row for row, n in enumerate(counts) for _ in range(n)]
    assert layout.groups == ((0, 2), (2, 3), (3, 4), (4, 5), (5, 6))
    assert not layout.is_full and make_layout([torch.ones(40, dtype=torch.bool)] * 3).is_full
    assert make_layout([shared]).groups == ((0, 1),)
    with pytest.raises(ValueError, match="share one token grid"):
        make_layout([shared, torch.ones(41, dtype=torch.bool)])
    with pytest.raises(ValueError, match="at least one row"):
        make_layout([])

"""Ragged attention: each row's fresh queries attend over that row's full key/value set.

Queries arrive packed ``(total, heads, head_dim)`` (see ``layout.RowLayout``); keys and values are
assembled per row by the caller, so rows with different masks, templates and steps share one call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

KVForRow = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(n, H, d) x (m, H, d) x (m, H, d) -> (n, H, d) scaled dot-product attention, no mask."""
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
    )
    return out.squeeze(0).transpose(0, 1)


def ragged_attention(query: torch.Tensor, offsets: tuple[int, ...], kv_for_row: KVForRow) -> torch.Tensor:
    """Packed queries (total, H, d) -> packed outputs; row r's queries use ``kv_for_row(r)``."""
    outputs = []
    for row in range(len(offsets) - 1):
        start, stop = offsets[row], offsets[row + 1]
        if stop == start:
            continue
        key, value = kv_for_row(row)
        outputs.append(attend(query[start:stop], key, value))
    if not outputs:
        return query.new_zeros(query.shape)
    return torch.cat(outputs, dim=0)


def replace_rows(base: torch.Tensor, indices: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Copy of ``base`` (L, ...) with rows ``indices`` replaced by ``fresh``; key order is kept, so
    attention over the result matches dense attention bit for bit when nothing changed."""
    out = base.to(fresh.dtype).clone()
    out.index_copy_(0, indices, fresh)
    return out

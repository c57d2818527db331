"""Ragged attention: each row's fresh queries attend over that row's full key/value set.

Queries arrive packed ``(total, heads, head_dim)`` (see ``layout.RowLayout``); keys and values are
assembled per row by the caller, so rows with different masks, templates and steps share one call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from backend.engine.layout import RowLayout

Group = tuple[int, int]
KVForGroup = Callable[[Group], tuple[torch.Tensor, torch.Tensor]]


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(g, n, H, d) x (g, m, H, d) x (g, m, H, d) -> (g, n, H, d) scaled dot-product attention."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    )
    return out.transpose(1, 2)


def ragged_attention(
    query: torch.Tensor, layout: RowLayout, kv_for_group: KVForGroup
) -> torch.Tensor:
    """Packed queries (total, H, d) -> packed outputs. Each group of rows that select the same
    tokens runs as one batched call with keys/values ``kv_for_group(group)`` of shape (g, m, H, d)."""
    outputs = []
    for group in layout.groups:
        q = layout.group_tokens(query, group)
        if q.shape[1] == 0:
            continue
        key, value = kv_for_group(group)
        outputs.append(attend(q, key, value).reshape(-1, *query.shape[1:]))
    if not outputs:
        return query.new_zeros(query.shape)
    return torch.cat(outputs, dim=0)


def replace_rows(base: torch.Tensor, indices: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Copy of ``base`` (g, L, ...) with tokens ``indices`` replaced by ``fresh`` (g, n, ...); key
    order is kept, so attention over the result matches dense attention when nothing changed."""
    out = base.to(fresh.dtype).clone()
    out.index_copy_(1, indices, fresh)
    return out


def fused_linear(x: torch.Tensor, modules) -> tuple[torch.Tensor, ...]:
    """Outputs of several ``nn.Linear`` reading the same input, from ONE matmul.

    The concatenated weight of each set of modules is built on first use and kept on the first
    module (outside its state dict, one entry per set, so sets sharing a first module do not evict
    each other); it is rebuilt whenever any weight moves, changes dtype or is replaced.
    """
    first = modules[0]
    key = tuple(
        (m.weight.data_ptr(), m.weight.dtype, m.weight.device, m.weight._version) for m in modules
    )
    fused_sets = first.__dict__.setdefault("_maskserve_fused", {})
    fused = fused_sets.get(tuple(id(m) for m in modules))
    if fused is None or fused[0] != key:
        weight = torch.cat([m.weight for m in modules])
        biases = [
            m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules
        ]
        bias = torch.cat(biases) if any(m.bias is not None for m in modules) else None
        fused = (key, weight.detach(), None if bias is None else bias.detach())
        fused_sets[tuple(id(m) for m in modules)] = fused
    return F.linear(x, fused[1], fused[2]).split([m.out_features for m in modules], dim=-1)

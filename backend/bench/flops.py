"""FLOP counting for the ideal-speedup figure: torch's counter for matmuls and convolutions plus an
analytic count for scaled dot-product attention (the CPU SDPA kernel is invisible to the
counter)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode


class FlopCount:
    def __init__(self) -> None:
        self.counter = FlopCounterMode(display=False)
        self.attention_flops = 0

    @property
    def total(self) -> int:
        return self.counter.get_total_flops() + self.attention_flops


@contextlib.contextmanager
def count_flops() -> Iterator[FlopCount]:
    """Count FLOPs of everything run inside: 2*M*N*K per matmul, 4*Lq*Lk*d per attention head."""
    count = FlopCount()
    original = F.scaled_dot_product_attention

    def counting_sdpa(query, key, value, *args, **kwargs):
        batch = 1
        for dim in query.shape[:-2]:
            batch *= dim
        count.attention_flops += 4 * batch * query.shape[-2] * key.shape[-2] * query.shape[-1]
        return original(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = counting_sdpa
    torch.nn.functional.scaled_dot_product_attention = counting_sdpa
    try:
        with count.counter:
            yield count
    finally:
        F.scaled_dot_product_attention = original
        torch.nn.functional.scaled_dot_product_attention = original

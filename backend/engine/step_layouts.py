"""Bucketed layouts of a batch, built when its composition changes, not at every step.

A request's selected tokens on each grid are put on the device once, when it is admitted
(``RowTokens``). A batch's layout on a grid is then two device operators over those tensors
(``layout.bucketed_layout``), and ``LayoutMemo`` keeps it for as long as the same rows step
together: in a continuous batch most steps build no layout at all and copy nothing to the device.

Invariants: a memoised layout is returned only for the same ``RowTokens`` objects in the same
order and the same bucket (keys hold the objects, compared by identity); the memo holds at most
``capacity`` layouts, least recently used dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from backend.engine.buckets import TOKENS_PER_OCTAVE, token_bucket
from backend.engine.layout import RowLayout, RowPlaces, RowTokens, bucketed_layout, row_tokens

# A request's tokens on one grid (gh, gw).
TokensOf = Callable[[tuple[int, int]], RowTokens]


class LayoutMemo:
    """The engine's bucketed layouts, by (grid tokens, rows' ``RowTokens``, bucket)."""

    def __init__(self, device, capacity: int = 64, per_octave: int = TOKENS_PER_OCTAVE) -> None:
        self.device = torch.device(device)
        self.capacity, self.per_octave = capacity, per_octave
        self.places = RowPlaces(self.device)
        self._layouts: OrderedDict[tuple, RowLayout] = OrderedDict()
        self._full: dict[int, RowTokens] = {}
        self.built = 0  # layouts built (a memo hit builds none): what the tests count

    def full_tokens(self, num_tokens: int) -> RowTokens:
        """Every token of a grid of ``num_tokens`` (one tensor per grid size, shared by rows)."""
        if num_tokens not in self._full:
            self._full[num_tokens] = row_tokens(None, num_tokens, self.device)
        return self._full[num_tokens]

    def layout(self, rows: Sequence[RowTokens]) -> RowLayout:
        """Bucketed layout of ``rows`` (every row in the bucket of the longest)."""
        num_tokens = rows[0].num_tokens
        width = token_bucket(max(row.count for row in rows), num_tokens, self.per_octave)
        key = (width, *rows)
        found = self._layouts.get(key)
        if found is not None:
            self._layouts.move_to_end(key)
            return found
        built = bucketed_layout(list(rows), width, self.places)
        self.built += 1
        self._layouts[key] = built
        if len(self._layouts) > self.capacity:
            self._layouts.popitem(last=False)
        return built


class StepLayouts:
    """The layouts of one step's rows (``context.LayoutSource``): row ``r`` takes its tokens from
    ``tokens_of[r]`` (None: every token)."""

    def __init__(self, tokens_of: Sequence[TokensOf | None], memo: LayoutMemo) -> None:
        self.tokens_of, self.memo = tokens_of, memo

    def layout(self, grid_hw: tuple[int, int]) -> RowLayout:
        num_tokens = grid_hw[0] * grid_hw[1]
        return self.memo.layout(
            [
                self.memo.full_tokens(num_tokens) if tokens is None else tokens(grid_hw)
                for tokens in self.tokens_of
            ]
        )

    def dense_layout(self, num_tokens: int) -> RowLayout:
        return self.memo.layout([self.memo.full_tokens(num_tokens)] * len(self.tokens_of))

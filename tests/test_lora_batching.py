"""The stacked form of per-row LoRA deltas against the grouped form (small tensors, no model):
the same values whatever the rows' adapters and scales, a constant number of operators per layer
whatever the batch's adapters, and stacked weights kept while the batch's adapter set holds."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.config import LoraBatching
from backend.engine.layout import make_layout
from backend.engine.lora import (
    LORA_BATCHING,
    BatchLora,
    LoraAdapter,
    LoraPair,
    ResidentAdapters,
    check_lora_batching,
)

IN, OUT, TOKENS = 16, 24, 12


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(IN, OUT)


def _adapter(adapter_id: str, rank: int, seed: int, scale: float = 0.5) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    return LoraAdapter(
        adapter_id,
        {
            "proj": LoraPair(
                torch.randn(rank, IN, generator=generator),
                torch.randn(OUT, rank, generator=generator),
                scale,
            )
        },
    )


def _resident(*adapters: LoraAdapter) -> tuple[_Layer, ResidentAdapters]:
    layer = _Layer()
    resident = ResidentAdapters(layer, "unet")
    resident._targets = {"proj": layer.proj}  # the toy layer's name matches no UNet pattern
    for adapter in adapters:
        resident.put(adapter)
    return layer, resident


def _packed_layout(*selected: tuple[int, ...]):
    masks = []
    for tokens in selected:
        mask = torch.zeros(TOKENS, dtype=torch.bool)
        mask[list(tokens)] = True
        masks.append(mask)
    return make_layout(masks, torch.device("cpu"))


ADAPTERS = (_adapter("a", 2, 1), _adapter("b", 4, 2, 1.0), _adapter("c", 8, 3, 0.25))
# five rows: none, one adapter, two at their own scales, the third alone, two again
ROWS = ((), (("a", 1.0),), (("a", 0.4), ("b", 1.5)), (("c", -0.8),), (("b", 0.3), ("c", 1.0)))


def _deltas(stacked: bool, x: torch.Tensor, rows_of_x) -> torch.Tensor:
    layer, resident = _resident(*ADAPTERS)
    lora = resident.batch(ROWS, "cpu", stacked=stacked)
    with torch.no_grad():
        return lora.add(layer.proj, x, layer.proj(x), rows_of_x)


def test_stacked_equals_grouped_on_packed_tokens():
    layout = _packed_layout((0, 1, 2), (3, 5, 6, 7, 11), (9,), (), (2, 4, 8, 10))
    x = torch.randn(layout.total, IN)
    grouped, stacked = _deltas(False, x, layout), _deltas(True, x, layout)
    torch.testing.assert_close(stacked, grouped, rtol=1e-5, atol=1e-5)
    layer = _Layer()
    with torch.no_grad():
        base = layer.proj(x)
    # the first row carries no adapter: exactly the base output; every other row changed
    assert torch.equal(stacked[:3], base[:3])
    assert (stacked[3:] - base[3:]).abs().amax(dim=1).min() > 1e-3


def test_stacked_equals_grouped_on_rows_of_whole_sequences():
    x = torch.randn(len(ROWS), TOKENS, IN)
    torch.testing.assert_close(_deltas(True, x, None), _deltas(False, x, None))


def _operators(lora: BatchLora, layer: _Layer, x: torch.Tensor, layout) -> int:
    class _Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.calls += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), _Count():
        lora.add(layer.proj, x, layer.proj(x), layout)
    return _Count.calls


@pytest.mark.parametrize("stacked", (False, True))
def test_operators_per_layer(stacked):
    """Stacked: as many operators with three adapters on five rows as with one adapter on one
    row (the scales built at the first call, then reused); grouped: more."""
    layout = _packed_layout((0, 1, 2), (3, 5, 6, 7, 11), (9,), (1, 2), (2, 4, 8, 10))
    x = torch.randn(layout.total, IN)
    counts = []
    for rows in ((("a", 1.0),), *[()] * 4), ROWS:
        layer, resident = _resident(*ADAPTERS)
        lora = resident.batch(rows, "cpu", stacked=stacked)
        _operators(lora, layer, x, layout)  # scales and stacks built here
        counts.append(_operators(lora, layer, x, layout))
    assert (counts[0] == counts[1]) if stacked else (counts[0] < counts[1])


def test_stacks_are_kept_for_the_last_adapter_sets():
    layer, resident = _resident(*ADAPTERS)
    x = torch.randn(2, TOKENS, IN)

    def stack_after(rows):
        lora = resident.batch(rows, "cpu", stacked=True)
        with torch.no_grad():
            lora.add(layer.proj, x, layer.proj(x), None)
        keys = tuple(sorted({adapter_id for row in rows for adapter_id, _ in row}))
        return resident._stacked._sets[frozenset(keys)][(id(layer.proj), keys)]

    first = stack_after(((("a", 1.0),), (("b", 0.5),)))
    # the same set in another row order and at other scales: the same stacked weights
    assert stack_after(((("b", 2.0),), (("a", 0.1),))) is first
    # two sets alternating (two groups of rows stepped in turn): both kept
    other = stack_after(((("c", 1.0),), ()))
    assert stack_after(((("a", 1.0),), (("b", 0.5),))) is first
    assert stack_after(((("c", 0.3),), ())) is other
    # a third set: the one used longest ago goes
    stack_after(((("a", 1.0),), (("c", 0.5),)))
    assert frozenset(("a", "b")) not in resident._stacked._sets
    again = stack_after(((("a", 1.0),), (("b", 0.5),)))
    assert again is not first and torch.equal(again.down, first.down)
    # a dropped adapter's weights leave with the stacks that hold them, only those
    resident.drop("c")
    assert list(resident._stacked._sets) == [frozenset(("a", "b"))]
    resident.put(_adapter("b", 4, 9))  # an id put again with other weights: its stacks go too
    assert not resident._stacked._sets


def test_lora_batching_choices():
    assert get_args(LoraBatching) == LORA_BATCHING
    with pytest.raises(ValueError, match="use grouped, stacked"):
        check_lora_batching("merged")

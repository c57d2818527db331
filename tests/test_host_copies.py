"""Host -> device copies (``backend.engine.host``) and the layouts built with them: values arrive
unchanged, one copy serves several index tensors, and a layout's indices are the mask's."""

from __future__ import annotations

import pytest
import torch

from backend.engine.host import to_device, to_device_together
from backend.engine.layout import make_layout


def test_to_device_keeps_values_and_is_a_no_op_on_the_same_device():
    values = torch.arange(6.0).reshape(2, 3)
    assert to_device(values, "cpu") is values
    assert torch.equal(to_device(values, torch.device("cpu")), values)


def test_to_device_together_returns_each_tensor_in_its_shape():
    parts = [
        torch.tensor([3, 1]),
        torch.arange(6).reshape(2, 3),
        torch.tensor([], dtype=torch.long),
    ]
    moved = to_device_together(parts, "cpu")
    assert [m.shape for m in moved] == [p.shape for p in parts]
    assert all(torch.equal(m, p) for m, p in zip(moved, parts))


def test_a_layout_from_host_masks_selects_each_rows_tokens():
    first = torch.tensor([True, False, True, False])
    second = torch.tensor([False, False, False, True])
    layout = make_layout([first, first, second])
    assert [i.tolist() for i in layout.indices] == [[0, 2], [0, 2], [3]]
    assert layout.offsets == (0, 2, 4, 5)
    assert layout.flat_index.tolist() == [0, 2, 4, 6, 11]
    assert layout.row_of_token.tolist() == [0, 0, 1, 1, 2]
    assert layout.groups == ((0, 2), (2, 3)) and not layout.is_full


@pytest.mark.gpu
def test_copies_to_cuda_are_queued_without_waiting_for_the_gpu():
    values = torch.arange(1000, dtype=torch.float32)
    torch.cuda.set_sync_debug_mode("error")  # any wait for the GPU raises
    try:
        moved = to_device(values, "cuda")
        indices = to_device_together([torch.tensor([1, 2]), torch.tensor([5])], "cuda")
        layout = make_layout([torch.tensor([True, False, True])] * 2, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(moved.cpu(), values)
    assert [i.tolist() for i in indices] == [[1, 2], [5]]
    assert layout.flat_index.tolist() == [0, 2, 3, 5]

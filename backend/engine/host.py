"""Host -> device copies that never make the host wait for the device.

A plain ``tensor.to("cuda")`` of pageable host memory ends with a stream synchronisation: Python
waits until every kernel queued before it has run, the GPU's queue runs dry, and the kernels after
it start only as fast as Python launches them. In the middle of a denoising step that turns a
compute-bound step into a launch-bound one. From pinned memory with ``non_blocking=True`` the copy
is queued like a kernel instead; PyTorch's pinned-memory cache keeps the staging buffer alive until
the copy has run, so a pageable source may be dropped or changed at once. A source that is pinned
already (a cache in the host-RAM tier) is copied from directly: it must not be written until the
copy has run, and the engine never writes one.

Invariant: the values arrive exactly as they are; only when the host learns of completion changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``, queued without blocking the host when it moves host -> CUDA."""
    target = torch.device(device)
    if target.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(target)
    return tensor.pin_memory().to(target, non_blocking=True)


def to_device_together(
    tensors: Sequence[torch.Tensor], device: torch.device | str
) -> list[torch.Tensor]:
    """Host tensors of one dtype on ``device`` through ONE copy (small index tensors: one transfer
    rather than one each), returned as views of it in their own shapes."""
    target = torch.device(device)
    if target.type != "cuda":  # already there: no operator at all
        return [t if t.device == target else t.to(target) for t in tensors]
    flat = to_device(torch.cat([t.reshape(-1) for t in tensors]), target)
    parts = flat.split([t.numel() for t in tensors])
    return [part.view(t.shape) for part, t in zip(parts, tensors)]

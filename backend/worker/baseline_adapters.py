"""LoRA adapters in the baseline worker, as a diffusers user applies them: before a pipeline
call load each adapter file (``load_lora_weights``), weight them (``set_adapters``) and fuse them
into the denoiser's weights (``fuse_lora``); after it, unfuse and unload them.

Invariants: after ``fused_adapters`` exits, normally or by an exception, the pipeline holds no
adapter and its weights are the base model's again (up to the float rounding of adding and
subtracting the fused deltas); a call without adapters touches nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from backend.protocol import AdapterUse

# sha256 -> the adapter's file as its user has it (diffusers/PEFT or kohya layout)
AdapterFiles = Callable[[str], Path]


@contextlib.contextmanager
def fused_adapters(pipe, uses: Sequence[AdapterUse], files: AdapterFiles | None) -> Iterator[None]:
    """The call's adapters fused into ``pipe`` for the duration of the block."""
    if not uses:
        yield
        return
    if files is None:
        raise ValueError("this baseline worker has no adapter files: it serves the base model only")
    names = [f"a{index}" for index in range(len(uses))]
    try:
        for name, use in zip(names, uses):
            path = files(use.sha256)
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
        pipe.set_adapters(names, [use.scale for use in uses])
        pipe.fuse_lora(adapter_names=names)
        try:
            yield
        finally:
            pipe.unfuse_lora()
    finally:
        pipe.unload_lora_weights()

"""LoRA adapters in the baseline worker, as a diffusers user applies them: before a pipeline
call load each adapter file (``load_lora_weights``), weight them (``set_adapters``) and fuse them
into the denoiser's weights (``fuse_lora``); after it, unfuse and unload them.

Invariants: after ``fused_adapters`` exits, normally or by an exception, the pipeline holds no
adapter and its weights are the base model's again (up to the float rounding of adding and
subtracting the fused deltas); a call without adapters touches nothing. The dict it yields holds,
once it has exited, the seconds each phase took (``ADAPTER_PHASES``): what a user's baseline pays
for its adapters besides denoising.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from backend.protocol import AdapterUse

# sha256 -> the adapter's file as its user has it (diffusers/PEFT or kohya layout)
AdapterFiles = Callable[[str], Path]
# the job timings the baseline records per call with adapters (seconds)
ADAPTER_PHASES = ("adapter_load_s", "adapter_fuse_s", "adapter_unfuse_s")


@contextlib.contextmanager
def fused_adapters(
    pipe, uses: Sequence[AdapterUse], files: AdapterFiles | None
) -> Iterator[dict[str, float]]:
    """The call's adapters fused into ``pipe`` for the duration of the block; yields the phases'
    seconds (filled as they end; empty for a call without adapters)."""
    phases: dict[str, float] = {}
    if not uses:
        yield phases
        return
    if files is None:
        raise ValueError("this baseline worker has no adapter files: it serves the base model only")
    names = [f"a{index}" for index in range(len(uses))]
    started = time.perf_counter()
    try:
        for name, use in zip(names, uses):
            path = files(use.sha256)
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
        pipe.set_adapters(names, [use.scale for use in uses])
        loaded = time.perf_counter()
        phases["adapter_load_s"] = loaded - started
        pipe.fuse_lora(adapter_names=names)
        phases["adapter_fuse_s"] = time.perf_counter() - loaded
        try:
            yield phases
        finally:
            started = time.perf_counter()
            pipe.unfuse_lora()
    finally:
        pipe.unload_lora_weights()
        if "adapter_fuse_s" in phases:
            phases["adapter_unfuse_s"] = time.perf_counter() - started

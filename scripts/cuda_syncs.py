"""Count the host-device synchronisations in one mask-aware denoising step of each tiny model on
CUDA (``torch.cuda.set_sync_debug_mode``), grouped by the line of code that caused them. A step
should have one: the engine's own wait at its end (``MaskAwareEngine.step`` times the forward).

    PYTHONPATH=. python3 scripts/cuda_syncs.py [models_dir]
"""

from __future__ import annotations

import collections
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backend.cache import MemoryTemplateCache
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.models import load_pipeline, resolve_model
from templates_store.samples import sample_template

SIZE = 128


def count_syncs(model_id: str, models_dir: Path, cache_dir: Path) -> collections.Counter:
    spec = resolve_model(model_id)
    engine = MaskAwareEngine(load_pipeline(model_id, models_dir, device="cuda"), spec, cache_dir)
    template = sample_template(SIZE, SIZE, seed=7)
    pixels = np.zeros((SIZE, SIZE), dtype=np.uint8)
    pixels[32:80, 40:96] = 255
    params = EditParams(
        steps=4, guidance=spec.default_guidance, size=(SIZE, SIZE), record_on_first_edit=False
    )
    cache = MemoryTemplateCache.load(engine.prepare_template(template, params).path, True)
    state = engine.start(template, Image.fromarray(pixels), "a vase", 1, params, cache=cache)
    engine.step([state], params.mode)  # the first step finds the scheduler's index (one sync)
    found: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step([state], params.mode)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchronizing" in str(warning.message):
            found[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return found


def main() -> None:
    models_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    for family in ("sd2-inpaint", "sdxl-inpaint", "flux-fill"):
        found = count_syncs(f"tiny-{family}", models_dir, Path(tempfile.mkdtemp()))
        print(f"tiny-{family}: {sum(found.values())} syncs in one cached step", dict(found))


if __name__ == "__main__":
    main()

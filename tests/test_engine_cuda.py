"""The mask-aware engine on CUDA (``gpu``: skipped without a CUDA device): at mask ratio 1 and at
exact replay it equals the ordinary pipeline, a mixed batch equals each row alone, and reading a
cache from pinned host RAM (side-stream copies) equals reading it from its files; float32 within
1e-4 (TF32 off), bfloat16 within 1.5 times what bfloat16 does to the ordinary pipeline itself and
a tenth of the latents' scale (``exactness``; docs/bench/gpu-h200.md gives the measured
differences)."""

from __future__ import annotations

import pytest
import torch

from backend.bench.exactness import run_exactness

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_engine_on_cuda_matches_the_ordinary_pipeline(models_dir, tmp_path, dtype):
    records = run_exactness(models_dir, tmp_path, device="cuda", dtype=dtype)
    assert {r.model for r in records} == {"tiny-sd2-inpaint", "tiny-sdxl-inpaint", "tiny-flux-fill"}
    over = [r for r in records if not r.within_tolerance]
    assert not over, over
    assert all(r.max_abs_diff == 0 for r in records if r.check == "pinned-feeder")

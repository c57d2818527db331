"""The join-step tool (``backend.engine.adapter_divergence``) and the adapter-quality bench's
summaries: pure functions on made-up numbers and images, and the tool on the tiny SD2 model."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from backend.bench.adapter_quality import QualityConfig, summarise
from backend.bench.adapter_quality_cli import tables
from backend.bench.engine_bench import _quality
from backend.bench.synthetic_lora import calibrated_adapter, relative_delta
from backend.engine.adapter_divergence import divergence, first_below
from tests.factories import full_mask, make_engine, make_params, make_template


def test_first_below_finds_the_first_step_under_the_threshold():
    assert first_below([1.0, 0.995, 0.989, 0.5]) == 2
    assert first_below([0.98]) == 0
    assert first_below([1.0, 0.999]) is None
    assert first_below([1.0, 0.95], threshold=0.9) is None


def test_join_steps_reach_the_late_share():
    assert QualityConfig(steps=20).join_steps() == (0, 1, 2, 3, 4, 6, 8)
    assert QualityConfig(steps=5).join_steps() == (0, 1, 2)


def _image(seed: int, noise: float = 0.0, box=None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = np.tile(np.linspace(0, 255, 32, dtype=np.float64), (32, 1))[..., None].repeat(3, 2)
    if noise:
        y0, y1, x0, x1 = box
        base[y0:y1, x0:x1] += rng.normal(0, noise, (y1 - y0, x1 - x0, 3))
    return np.clip(base, 0, 255).astype(np.uint8)


def test_summaries_of_made_up_images():
    mask = np.zeros((32, 32), dtype=bool)
    mask[8:24, 8:24] = True
    reference = Image.fromarray(_image(0))
    inside = Image.fromarray(_image(1, noise=40.0, box=(8, 24, 8, 24)))
    records = [
        {
            "model": "m",
            "part": "fidelity",
            "arm": "a",
            "ratio": 0.2,
            **_quality(reference, reference, mask),
        },
        {
            "model": "m",
            "part": "fidelity",
            "arm": "b",
            "ratio": 0.2,
            **_quality(inside, reference, mask),
        },
        {
            "model": "m",
            "part": "late",
            "cache": "none",
            "k": 2,
            **_quality(inside, reference, mask),
        },
        {"model": "m", "part": "join", "adapter": "weak", "step": None},
    ]
    summary = summarise(records)
    same, noisy = summary["fidelity"]["m"]["a"]["0.2"], summary["fidelity"]["m"]["b"]["0.2"]
    assert same["ssim"] == same["ssim_masked"] == 1.0 and same["psnr"] == 100.0
    assert noisy["ssim_masked"] < noisy["ssim"] < 1.0  # the change is inside the mask only
    assert noisy["psnr_masked"] < noisy["psnr"] and not math.isinf(noisy["psnr"])
    assert summary["late"]["m"]["none"]["2"]["cases"] == 1
    assert summary["join"]["m"] == {"weak": None}
    text = tables(summary, 20)
    assert "never" in text and "k= 2/20" in text


@pytest.fixture(scope="module")
def engine(models_dir, tmp_path_factory):
    engine = make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("divergence"))
    strong = calibrated_adapter(
        engine.adapter.denoiser, engine.adapters.targets, "strong", 1, 4, 1.0
    )
    assert relative_delta(strong.adapter, engine.adapters.targets) == pytest.approx(1.0)
    engine.adapters.put(strong.adapter)
    return engine


def _divergence(engine, adapters):
    params = make_params(engine, use_cache=False, steps=4)
    return divergence(engine, make_template(), full_mask(), "a vase", 3, params, adapters)


@pytest.mark.model
@pytest.mark.slow
def test_a_zero_scale_adapter_never_diverges(engine):
    found = _divergence(engine, (("strong", 0.0),))
    assert found.step is None and found.cosines == pytest.approx((1.0,) * 4, abs=1e-12)


@pytest.mark.model
@pytest.mark.slow
def test_a_strong_adapter_diverges_at_once(engine):
    found = _divergence(engine, (("strong", 4.0),))
    assert found.step in (0, 1) and len(found.cosines) == 4
    with pytest.raises(ValueError, match="at least one adapter"):
        _divergence(engine, ())

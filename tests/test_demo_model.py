"""The shipped demo model: it loads offline under its id, is small, and its edits paint what the
prompt names (held-out scenes it never saw), inside the mask only."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from backend.bench.demo_quality import painted_cases, run_case
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.models import load_pipeline, resolve_model
from backend.models.catalog import DEFAULT_MODEL, SHIPPED_DIR

DEMO = "demo-sd2-inpaint"
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine():
    spec = resolve_model(DEMO)
    with tempfile.TemporaryDirectory() as cache_root:
        yield MaskAwareEngine(load_pipeline(DEMO, Path(cache_root)), spec, Path(cache_root))


def test_the_demo_is_the_default_model_and_ships_small_in_diffusers_format():
    assert DEFAULT_MODEL == DEMO
    spec = resolve_model(DEMO)
    assert spec.form == "checkpoint" and Path(spec.source) == SHIPPED_DIR / DEMO
    assert (SHIPPED_DIR / DEMO / "model_index.json").is_file()
    total = sum(path.stat().st_size for path in (SHIPPED_DIR / DEMO).rglob("*") if path.is_file())
    assert total < 30 * 2**20
    assert spec.default_resolution == 128 and spec.uses_cfg


def test_it_loads_with_no_model_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = load_pipeline(DEMO, tmp_path)
    assert pipe.unet.config.in_channels == 9
    assert not any(tmp_path.iterdir())  # nothing built or downloaded: the shipped files are used


def test_edits_paint_the_prompted_colour_inside_the_mask_only(engine):
    spec = engine.spec
    size = (spec.default_resolution, spec.default_resolution)
    base = dict(steps=spec.default_steps, guidance=spec.default_guidance, size=size)
    params = {
        "ordinary": EditParams(**base, use_cache=False),
        "kv": EditParams(**base, mode="kv", record_on_first_edit=False),
        "hidden": EditParams(**base, mode="hidden", record_on_first_edit=False),
    }
    records = [
        run_case(engine, case, params, seed=1000 + index)[0]
        for index, case in enumerate(painted_cases(10, spec.default_resolution))
    ]
    # Over these ten edits (the first ten of `maskserve bench demo`) the prompt's colour wins in 8
    # and the masked area moves toward the prompt in 9, through every path alike; one less of each
    # is allowed for another BLAS's last bits. A model that learned nothing paints noise and loses
    # both; the epsilon-trained recipe won 2 of 10.
    for arm in ("ordinary", "kv", "hidden"):
        assert all(record[arm]["outside_identical"] for record in records)
        closer = sum(
            record[arm]["prompt_share"] > record["template_prompt_share"] for record in records
        )
        assert closer >= 8, (arm, [record["prompt"] for record in records])
        assert sum(record[arm]["agrees"] for record in records) >= 7
    assert min(record["kv"]["ssim"] for record in records) > 0.85


@pytest.mark.skipif(os.environ.get("MASKSERVE_MODEL") is not None, reason="model set by env")
def test_settings_serve_the_demo_by_default():
    from backend.config import load_settings

    assert load_settings().engine.model_id == DEMO

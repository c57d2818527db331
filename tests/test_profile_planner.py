"""Profiling a tiny model, the planner built from it, and the CUDA cache feeder (GPU only)."""

from __future__ import annotations

import pytest
import torch

from backend.costmodel.costs import CostProfile, RowWork
from backend.costmodel.profiles import profile_path
from backend.engine.profiler import load_planners, make_planner, measure_profile
from tests.factories import MASK, make_engine, make_params, make_template


@pytest.fixture(scope="module")
def flux_engine(models_dir, tmp_path_factory):
    return make_engine("flux-fill", models_dir, tmp_path_factory.mktemp("cache-profile"))


def test_profile_fits_and_round_trips(flux_engine, tmp_path):
    profile = measure_profile(flux_engine, "kv", 128, "cpu", repeats=1)
    assert len(profile.units) == flux_engine.num_units
    # tiny models are overhead-bound, so only the fit's form is checked here (slopes: see the
    # README)
    assert profile.compute.r2 <= 1.0 and profile.load.r2 <= 1.0
    costs = profile.unit_costs([RowWork(0.2, "t")])
    assert len(costs) == flux_engine.num_units and all(c.compute_dense_s >= 0 for c in costs)
    assert all(u.cache_bytes_per_token > 0 for u in profile.units)
    # a step's time outside the units is measured and fitted against the rows (how it grows is
    # a timing, too noisy on a busy machine to assert: the bench reports it)
    rest = profile.step_rest
    assert (rest.slope, rest.intercept) != (0.0, 0.0) and 0.0 <= rest.r2 <= 1.0
    path = profile_path(tmp_path, flux_engine.spec.model_id, "cpu", "kv")
    path.write_text(profile.to_json())
    assert CostProfile.from_json(path.read_text()) == profile
    planners = load_planners(tmp_path, flux_engine.spec.model_id, "cpu", flux_engine.num_units)
    assert set(planners) == {"kv"}


def test_planner_drives_the_edit_and_stays_exact(flux_engine):
    """Whatever the plan, an exact replay still reproduces the recording (dense units included)."""
    profile = measure_profile(flux_engine, "kv", 128, "cpu", repeats=1)
    # a profile where loading is very slow makes the plan keep every unit dense
    slow = CostProfile(
        profile.format_version,
        profile.model_id,
        profile.device,
        profile.mode,
        profile.compute,
        type(profile.load)(slope=1.0, intercept=10.0, r2=1.0),
        profile.units,
    )
    params = make_params(flux_engine, mode="kv", template_seed=9)
    cache = flux_engine.prepare_template(make_template(), params, prompt="a blue vase", mask=MASK)
    reference = flux_engine.edit(
        make_template(), MASK, "a blue vase", 9, params, cache=cache
    ).latents
    flux_engine.planners = {"kv": make_planner(slow, flux_engine.num_units)}
    try:
        state = flux_engine.start(make_template(), MASK, "a blue vase", 9, params, cache=cache)
        assert flux_engine.plan([state], "kv") == (False,) * flux_engine.num_units
        result = flux_engine.edit(make_template(), MASK, "a blue vase", 9, params, cache=cache)
    finally:
        flux_engine.planners = {}
    assert (result.latents - reference).abs().max().item() <= 1e-4


def test_planner_rejects_a_profile_of_another_model(flux_engine):
    profile = measure_profile(flux_engine, "kv", 128, "cpu", repeats=1)
    with pytest.raises(ValueError, match="re-run"):
        make_planner(profile, flux_engine.num_units + 1)


@pytest.mark.gpu
def test_cuda_feeder_overlaps_and_matches_cpu(models_dir, tmp_path):
    from backend.engine.editor import MaskAwareEngine
    from backend.models import load_pipeline, resolve_model

    spec = resolve_model("tiny-flux-fill")
    cpu = make_engine("flux-fill", models_dir, tmp_path)
    gpu = MaskAwareEngine(load_pipeline(spec.model_id, models_dir, device="cuda"), spec, tmp_path)
    params = make_params(cpu, mode="kv")
    cache = cpu.prepare_template(make_template(), params)
    on_cpu = cpu.edit(make_template(), MASK, "a vase", 3, params, cache=cache).latents
    on_gpu = gpu.edit(make_template(), MASK, "a vase", 3, params, cache=cache).latents.cpu()
    assert torch.allclose(on_cpu, on_gpu, atol=1e-2)

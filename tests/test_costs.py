"""Cost profiles: fitted lines, FLOP counts, batch costs and the JSON format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.costmodel.costs import (
    FORMAT_VERSION,
    CostProfile,
    LinearModel,
    RowWork,
    UnitShape,
    batch_unit_costs,
    build_profile,
    fit_linear,
    ideal_speedup,
    unit_flops,
)
from backend.costmodel.plan import UnitCost, solve_plan

UNITS = [
    UnitShape(
        "down.0", 0, num_tokens=1024, hidden_dim=320, num_text_tokens=77, cache_bytes_per_token=1280
    ),
    UnitShape(
        "down.1", 0, num_tokens=1024, hidden_dim=320, num_text_tokens=77, cache_bytes_per_token=1280
    ),
    UnitShape(
        "mid.0", 1, num_tokens=64, hidden_dim=1280, num_text_tokens=77, cache_bytes_per_token=5120
    ),
]


def make_profile(**overrides) -> CostProfile:
    fields = dict(
        format_version=FORMAT_VERSION,
        model_id="tiny-sd2-inpaint",
        device="cpu",
        mode="kv",
        compute=LinearModel(1e-12, 1e-4, 0.99),
        load=LinearModel(1e-9, 2e-5, 0.98),
        units=list(UNITS),
    )
    fields.update(overrides)
    return CostProfile(**fields)


def test_fit_recovers_an_exact_line():
    xs = [1e9, 2e9, 5e9, 1.3e10]
    model = fit_linear(xs, [3e-12 * x + 2e-4 for x in xs])
    assert model.slope == pytest.approx(3e-12, rel=1e-9)
    assert model.intercept == pytest.approx(2e-4, rel=1e-6)
    assert model.r2 == pytest.approx(1.0, abs=1e-12)
    assert model.predict(4e9) == pytest.approx(3e-12 * 4e9 + 2e-4)


def test_fit_on_noisy_data_has_r2_below_one():
    rng = np.random.default_rng(0)
    xs = np.linspace(1.0, 10.0, 50)
    model = fit_linear(xs, 2.0 * xs + 1.0 + rng.normal(0, 0.5, xs.size))
    assert 0.9 < model.r2 < 1.0
    assert model.slope == pytest.approx(2.0, abs=0.15)


@pytest.mark.parametrize(
    "xs,ys,match",
    [
        ([1.0], [1.0], "at least 2"),
        ([2.0, 2.0], [1.0, 3.0], "distinct"),
        ([1.0, 2.0], [1.0], "equally long"),
    ],
)
def test_fit_rejects_degenerate_input(xs, ys, match):
    with pytest.raises(ValueError, match=match):
        fit_linear(xs, ys)


def test_flops_are_monotone_and_reach_dense_at_all_tokens():
    for unit in UNITS:
        counts = [unit_flops(unit, m, dense=False) for m in range(0, unit.num_tokens + 1, 7)]
        assert all(a < b for a, b in zip(counts, counts[1:]))
        dense = unit_flops(unit, 0, dense=True)
        assert unit_flops(unit, unit.num_tokens, dense=False) == dense
        assert counts[-1] <= dense


def test_flops_follow_the_block_formula():
    unit = UnitShape("b", 0, num_tokens=16, hidden_dim=8, num_text_tokens=4, ffn_mult=4.0)
    # per query: 8 d^2 + 4 (N + T) d + 4 m d^2 = 512 + 640 + 1024; text K/V: 4 T d^2 = 1024
    assert unit_flops(unit, 3, dense=False) == 3 * 2176 + 1024
    with pytest.raises(ValueError, match="masked tokens"):
        unit_flops(unit, 17, dense=False)


def test_ideal_speedup():
    assert ideal_speedup(UNITS, 1.0) == pytest.approx(1.0)
    assert 3.0 < ideal_speedup(UNITS, 0.25) < 4.0  # text K/V costs keep it below 1 / 0.25
    no_text = [UnitShape("u", 0, num_tokens=100, hidden_dim=64)]
    assert ideal_speedup(no_text, 0.1) == pytest.approx(10.0)


def test_batch_compute_pays_the_intercept_once_per_unit():
    profile = make_profile()
    one = batch_unit_costs(profile, [RowWork(0.25, "t1", needs_load=False)])
    two = batch_unit_costs(profile, [RowWork(0.25, "t1", needs_load=False)] * 2)
    for a, b, unit in zip(one, two, UNITS):
        intercept = profile.compute.intercept
        assert b.compute_cached_s - intercept == pytest.approx(2 * (a.compute_cached_s - intercept))
        assert b.compute_dense_s == pytest.approx(
            profile.compute.predict(2 * unit_flops(unit, 0, dense=True))
        )
        assert a.compute_cached_s < a.compute_dense_s
        assert a.load_s == b.load_s == 0.0


def test_shared_templates_are_loaded_once():
    profile = make_profile()
    shared = batch_unit_costs(profile, [RowWork(0.3, "t1"), RowWork(0.1, "t1")])
    distinct = batch_unit_costs(profile, [RowWork(0.3, "t1"), RowWork(0.1, "t2")])
    resident = batch_unit_costs(profile, [RowWork(0.3, "t1"), RowWork(0.1, "t2", needs_load=False)])
    for unit, s, d, r in zip(UNITS, shared, distinct, resident):
        single = profile.load.predict(unit.cache_bytes)
        assert s.load_s == pytest.approx(single)
        assert d.load_s == pytest.approx(2 * single)
        assert r.load_s == pytest.approx(single)


def test_rows_masking_everything_read_no_cache():
    costs = batch_unit_costs(make_profile(), [RowWork(1.0, "t1")])
    assert all(c.load_s == 0.0 for c in costs)
    assert all(c.compute_cached_s == pytest.approx(c.compute_dense_s) for c in costs)


def test_masked_tokens_per_stack_and_the_planner_consume_the_costs():
    profile = make_profile()
    costs = profile.unit_costs([RowWork({0: 100, 1: 10}, "t1"), RowWork([50, 64], "t2")])
    assert len(costs) == 3 and all(isinstance(c, UnitCost) for c in costs)
    # t2 masks all of stack 1
    assert costs[2].load_s == pytest.approx(profile.load.predict(UNITS[2].cache_bytes))
    plan = solve_plan(costs, profile.stack_ids, monotone_within_stack=True)
    assert len(plan.use_cache) == 3
    with pytest.raises(ValueError, match="stack 1"):
        profile.unit_costs([RowWork({0: 10}, "t1")])
    with pytest.raises(ValueError, match="at least one row"):
        profile.unit_costs([])


def test_negative_predictions_clamp_to_zero():
    profile = make_profile(compute=LinearModel(1e-12, -1.0, 0.9), load=LinearModel(1e-9, -1.0, 0.9))
    costs = profile.unit_costs([RowWork(0.5, "t1")])
    assert all(c.compute_cached_s == 0.0 and c.load_s == 0.0 for c in costs)


def test_json_round_trip():
    profile = make_profile(mode="hidden")
    again = CostProfile.from_json(profile.to_json())
    assert again == profile
    assert again.units[2] == UNITS[2] and again.compute.predict(1e9) == profile.compute.predict(1e9)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: "[1, 2]", "JSON object"),
        (lambda d: {**d, "format_version": 99}, "format_version 99 is not supported"),
        (lambda d: {k: v for k, v in d.items() if k != "format_version"}, "format_version None"),
        (lambda d: {k: v for k, v in d.items() if k != "load"}, "missing field.*load"),
        (lambda d: {**d, "extra": 1}, "unknown field.*extra"),
        (lambda d: {**d, "mode": "both"}, "mode"),
        (lambda d: {**d, "compute": {**d["compute"], "slope": "fast"}}, "compute.slope"),
        (lambda d: {**d, "units": [{**d["units"][0], "num_tokens": 0}]}, "unit 0.*num_tokens"),
        (lambda d: {**d, "units": [{**d["units"][0], "hidden": 3}]}, "unit 0 has unknown"),
    ],
)
def test_bad_json_is_rejected_with_a_clear_message(mutate, match):
    data = json.loads(make_profile().to_json())
    bad = mutate(data)
    with pytest.raises(ValueError, match=match):
        CostProfile.from_json(bad if isinstance(bad, str) else json.dumps(bad))


def test_build_profile_fits_both_lines():
    flops = [1e9, 4e9, 9e9]
    profile = build_profile(
        "m",
        "cuda:0",
        "kv",
        UNITS,
        [(f, 2e-12 * f + 1e-4) for f in flops],
        [(b, 1e-9 * b + 1e-5) for b in (1e5, 1e6, 1e7)],
    )
    assert profile.compute.slope == pytest.approx(2e-12) and profile.load.r2 == pytest.approx(1.0)
    assert not profile.compute_is_flat
    assert profile.rest_seconds(4) == 0.0  # no step samples: the rest is unknown, 0
    with pytest.raises(ValueError, match="mode"):
        build_profile("m", "cpu", "sparse", UNITS, [], [])


def test_the_rest_of_a_step_is_fitted_per_row_and_read_as_0_from_older_profiles():
    profile = build_profile(
        "m",
        "cpu",
        "kv",
        UNITS,
        [(f, 2e-12 * f + 1e-4) for f in (1e9, 4e9)],
        [(b, 1e-9 * b) for b in (1e5, 1e6)],
        [(2.0, 0.03), (4.0, 0.05), (2.0, 0.03)],  # (rows, seconds outside the units)
    )
    assert profile.rest_seconds(2) == pytest.approx(0.03) and profile.rest_seconds(8) == (
        pytest.approx(0.09)
    )
    assert CostProfile.from_json(profile.to_json()) == profile
    older = json.loads(profile.to_json())
    del older["step_rest"]
    assert CostProfile.from_json(json.dumps(older)).rest_seconds(4) == 0.0
    with pytest.raises(ValueError, match="step_rest.slope"):
        CostProfile.from_json(
            json.dumps({**older, "step_rest": {"slope": "x", "intercept": 0, "r2": 1}})
        )


@pytest.mark.parametrize(
    "seconds",
    [
        lambda flops: 3e-3 + (1e-4 if flops in (4e9, 16e9) else 0.0),  # overhead, noise
        lambda flops: 3e-3 - 1e-15 * flops,  # falls as the work grows
    ],
)
def test_a_compute_line_that_does_not_follow_the_work_is_flat(seconds):
    flops = [1e9, 4e9, 9e9, 16e9]
    samples = [(f, seconds(f)) for f in flops]
    profile = build_profile("m", "cuda", "kv", UNITS, samples, [(1e5, 1e-4), (1e6, 1e-3)])
    assert profile.compute_is_flat

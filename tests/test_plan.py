"""solve_plan is the exact optimum (checked against brute force) under the documented tie rule."""

from __future__ import annotations

import random

import pytest

from backend.costmodel.plan import (
    LoadingPlan,
    UnitCost,
    brute_force_plan,
    greedy_plan,
    simulate_plan,
    solve_plan,
)


def random_costs(rng: random.Random, n: int, kind: str) -> list[UnitCost]:
    """'float': generic reals; 'int': small integers, so exact ties are common (exercises the tie
    rule); 'resident': some loads are 0, which makes compute differences vanish inside max()."""

    def value(hi: float) -> float:
        if kind == "int":
            return float(rng.randint(0, 3))
        if kind == "resident" and rng.random() < 0.4:
            return 0.0
        return rng.uniform(0.0, hi)

    return [UnitCost(value(1.0), value(2.0), value(2.0)) for _ in range(n)]


def random_stacks(rng: random.Random, n: int) -> list[int]:
    ids, sid = [], 0
    for i in range(n):
        if i > 0 and rng.random() < 0.3:
            sid += 1
        ids.append(sid)
    return ids


@pytest.mark.parametrize("kind", ["float", "int", "resident"])
def test_solve_plan_matches_brute_force(kind):
    rng = random.Random(f"plan-{kind}")
    checked = 0
    for _ in range(150):
        n = rng.randint(1, 10)
        costs, ids = random_costs(rng, n, kind), random_stacks(rng, n)
        for monotone in (False, True):
            for stacks in (ids, None):
                fast = solve_plan(costs, stacks, monotone)
                slow = brute_force_plan(costs, stacks, monotone)
                assert fast.latency_s == pytest.approx(slow.latency_s, abs=1e-12)
                assert fast.use_cache == slow.use_cache, (costs, stacks, monotone)
                assert fast.num_cached == sum(fast.use_cache)
                assert simulate_plan(costs, fast.use_cache) == fast.latency_s
                checked += 1
    assert checked == 600


def test_monotone_plans_never_go_dense_after_cached_in_a_stack():
    rng = random.Random(7)
    for _ in range(100):
        n = rng.randint(2, 12)
        costs, ids = random_costs(rng, n, "float"), random_stacks(rng, n)
        plan = solve_plan(costs, ids, monotone_within_stack=True)
        for i in range(1, n):
            if ids[i] == ids[i - 1] and plan.use_cache[i - 1]:
                assert plan.use_cache[i]
        assert plan.latency_s >= solve_plan(costs, ids).latency_s  # a constraint cannot help


def test_tie_prefers_more_cached_units_then_earlier_ones():
    # Every plan takes 1 s; caching one unit is preferred over none, the first over the second.
    costs = [UnitCost(0.5, 0.5, 0.0), UnitCost(0.5, 0.5, 0.5)]
    assert solve_plan(costs).use_cache == (True, True)
    # Caching either unit alone takes 2 s, both or none 3 s: the earlier unit is cached.
    costs = [UnitCost(0.0, 2.0, 1.0), UnitCost(0.0, 1.0, 2.0)]
    assert simulate_plan(costs, [True, False]) == simulate_plan(costs, [False, True]) == 2.0
    assert solve_plan(costs) == LoadingPlan((True, False), 2.0, 1) == brute_force_plan(costs)


def test_greedy_is_beaten_on_a_known_instance():
    # Greedy caches unit 0 (0.9 s < 1 s), which queues unit 1's long copy behind it: 10.9 s.
    # Optimal: run unit 0 dense, so unit 1's copy starts at once: 10 s.
    costs = [UnitCost(0.0, 1.0, 0.9), UnitCost(0.0, 10.5, 10.0)]
    greedy, best = greedy_plan(costs), solve_plan(costs)
    assert greedy.use_cache == (True, True) and greedy.latency_s == pytest.approx(10.9)
    assert best.use_cache == (False, True) and best.latency_s == pytest.approx(10.0)


def test_greedy_is_never_better_and_sometimes_worse():
    rng = random.Random(3)
    worse = 0
    for _ in range(200):
        costs = random_costs(rng, rng.randint(1, 10), "float")
        greedy, best = greedy_plan(costs), solve_plan(costs)
        assert best.latency_s <= greedy.latency_s
        assert simulate_plan(costs, greedy.use_cache) == greedy.latency_s
        worse += greedy.latency_s > best.latency_s
    assert worse > 0


def test_free_loads_cache_every_unit_that_computes_faster():
    costs = [UnitCost(0.2, 1.0, 0.0)] * 8
    plan = solve_plan(costs)
    assert plan.use_cache == (True,) * 8 and plan.latency_s == pytest.approx(1.6)


def test_huge_loads_run_everything_dense():
    costs = [UnitCost(0.2, 1.0, 1e6)] * 6
    for monotone in (False, True):
        plan = solve_plan(costs, [0, 0, 0, 1, 1, 1], monotone)
        assert plan.use_cache == (False,) * 6 and plan.num_cached == 0
        assert plan.latency_s == pytest.approx(6.0)


def test_empty_input_has_zero_latency():
    assert solve_plan([]) == LoadingPlan((), 0.0, 0) == brute_force_plan([])
    assert greedy_plan([]).latency_s == 0.0 and simulate_plan([], []) == 0.0


def test_simulate_follows_the_recurrence():
    costs = [UnitCost(1.0, 3.0, 2.0), UnitCost(0.5, 2.0, 4.0), UnitCost(1.0, 1.5, 1.0)]
    # cached: load 2, comp max(2, 0) + 1 = 3; cached: load 6, comp max(6, 3) + 0.5 = 6.5;
    # dense: comp 6.5 + 1.5 = 8
    assert simulate_plan(costs, [True, True, False]) == 8.0
    assert simulate_plan(costs, [False, False, False]) == 6.5


def test_large_model_solves_fast_and_beats_all_dense():
    rng = random.Random(11)
    costs = [
        UnitCost(rng.uniform(0.1, 0.4), rng.uniform(0.8, 1.2), rng.uniform(0.2, 1.5))
        for _ in range(60)
    ]
    stacks = [0] * 19 + [1] * 41  # Flux-like: double-stream then single-stream blocks
    for monotone in (False, True):
        plan = solve_plan(costs, stacks, monotone)
        assert len(plan.use_cache) == 60
        assert plan.latency_s <= simulate_plan(costs, [False] * 60)
        assert plan.latency_s <= greedy_plan(costs, stacks, monotone).latency_s
        assert simulate_plan(costs, plan.use_cache) == plan.latency_s


def test_identical_units_solve_fast():
    # Many plans tie exactly here; the frontier must still collapse.
    plan = solve_plan(
        [UnitCost(0.3, 1.0, 0.8)] * 60, [0] * 20 + [1] * 40, monotone_within_stack=True
    )
    assert 0 < plan.num_cached < 60


@pytest.mark.parametrize(
    "bad",
    [
        dict(compute_cached_s=-1.0, compute_dense_s=1.0, load_s=0.0),
        dict(compute_cached_s=1.0, compute_dense_s=float("nan"), load_s=0.0),
        dict(compute_cached_s=1.0, compute_dense_s=1.0, load_s=float("inf")),
    ],
)
def test_invalid_costs_are_rejected(bad):
    with pytest.raises(ValueError, match="UnitCost"):
        UnitCost(**bad)


def test_invalid_stacks_and_sizes_are_rejected():
    costs = [UnitCost(0.1, 1.0, 0.1)] * 3
    with pytest.raises(ValueError, match="contiguous"):
        solve_plan(costs, [0, 1, 0], monotone_within_stack=True)
    with pytest.raises(ValueError, match="stack ids"):
        solve_plan(costs, [0, 0])
    with pytest.raises(ValueError, match="choices"):
        simulate_plan(costs, [True])
    with pytest.raises(ValueError, match="brute force"):
        brute_force_plan([UnitCost(0.1, 1.0, 0.1)] * 17)

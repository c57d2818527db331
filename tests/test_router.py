"""Mask-aware routing: scenario tests per policy, cost-model sanity, heartbeat views (pure)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from backend import protocol
from backend.costmodel.costs import (
    FORMAT_VERSION,
    CostProfile,
    LinearModel,
    RowWork,
    UnitShape,
    batch_unit_costs,
)
from backend.costmodel.plan import greedy_plan
from backend.dispatch.policies import ROUTING_POLICIES
from backend.dispatch.router import (
    POLICIES,
    JobRequest,
    Router,
    RoutingCostModel,
    RowState,
    WorkerView,
    load_cost_models,
    view_from_heartbeat,
)

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
MODEL = "small-flux-fill"


@pytest.fixture(scope="module")
def cost_model() -> RoutingCostModel:
    return RoutingCostModel.from_profile(
        CostProfile.from_json((PROFILES / f"{MODEL}__cpu__kv.json").read_text())
    )


def router(policy: str, cm: RoutingCostModel | None = None, **kw) -> Router:
    return Router(policy, {(MODEL, "cpu"): cm} if cm else None, **kw)


def worker(
    wid: str,
    running=(),
    waiting=(),
    ram=(),
    disk=(),
    max_batch=8,
    model=MODEL,
    device="cpu",
    on_device=(),
) -> WorkerView:
    def rows(spec, prefix):
        return tuple(RowState(f"{wid}-{prefix}{i}", m, s, t) for i, (m, s, t) in enumerate(spec))

    return WorkerView(
        wid,
        model,
        device,
        max_batch,
        rows(running, "r"),
        rows(waiting, "q"),
        frozenset(ram),
        frozenset(disk),
        resident_device=frozenset(on_device),
    )


def job(mask=0.1, steps=20, template="t0", model=MODEL) -> JobRequest:
    return JobRequest("j", model, mask, steps, template)


# ----- policies ---------------------------------------------------------------------------------
def test_mask_aware_prefers_the_worker_whose_ram_holds_the_template(cost_model):
    busy = [(0.1, 10, "a"), (0.1, 10, "b")]
    workers = [worker("w0", busy, disk={"t0"}), worker("w1", busy, ram={"t0"}, disk={"t0"})]
    d = router("mask_aware", cost_model).choose(job(), workers)
    assert d.worker_id == "w1" and d.costs["w1"] < d.costs["w0"] and "residency" in d.reason
    # the paper's policy does not see residency: a tie, broken by worker id
    assert router("flashps", cost_model).choose(job(), workers).worker_id == "w0"


def test_mask_aware_prefers_a_lighter_masked_load_over_the_same_count_of_heavier_rows(cost_model):
    heavy = worker(
        "w0", [(0.6, 15, "a"), (0.5, 15, "b"), (0.7, 15, "c")], ram={"a", "b", "c", "t0"}
    )
    light = worker(
        "w1", [(0.05, 15, "a"), (0.04, 15, "b"), (0.06, 15, "c")], ram={"a", "b", "c", "t0"}
    )
    for policy in ("mask_aware", "flashps", "fewest_tokens"):
        assert router(policy, cost_model).choose(job(), [heavy, light]).worker_id == "w1", policy
    assert router("fewest_requests").choose(job(), [heavy, light]).worker_id == "w0"  # a tie: by id


def test_mask_aware_counts_remaining_steps_and_queued_work(cost_model):
    ram = {"a", "t0"}
    finishing = worker("w0", [(0.3, 1, "a")] * 3, ram=ram)
    fresh = worker("w1", [(0.3, 20, "a")] * 3, ram=ram)
    assert router("mask_aware", cost_model).choose(job(), [fresh, finishing]).worker_id == "w0"
    # tie by id
    assert router("flashps", cost_model).choose(job(), [finishing, fresh]).worker_id == "w0"
    assert (
        router("flashps", cost_model)
        .choose(job(), [fresh, worker("w2", [(0.3, 1, "a")] * 3, ram=ram)])
        .worker_id
        == "w1"
    )  # the paper cannot tell them apart
    queued = worker("w0", [(0.1, 5, "a")] * 2, waiting=[(0.5, 20, "a")] * 4, ram=ram)
    idle_ish = worker("w1", [(0.1, 5, "a")] * 2, ram=ram)
    assert router("mask_aware", cost_model).choose(job(), [queued, idle_ish]).worker_id == "w1"


def test_fewest_tokens_and_fewest_requests_differ():
    one_big = worker("w0", [(0.8, 10, "a")])
    two_small = worker("w1", [(0.1, 10, "a"), (0.1, 10, "b")])
    assert router("fewest_requests").choose(job(), [one_big, two_small]).worker_id == "w0"
    d = router("fewest_tokens").choose(job(), [one_big, two_small])
    assert d.worker_id == "w1" and d.costs == pytest.approx({"w0": 0.8, "w1": 0.2})


def test_round_robin_cycles_over_candidates_and_skips_full_workers():
    r = router("round_robin")
    workers = [worker("w2"), worker("w0"), worker("w1")]
    assert [r.choose(job(), workers).worker_id for _ in range(5)] == ["w0", "w1", "w2", "w0", "w1"]
    workers[0] = worker("w2", [(0.1, 5, "a")], max_batch=1)  # full
    assert [r.choose(job(), workers).worker_id for _ in range(3)] == ["w0", "w1", "w0"]
    assert r.choose(job(model="other"), [worker("x", model="other")]).worker_id == "x"  # per model


def test_full_workers_queue_on_the_least_loaded_or_are_refused(cost_model):
    full = [
        worker("w0", [(0.1, 5, "a")] * 2, waiting=[(0.1, 5, "a")] * 2, max_batch=2),
        worker("w1", [(0.1, 5, "a")] * 2, waiting=[(0.1, 5, "a")], max_batch=2),
    ]
    for policy in POLICIES:
        d = router(policy, cost_model).choose(job(), full)
        assert d.worker_id == "w1" and "all full" in d.reason, policy
        refused = router(policy, cost_model, allow_queueing=False).choose(job(), full)
        assert (
            refused.worker_id is None and refused.reason == f"every worker serving {MODEL} is full"
        )
        # late binding with a queue depth of 2: w1 (2 running + 1 waiting < 2 + 2) still has slack
        deep = router(policy, cost_model, allow_queueing=False, queue_depth=2).choose(job(), full)
        assert deep.worker_id == "w1" and "all full" not in deep.reason, policy
    with pytest.raises(ValueError):
        router("mask_aware", cost_model, queue_depth=-1)


def test_no_worker_for_the_model_unknown_policy_and_missing_cost_model(cost_model):
    d = router("mask_aware", cost_model).choose(job(model="tiny-flux-fill"), [worker("w0")])
    assert d.worker_id is None and d.reason == "no live worker serves tiny-flux-fill"
    assert router("mask_aware", cost_model).choose(job(), []).worker_id is None
    with pytest.raises(
        ValueError, match="mask_aware, flashps, round_robin, fewest_requests, fewest_tokens"
    ):
        Router("least_latency")
    workers = [
        worker("w0", [(0.1, 5, "a")] * 2, device="cuda:0"),
        worker("w1", [(0.1, 5, "a")], device="cuda:1"),
    ]
    for policy in ("mask_aware", "flashps"):
        d = router(policy, cost_model).choose(job(), workers)  # the model only has a cpu profile
        assert (d.worker_id, d.policy) == ("w1", "fewest_requests") and "no cost model" in d.reason
    assert (
        Router("mask_aware", default_cost_model=cost_model).choose(job(), workers).policy
        == "mask_aware"
    )


def test_decisions_are_deterministic_and_ties_go_to_the_smallest_worker_id(cost_model):
    rng = random.Random(3)
    workers = [
        worker(
            f"w{i}",
            [
                (rng.uniform(0.02, 0.5), rng.randint(1, 20), f"t{rng.randint(0, 9)}")
                for _ in range(rng.randint(0, 7))
            ],
            ram={f"t{rng.randint(0, 9)}"},
            disk={"t0"},
        )
        for i in range(6)
    ]
    for policy in POLICIES:
        first = router(policy, cost_model).choose(job(), workers)
        again = router(policy, cost_model).choose(job(), list(reversed(workers)))
        assert first == again, policy
    same = [worker("w3"), worker("w1"), worker("w2")]
    for policy in POLICIES:
        assert router(policy, cost_model).choose(job(), same).worker_id == "w1", policy


# ----- cost model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ROUTING_POLICIES))
def test_every_routing_policy_keeps_the_strategy_contract(name, cost_model):
    """Over random clusters: one of the candidates, a cost for each, ties to the smallest id."""
    rng = random.Random(name)
    policy = ROUTING_POLICIES[name]()
    for trial in range(30):
        views = sorted(
            (
                worker(
                    f"w{i}",
                    running=[(rng.random(), rng.randint(1, 20), f"t{rng.randint(0, 5)}")] * (i % 3),
                    ram={f"t{rng.randint(0, 5)}"},
                    disk={f"t{rng.randint(0, 5)}"},
                )
                for i in range(rng.randint(1, 5))
            ),
            key=lambda w: w.worker_id,
        )
        job = JobRequest(f"j{trial}", MODEL, rng.random(), 20, f"t{rng.randint(0, 7)}")
        choice = policy.choose(job, views, lambda model_id, device: cost_model)
        assert choice.worker_id in {w.worker_id for w in views} and choice.why
        assert set(choice.costs) == {w.worker_id for w in views}
        if name != "round_robin":
            best = min(choice.costs.values())
            assert choice.worker_id == min(w for w, c in choice.costs.items() if c == best)


def test_router_names_every_strategy_and_refuses_other_names():
    assert POLICIES == tuple(ROUTING_POLICIES)
    assert {Router(p).policy for p in POLICIES} == set(POLICIES)
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("least_loaded")


def test_more_rows_larger_masks_and_more_steps_never_cost_less(cost_model):
    rng = random.Random(5)
    for _ in range(200):
        rows = [
            (rng.uniform(0.02, 0.9), f"t{rng.randint(0, 4)}", rng.random() < 0.8)
            for _ in range(rng.randint(1, 8))
        ]
        base = cost_model.step_latency(rows)
        assert (
            cost_model.step_latency(rows + [(rng.uniform(0.02, 0.9), "new", rng.random() < 0.5)])
            >= base
        )
        grown = [(min(1.0, m + 0.1), t, c) for m, t, c in rows]
        assert cost_model.step_latency(grown) >= base
        view = worker(
            "w", [(m, rng.randint(1, 20), t) for m, t, _ in rows[:6]], ram={"t0", "t1", "t2"}
        )
        small, big = job(mask=0.05), job(mask=0.4)
        assert cost_model.estimate(big, view)["total"] >= cost_model.estimate(small, view)["total"]
        assert (
            cost_model.estimate(job(steps=30), view)["total"]
            >= cost_model.estimate(job(steps=20), view)["total"]
        )
        more = worker(
            "w",
            [(r.mask_ratio, r.remaining_steps, r.template) for r in view.running]
            + [(0.2, 10, "t1")],
            ram=view.resident_ram,
        )
        assert (
            cost_model.estimate(job(), more)["total"] >= cost_model.estimate(job(), view)["total"]
        )


def test_residency_orders_ram_before_disk_before_absent(cost_model):
    for running in ((), [(0.1, 8, "a"), (0.3, 20, "b")]):
        ram = cost_model.estimate(job(), worker("w", running, ram={"t0", "a", "b"}))
        disk = cost_model.estimate(job(), worker("w", running, ram={"a", "b"}, disk={"t0"}))
        absent = cost_model.estimate(job(), worker("w", running, ram={"a", "b"}))
        assert ram["total"] < disk["total"] < absent["total"]
        # a free slot, the read not yet started: J alone is held until it lands (the batch runs on)
        assert disk["residency"] == pytest.approx(cost_model.disk_read_s(20))
        assert ram["residency"] == 0
    # a row already on the worker brought the template into RAM
    sharing = cost_model.estimate(job(), worker("w", [(0.1, 8, "t0")], disk={"t0"}))
    assert sharing["residency"] == 0.0


def test_a_template_on_the_device_costs_no_more_than_in_ram_and_less_where_copies_cost(cost_model):
    """A row whose template W holds on its device tier computes masked and copies nothing, J's
    own and its co-runners' (in T and in their share of a step), in RAM or on disk or not. J's
    costs strictly less than from RAM where RAM reads cost step time (the shipped CPU profile's
    small copies, and the route bench's what-if of copies 650 times slower). With co-runners on
    the device J's run follows the step-by-step replay without their copies; it is lower than
    with them in RAM where copies are slow (with the CPU profile's tiny copies the RAM estimate,
    an interpolation over the co-runners' shares, can sit a hair below its own replay)."""
    from backend.bench.route_bench import RouteBenchConfig, cost_model_for

    slow_copies = cost_model_for(RouteBenchConfig(profiles_dir=str(PROFILES), load_scale=650))
    for cm in (cost_model, slow_copies):
        for running in ((), [(0.1, 8, "a"), (0.3, 20, "b")]):
            ram = cm.estimate(job(), worker("w", running, ram={"t0", "a", "b"}))
            device = cm.estimate(job(), worker("w", running, ram={"a", "b"}, on_device={"t0"}))
            assert device["total"] < ram["total"] and device["run"] < ram["run"]
            assert device["residency"] == ram["residency"] == 0.0 and device["imposed"] == 0.0
        # co-runners on the device: J's run follows the step-by-step replay without their copies
        rows = [(0.1, 10, "a"), (0.2, 20, "b")]
        co_device = cm.estimate(job(), worker("w", rows, ram={"t0"}, on_device={"a", "b"}))
        batch = [(0.1, "a", True), (0.2, "b", True), (0.1, "t0", True)]
        on = frozenset({"a", "b"})
        replay = 10 * cm.step_latency(batch, on) + 10 * cm.step_latency(batch[1:], on)
        assert co_device["run"] == pytest.approx(replay, rel=0.03)
        assert cm.step_latency(batch, frozenset({"t0"})) < cm.step_latency(batch)
        # every copy gone: the masked compute alone, as a batch that loads nothing
        assert cm.step_latency(batch, frozenset({"a", "b", "t0"})) == pytest.approx(
            RoutingCostModel(replace(cm.profile, load=LinearModel(0.0, 0.0, 1.0))).step_latency(
                batch
            )
        )
    co_ram = slow_copies.estimate(job(), worker("w", rows, ram={"t0", "a", "b"}))
    co_device = slow_copies.estimate(job(), worker("w", rows, ram={"t0"}, on_device={"a", "b"}))
    assert co_device["run"] < co_ram["run"]
    view = worker("w", ram={"a"}, disk={"t0"}, on_device={"t0"})
    assert cost_model.tier("t0", view) == "device" and cost_model.tier("a", view) == "ram"


def test_a_template_on_the_device_is_not_read_from_disk_by_the_rows_before_j(cost_model):
    """A waiting row whose template W holds on its device (RAM dropped its copy, the disk keeps
    one) reads nothing before J's own read from disk."""
    read = cost_model.disk_read_s(20)
    queued = worker(
        "w",
        [(0.1, 10, "a")],
        waiting=[(0.1, 20, "x"), (0.1, 20, "y")],
        ram={"a"},
        disk={"t0", "x", "y"},
        on_device={"x"},
    )
    assert cost_model.estimate(job(), queued)["residency"] == pytest.approx(2 * read)


def test_mask_aware_prefers_the_worker_holding_the_template_on_its_device(cost_model):
    busy = [(0.1, 10, "a"), (0.1, 10, "b")]
    in_ram = worker("w0", busy, ram={"a", "b", "t0"})
    on_device = worker("w1", busy, ram={"a", "b"}, on_device={"t0"})
    d = router("mask_aware", cost_model).choose(job(), [in_ram, on_device])
    assert d.worker_id == "w1" and d.costs["w1"] < d.costs["w0"]
    # and over the same worker with the template on disk, or nowhere (a recording)
    for other in (worker("w0", busy, ram={"a", "b"}, disk={"t0"}), worker("w0", busy)):
        assert router("mask_aware", cost_model).choose(job(), [other, on_device]).worker_id == "w1"


def test_a_read_holds_only_its_own_job_and_only_beyond_its_wait(cost_model):
    read = cost_model.disk_read_s(20)
    alone = cost_model.estimate(job(), worker("w", [(0.1, 10, "a")], ram={"a"}, disk={"t0"}))
    crowded = cost_model.estimate(job(), worker("w", [(0.1, 10, "a")] * 6, ram={"a"}, disk={"t0"}))
    assert alone["residency"] == pytest.approx(read) and crowded["residency"] == pytest.approx(read)
    # a full worker: J waits 10 steps of a full batch for a slot, the prefetch lands long before
    full = cost_model.estimate(job(), worker("w", [(0.1, 10, "a")] * 8, ram={"a"}, disk={"t0"}))
    assert full["wait"] > read and full["residency"] == 0.0
    # the waiting rows' own prefetches (templates on disk only, each once) are read before J's
    queued = worker(
        "w",
        [(0.1, 10, "a")],
        waiting=[(0.1, 20, "x"), (0.1, 20, "y"), (0.1, 20, "x"), (0.1, 20, "a")],
        ram={"a"},
        disk={"t0", "x", "y"},
    )
    assert cost_model.estimate(job(), queued)["residency"] == pytest.approx(3 * read)


def test_mask_aware_prefers_a_ram_hit_and_a_shorter_read_queue(cost_model):
    read = cost_model.disk_read_s(20)
    w0 = worker("w0", [(0.1, 20, "a")] * 5, ram={"a"}, disk={"t0"})
    w1 = worker("w1", [(0.1, 20, "a")] * 5, ram={"a", "t0"}, disk={"t0"})
    d = router("mask_aware", cost_model).choose(job(), [w0, w1])
    assert d.worker_id == "w1" and d.costs["w0"] - d.costs["w1"] == pytest.approx(read)
    # blind to residency: a tie, the smaller id
    for policy in ("flashps", "fewest_requests", "fewest_tokens"):
        assert router(policy, cost_model).choose(job(), [w0, w1]).worker_id == "w0", policy
    # the same two queues, differing only in the reads queued before J's: the shorter queue wins
    waiting = [(0.1, 20, "x"), (0.1, 20, "y")]
    slow = worker("w0", [(0.1, 10, "a")] * 2, waiting=waiting, ram={"a"}, disk={"t0", "x", "y"})
    fast = worker(
        "w1", [(0.1, 10, "a")] * 2, waiting=waiting, ram={"a", "x", "y"}, disk={"t0", "x", "y"}
    )
    d = router("mask_aware", cost_model).choose(job(), [slow, fast])
    assert d.worker_id == "w1" and d.costs["w0"] - d.costs["w1"] == pytest.approx(2 * read)


def test_mask_aware_sends_a_job_to_the_worker_recording_its_template(cost_model):
    """t0 is in no tier anywhere; w0 is recording it (a running row of t0, 5 steps left): J waits
    there for the commit and the read, then runs cached, rather than recording t0 again on w1."""
    read = cost_model.disk_read_s(20)
    recorder = worker("w0", [(0.1, 5, "t0"), (0.1, 12, "a")], ram={"a"})
    other = worker("w1", [(0.1, 12, "a")], ram={"a"})
    est = cost_model.estimate(job(), recorder)
    first = cost_model.step_latency([(0.1, "t0", False), (0.1, "a", True)])
    assert est["wait"] == 0 and est["residency"] == pytest.approx(5 * first + read)
    assert est["run"] < cost_model.estimate(job(), other)["run"] / 2  # cached vs recorded densely
    assert router("mask_aware", cost_model).choose(job(), [recorder, other]).worker_id == "w0"
    # a recording about to start elsewhere is not known yet: the estimate there is the dense run
    assert cost_model.estimate(job(), other)["residency"] == 0.0


def test_a_recording_goes_where_its_dense_row_delays_the_fewest_co_runners(cost_model):
    """t0 is cached nowhere: J records it densely. On w1 J itself would finish sooner (three light
    rows beside it instead of one heavy one), but its dense row would slow three rows, not one."""
    heavy = worker("w0", [(0.5, 20, "a")], ram={"a"})
    light = worker("w1", [(0.02, 20, "b")] * 3, ram={"b"})
    on_heavy, on_light = cost_model.estimate(job(), heavy), cost_model.estimate(job(), light)
    assert on_light["run"] < on_heavy["run"]
    slowdown = cost_model.step_latency(
        [(0.02, "b", True)] * 3 + [(0.1, "t0", False)]
    ) - cost_model.step_latency([(0.02, "b", True)] * 3)
    assert (
        on_light["imposed"] == pytest.approx(3 * 20 * slowdown)
        and on_light["imposed"] > 2 * on_heavy["imposed"]
    )
    assert router("mask_aware", cost_model).choose(job(), [heavy, light]).worker_id == "w0"
    # a row that reads a cache costs its co-runners little and is not charged for them
    cached = cost_model.estimate(job(), worker("w1", [(0.02, 20, "b")] * 3, ram={"b", "t0"}))
    assert cached["imposed"] == 0.0
    assert (
        router("mask_aware", cost_model)
        .choose(
            job(),
            [
                worker("w0", [(0.5, 20, "a")], ram={"a", "t0"}),
                worker("w1", [(0.02, 20, "b")] * 3, ram={"b", "t0"}),
            ],
        )
        .worker_id
        == "w1"
    )


def test_a_load_bound_co_runner_leaving_early_shortens_the_run_estimate_by_its_loads():
    """With loads that matter (the route bench's --load-scale what-if), a small-mask row of its own
    template costs the batch its loads, not its few masked tokens: when it retires after 2 of J's
    20 steps, the estimate must follow the step-by-step replay (weighting it by compute alone
    overestimated J's run by 15% here)."""
    from backend.bench.route_bench import RouteBenchConfig, cost_model_for

    cm = cost_model_for(RouteBenchConfig(profiles_dir=str(PROFILES), load_scale=650))
    view = worker("w", [(0.05, 2, "a"), (0.5, 20, "b")], ram={"a", "b", "t0"})
    rows = [(0.05, "a", True), (0.5, "b", True), (0.05, "t0", True)]
    replay = 2 * cm.step_latency(rows) + 18 * cm.step_latency(rows[1:])
    assert cm.estimate(job(mask=0.05), view)["run"] == pytest.approx(replay, rel=0.03)


def test_estimate_bounds_and_queue_wait(cost_model):
    view = worker(
        "w",
        [(0.2, 3, "a"), (0.1, 30, "b")],
        waiting=[(0.3, 20, "c")] * 2,
        ram={"a", "b", "c", "t0"},
        max_batch=4,
    )
    est = cost_model.estimate(job(), view)
    assert est["admit_step"] == 3 and est["wait"] > 0 and all(v >= 0 for v in est.values())
    alone = cost_model.step_latency([(0.1, "t0", True)]) * 20
    assert (
        alone
        <= est["run"]
        <= 20
        * cost_model.step_latency(
            [(0.1, "b", True), (0.3, "c", True), (0.3, "c", True), (0.1, "t0", True)]
        )
        + 1e-12
    )


def test_fast_unit_costs_and_greedy_match_the_engine_planner():
    """The aggregated costs and float greedy equal plan.greedy_plan over batch_unit_costs, on a
    load-heavy profile where caching does not always pay (so the plan is not all-cached)."""
    units = [
        UnitShape("a", 0, 1024, 320, 77, cache_bytes_per_token=1280),
        UnitShape("b", 0, 1024, 320, 77, cache_bytes_per_token=1280),
        UnitShape("mid", 1, 64, 1280, 77, cache_bytes_per_token=5120),
        UnitShape("c", 2, 1024, 320, 77, cache_bytes_per_token=1280),
    ]
    rng = random.Random(9)
    for mode in ("kv", "hidden"):
        profile = CostProfile(
            FORMAT_VERSION,
            "tiny-sd2-inpaint",
            "cuda",
            mode,
            LinearModel(1e-12, 1e-4, 0.99),
            LinearModel(4e-9, 2e-5, 0.98),
            units,
        )
        cm = RoutingCostModel(profile)
        seen_dense = False
        for _ in range(100):
            rows = [
                (rng.uniform(0.02, 0.9), f"t{rng.randint(0, 3)}", rng.random() < 0.8)
                for _ in range(rng.randint(1, 6))
            ]
            work = [
                RowWork(m if c else 1.0, t if c else f"d{i}", needs_load=c)
                for i, (m, t, c) in enumerate(rows)
                for _ in range(2)
            ]  # sd2: two rows per request
            plan = greedy_plan(batch_unit_costs(profile, work), profile.stack_ids, mode == "kv")
            seen_dense |= not all(plan.use_cache)
            assert cm.step_latency(rows) == pytest.approx(plan.latency_s, rel=1e-9)
        assert seen_dense


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.json")), ids=lambda p: p.stem)
def test_greedy_equals_the_exact_plan_on_every_shipped_profile(path):
    profile = CostProfile.from_json(path.read_text())
    fast, exact = RoutingCostModel(profile), RoutingCostModel(profile, planner="exact")
    rng = random.Random(path.stem)
    for _ in range(40):
        rows = [
            (rng.uniform(0.02, 0.9), f"t{rng.randint(0, 5)}", rng.random() < 0.8)
            for _ in range(rng.randint(1, 9))
        ]
        on_device = frozenset(f"t{i}" for i in range(6) if rng.random() < 0.3)
        assert fast.step_latency(rows) == pytest.approx(exact.step_latency(rows), rel=1e-9)
        assert fast.step_latency(rows, on_device) == pytest.approx(
            exact.step_latency(rows, on_device), rel=1e-9
        )


def test_load_cost_models_keys_by_model_and_device_kind():
    models = load_cost_models(PROFILES)
    assert (MODEL, "cpu") in models and ("tiny-sd2-inpaint", "cpu") in models
    assert (
        models[(MODEL, "cpu")].rows_per_request == 1
        and models[("tiny-sd2-inpaint", "cpu")].rows_per_request == 2
    )


# ----- heartbeats ---------------------------------------------------------------------------------
def test_view_from_heartbeat_round_trip():
    beat = protocol.WorkerHeartbeat(
        worker_id="w7",
        model_id=MODEL,
        device="cuda:1",
        at=1.0,
        max_batch=4,
        batching="continuous",
        running=[protocol.RunningRow(job_id="a", mask_ratio=0.2, remaining_steps=7, template="d1")],
        waiting=[protocol.WaitingRow(job_id="b", mask_ratio=0.05, num_steps=20, template="")],
        resident_ram=["d1"],
        resident_disk=["d1", "d2"],
        resident_device=["d3"],
    )
    view = view_from_heartbeat(protocol.decode(protocol.encode(beat)))
    assert view == WorkerView(
        "w7",
        MODEL,
        "cuda:1",
        4,
        (RowState("a", 0.2, 7, "d1"),),
        (RowState("b", 0.05, 20, ""),),
        frozenset({"d1"}),
        frozenset({"d1", "d2"}),
        seen_at=1.0,
        resident_device=frozenset({"d3"}),
    )
    assert (view.load, view.slack) == (2, 2)

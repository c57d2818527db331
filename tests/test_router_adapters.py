"""The router's adapter term: jobs go where their LoRA adapters are (pure, milliseconds)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.costmodel.costs import CostProfile
from backend.dispatch.adapter_cost import (
    ADAPTER_TIERS,
    DEFAULT_ADAPTER_COPY_S_PER_BYTE,
    AdapterNeed,
)
from backend.dispatch.router import (
    JobRequest,
    Router,
    RoutingCostModel,
    RowState,
    WorkerView,
    adapter_residency,
    view_from_heartbeat,
)
from backend.protocol.messages import RunningRow, WaitingRow, WorkerHeartbeat
from backend.worker.adapter_book import join_deadline
from tests.property_settings import examples

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
MODEL = "small-flux-fill"
GB = 10**9


def profile() -> CostProfile:
    return CostProfile.from_json((PROFILES / f"{MODEL}__cpu__kv.json").read_text())


@pytest.fixture(scope="module")
def strict() -> RoutingCostModel:
    """No join deadline slack (K = 0) and a 10 GB/s copy: every load shows in the cost."""
    return RoutingCostModel.from_profile(
        profile(), adapter_copy_s_per_byte=1e-10, adapter_join_by=0.0
    )


@pytest.fixture(scope="module")
def default() -> RoutingCostModel:
    return RoutingCostModel.from_profile(profile())


def view(wid, running=(), waiting=(), device=(), host=(), max_batch=8) -> WorkerView:
    def rows(spec, prefix):
        return tuple(
            RowState(f"{wid}-{prefix}{i}", m, s, t, tuple(a)) for i, (m, s, t, a) in enumerate(spec)
        )

    return WorkerView(
        wid,
        MODEL,
        "cpu",
        max_batch,
        rows(running, "r"),
        rows(waiting, "q"),
        frozenset({"t0"}),
        frozenset({"t0"}),
        frozenset(device),
        frozenset(host),
    )


def job(*adapters: tuple[str, int], mask=0.1, steps=20, template="t0") -> JobRequest:
    return JobRequest(
        "j", MODEL, mask, steps, template, tuple(AdapterNeed(s, n) for s, n in adapters)
    )


BUSY = ((0.1, 10, "t0", ()), (0.1, 12, "t0", ()))


def test_the_router_prefers_device_then_host_then_a_running_row_bringing_them_then_disk(strict):
    need = ("a" * 64, 1 * GB)
    workers = [
        view("w0", BUSY),  # only in the registry: read + copy
        view("w1", ((0.1, 10, "t0", ()), (0.1, 12, "t0", (need[0],)))),  # a running row brings it
        view("w2", BUSY, host={need[0]}),  # copy only
        view("w3", BUSY, device={need[0]}),  # nothing to load
    ]
    r = Router("mask_aware", {(MODEL, "cpu"): strict})
    d = r.choose(job(need), workers)
    assert d.worker_id == "w3" and "adapters 0.000" in d.reason
    assert d.costs["w3"] < d.costs["w2"] < d.costs["w1"] < d.costs["w0"]
    # take the best away, one at a time: the order holds
    assert r.choose(job(need), workers[:3]).worker_id == "w2"
    assert r.choose(job(need), workers[:2]).worker_id == "w1"
    # a waiting row's adapter is arriving too (its read started when it was queued)
    queued = view("w1", BUSY, waiting=((0.1, 20, "t0", (need[0],)),))
    assert strict.adapter_loads.tier(need[0], adapter_residency(queued)) == "arriving"
    # the same states without adapters on the job: the same costs for all (adapters ignored)
    plain = r.choose(job(), workers[::2])
    assert plain.costs["w0"] == plain.costs["w2"] and plain.worker_id == "w0"


def test_the_costs_of_a_job_without_adapters_are_the_same_whatever_the_workers_hold(default):
    bare = [view("w0", BUSY), view("w1", BUSY[:1])]
    holding = [
        view("w0", BUSY, device={"x"}, host={"y"}),
        view("w1", ((0.1, 10, "t0", ("x", "z")),), host={"x"}),
    ]
    for policy in ("mask_aware", "flashps", "fewest_requests", "fewest_tokens"):
        r = Router(policy, {(MODEL, "cpu"): default})
        assert r.choose(job(), bare) == r.choose(job(), holding)
    assert default.estimate(job(), holding[0])["adapters"] == 0.0


def test_a_load_hidden_by_the_first_k_steps_costs_nothing(default):
    w = view("w0", BUSY)
    t_job = default.estimate(job(), view("idle"))["run"] / 20  # alone: run = n T(J)
    k = join_deadline(20, default.adapter_loads.join_by)
    assert k == 4
    # a read + copy a bit under K steps of T(J): hidden; the same adapter well above: charged
    per_byte = default.adapter_loads.read_s_per_byte + default.adapter_loads.copy_s_per_byte
    hidden = int(0.9 * k * t_job / per_byte)
    assert default.estimate(job(("a", hidden)), w)["adapters"] == 0.0
    assert default.estimate(job(("a", hidden)), w)["total"] == default.estimate(job(), w)["total"]
    big = int(3 * k * t_job / per_byte)
    charged = default.estimate(job(("a", big)), w)["adapters"]
    assert charged == pytest.approx(big * per_byte - k * t_job)
    # the time J waits in W's queue hides reads (prefetched while queued), never copies
    full = view("w0", [(0.1, 10, "t0", ())] * 8)
    est = default.estimate(job(("a", big)), full)
    assert est["wait"] > 0
    read, copy = (
        big * default.adapter_loads.read_s_per_byte,
        big * default.adapter_loads.copy_s_per_byte,
    )
    assert est["adapters"] == pytest.approx(
        max(0.0, max(0.0, read - est["wait"]) + copy - k * t_job)
    )
    # K = 0 (join before the first step): the whole load
    eager = RoutingCostModel.from_profile(profile(), adapter_join_by=0.0)
    assert eager.estimate(job(("a", big)), w)["adapters"] == pytest.approx(big * per_byte)


def test_bandwidths_come_from_the_profile_or_the_settings():
    p = profile()
    assert RoutingCostModel.from_profile(p).adapter_loads.copy_s_per_byte == p.load.slope
    flat = replace(p, load=replace(p.load, slope=-1e-12))
    assert RoutingCostModel.from_profile(flat).adapter_loads.copy_s_per_byte == (
        DEFAULT_ADAPTER_COPY_S_PER_BYTE
    )
    cm = RoutingCostModel.from_profile(
        p, adapter_copy_s_per_byte=2e-10, adapter_read_s_per_byte=5e-10, adapter_join_by=0.5
    )
    assert (
        cm.adapter_loads.copy_s_per_byte,
        cm.adapter_loads.read_s_per_byte,
        cm.adapter_loads.join_by,
    ) == (
        2e-10,
        5e-10,
        0.5,
    )
    assert RoutingCostModel.from_profile(p).adapter_loads.read_s_per_byte == 1e-9  # the disk read's
    with pytest.raises(ValueError, match="join_by"):
        RoutingCostModel.from_profile(p, adapter_join_by=1.5)
    with pytest.raises(ValueError, match="copy"):
        RoutingCostModel.from_profile(p, adapter_copy_s_per_byte=-1.0)


def test_an_adapter_named_twice_is_loaded_once_and_unknown_sizes_cost_nothing(strict):
    w = view("w0", BUSY)
    once = strict.estimate(job(("a", GB)), w)["adapters"]
    assert strict.estimate(job(("a", GB), ("a", GB)), w)["adapters"] == once > 0
    assert strict.estimate(job(("a", 0), ("b", 0)), w)["adapters"] == 0.0


def test_view_from_heartbeat_reads_adapter_residency_and_row_adapters():
    beat = WorkerHeartbeat(
        worker_id="w0",
        model_id=MODEL,
        device="cpu",
        at=1.0,
        max_batch=4,
        batching="continuous",
        running=[RunningRow("j1", 0.2, 7, "t0", ["s1", "s2"])],
        waiting=[WaitingRow("j2", 0.3, 20, "", ["s3"])],
        adapters_device=["s1"],
        adapters_host=["s1", "s4"],
    )
    v = view_from_heartbeat(beat)
    assert v.running == (RowState("j1", 0.2, 7, "t0", ("s1", "s2")),)
    assert v.waiting == (RowState("j2", 0.3, 20, "", ("s3",)),)
    assert v.adapters_device == frozenset({"s1"}) and v.adapters_host == frozenset({"s1", "s4"})
    # a heartbeat of a worker without adapters (or an older one): empty sets, rows without
    old = view_from_heartbeat(
        WorkerHeartbeat(
            worker_id="w1",
            model_id=MODEL,
            device="cpu",
            at=1.0,
            max_batch=4,
            batching="continuous",
            running=[RunningRow("j3", 0.2, 7)],
            waiting=[],
        )
    )
    assert old.adapters_device == old.adapters_host == frozenset()
    assert old.running[0].adapters == ()


# ----- invariants over random inputs ------------------------------------------------------------
SHAS = [f"s{i}" for i in range(6)]
row = st.tuples(
    st.floats(0.01, 1.0),
    st.integers(1, 20),
    st.sampled_from(["t0", "t1", "t2", ""]),
    st.lists(st.sampled_from(SHAS), max_size=3, unique=True),
)
worker_state = st.fixed_dictionaries(
    {
        "running": st.lists(row, max_size=8),
        "waiting": st.lists(row, max_size=6),
        "device": st.sets(st.sampled_from(SHAS)),
        "host": st.sets(st.sampled_from(SHAS)),
    }
)
needs = st.lists(st.tuples(st.sampled_from(SHAS), st.integers(0, 4 * GB)), min_size=1, max_size=3)
rates = st.fixed_dictionaries(
    {
        "adapter_copy_s_per_byte": st.sampled_from([None, 0.0, 1e-11, 1e-10]),
        "adapter_read_s_per_byte": st.sampled_from([None, 0.0, 1e-9, 4e-9]),
        "adapter_join_by": st.sampled_from([0.0, 0.1, 0.2, 0.5, 1.0]),
    }
)
_models: dict = {}


def model(r: dict) -> RoutingCostModel:
    key = tuple(sorted(r.items()))
    if key not in _models:
        _models[key] = RoutingCostModel.from_profile(profile(), **r)
    return _models[key]


def state_view(s: dict) -> WorkerView:
    return view("w", s["running"], s["waiting"], s["device"], s["host"])


@examples(80)
@given(s=worker_state, adapters=needs, r=rates, mask=st.floats(0.01, 1.0), steps=st.integers(1, 30))
def test_the_adapter_term_is_bounded_and_leaves_every_other_term_alone(s, adapters, r, mask, steps):
    cm, w = model(r), state_view(s)
    bare = cm.estimate(job(mask=mask, steps=steps), w)
    est = cm.estimate(job(*adapters, mask=mask, steps=steps), w)
    assert all(v >= 0 for v in est.values())
    whole = sum(
        sum(
            cm.adapter_loads.load_s(
                AdapterNeed(sha, n), cm.adapter_loads.tier(sha, adapter_residency(w))
            )
        )
        for sha, n in dict(reversed(adapters)).items()  # each sha once, its first size
    )
    assert est["adapters"] <= whole + 1e-12
    for term in ("wait", "run", "residency", "imposed"):
        assert est[term] == bare[term]
    assert est["total"] == pytest.approx(bare["total"] + est["adapters"])


@examples(80)
@given(s=worker_state, adapters=needs, r=rates, which=st.integers(0, 2), grow=st.integers(1, GB))
def test_a_cheaper_tier_or_a_smaller_adapter_never_costs_more(s, adapters, r, which, grow):
    cm, w = model(r), state_view(s)
    j = job(*adapters)
    cost = cm.estimate(j, w)["total"]
    sha, nbytes = adapters[which % len(adapters)]
    bigger = job(*[(a, n + grow if a == sha else n) for a, n in adapters])
    assert cm.estimate(bigger, w)["total"] >= cost
    # move the adapter one tier up (disk -> arriving -> host -> device): never dearer
    tier = cm.adapter_loads.tier(sha, adapter_residency(w))
    if tier == "disk":
        up = replace(w, waiting=w.waiting + (RowState("x", 0.1, 20, "", (sha,)),))
        # the extra waiting row costs J its slot order: compare with the same row without it
        base = replace(w, waiting=w.waiting + (RowState("x", 0.1, 20, "", ()),))
        assert cm.estimate(j, up)["total"] <= cm.estimate(j, base)["total"] + 1e-12
    elif tier == "arriving":
        up = replace(w, adapters_host=w.adapters_host | {sha})
        assert cm.estimate(j, up)["total"] <= cost + 1e-12
    elif tier == "host":
        up = replace(w, adapters_device=w.adapters_device | {sha})
        assert cm.estimate(j, up)["total"] <= cost + 1e-12
    # the tiers' per-adapter loads are ordered
    loads = [sum(cm.adapter_loads.load_s(AdapterNeed(sha, nbytes), t)) for t in ADAPTER_TIERS]
    assert loads == sorted(loads) and loads[0] == 0.0


@examples(80)
@given(
    s=worker_state,
    adapters=needs,
    r=rates,
    mask=st.floats(0.01, 0.9),
    steps=st.integers(1, 29),
    extra=st.tuples(st.floats(0.01, 0.9), st.integers(1, 20)),
)
def test_more_steps_a_larger_mask_or_another_running_row_never_cost_less_with_adapters(
    s, adapters, r, mask, steps, extra
):
    cm, w = model(r), state_view(s)
    cost = cm.estimate(job(*adapters, mask=mask, steps=steps), w)["total"]
    assert cm.estimate(job(*adapters, mask=mask, steps=steps + 1), w)["total"] >= cost - 1e-9
    assert cm.estimate(job(*adapters, mask=mask + 0.1, steps=steps), w)["total"] >= cost - 1e-9
    # a running row that applies none of J's adapters, in the regime where the base cost has
    # this invariant (tests/test_router.py: up to 6 running rows, none waiting, cached rows)
    fewer = replace(w, running=w.running[:6], waiting=())
    cost = cm.estimate(job(*adapters, mask=mask, steps=steps), fewer)["total"]
    more = replace(fewer, running=fewer.running + (RowState("x", extra[0], extra[1], "t0", ()),))
    assert cm.estimate(job(*adapters, mask=mask, steps=steps), more)["total"] >= cost - 1e-9

"""`maskserve bench route` at a toy scale: the report's structure, and every job completes under
every policy (not a timing test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.bench.route_bench import (
    BASELINES,
    RouteBenchConfig,
    cost_model_for,
    decision_time,
    load_compute_ratio,
    load_profile,
    load_scale_for_ratio,
    offered_trace,
    run_route_bench,
    summarize_seeds,
    summary_table,
    write_outputs,
)
from backend.cache.manager import Tier
from backend.dispatch.router import POLICIES

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


@pytest.mark.slow
def test_the_route_bench_completes_every_job_under_every_policy_and_writes_its_report(tmp_path):
    cfg = RouteBenchConfig(
        profiles_dir=str(PROFILES),
        loads=(0.3, 0.9),
        duration_s=20.0,
        num_workers=3,
        max_batch=2,
        steps=3,
        num_templates=12,
        ram_templates=2,
        prerecorded=0.5,
    )
    report = run_route_bench(cfg)
    assert (
        report["capacity_rps"] > 0 and report["capacity_bound_rps"] >= report["capacity_rps"] * 0.5
    )
    results = report["results"]
    assert [(r["load"], r["policy"]) for r in results] == [
        (load, p) for load in cfg.loads for p in POLICIES
    ]
    for r in results:
        expected = len(offered_trace(cfg, r["rps"], cfg.seed))
        # short toy traces: coarse
        assert abs(expected / cfg.duration_s - r["rps"]) <= 0.2 * r["rps"]
        assert r["num_jobs"] == r["completed"] == expected > 0, r["policy"]
        assert (
            0 < r["p50_latency_s"] <= r["p95_latency_s"]
            and r["avg_latency_s"] > 0
            and r["throughput_rps"] > 0
        )
        assert set(r["cache"]) == {"ram_hits", "disk_reads", "dense_rows", "held"}
        assert r["mean_batch_rows"] <= cfg.max_batch
        assert (
            set(r["decision_ms"]) == {"p50", "p95"}
            and 0 < r["decision_ms"]["p50"] <= r["decision_ms"]["p95"]
        )
        warm = [
            a for a in offered_trace(cfg, r["rps"], cfg.seed) if a.arrival_s >= cfg.duration_s / 4
        ]
        assert 0 < r["measured_jobs"] == len(warm) < r["num_jobs"] and r["p95_all_latency_s"] > 0
    batch = {(r["load"], r["policy"]): r["mean_batch_rows"] for r in results}
    for policy in POLICIES:  # batches fill up with load: near one row at 0.3, near max_batch at 0.9
        assert batch[(0.3, policy)] < 1.3 and batch[(0.9, policy)] > 1.5, (policy, batch)
    assert (
        sum(r["cache"]["dense_rows"] for r in results) > 0
        and sum(r["cache"]["disk_reads"] for r in results) > 0
    )
    assert set(report["p95_reduction"]) == {"0.3", "0.9"}
    assert report["load_compute_ratio"] == pytest.approx(
        load_compute_ratio(load_profile(cfg), cfg.mask_mean)
    )
    assert all(set(v) == set(BASELINES) for v in report["p95_reduction"].values())
    assert set(report["p95_all_reduction"]) == {"0.3", "0.9"}
    plot = write_outputs(cfg, report, tmp_path / "route.json")
    assert json.loads((tmp_path / "route.json").read_text())["config"]["num_workers"] == 3
    assert plot.exists() and plot.stat().st_size > 0


def test_decision_time_reports_percentiles():
    cfg = RouteBenchConfig(profiles_dir=str(PROFILES))
    out = decision_time(cost_model_for(cfg), decisions=50)
    assert out["decisions"] == 50 and out["workers"] == 8 and out["rows_per_worker"] == 8
    assert 0 < out["p50_ms"] <= out["p95_ms"]


def test_latency_statistics_leave_out_the_warm_up_only():
    """The warm-up share is simulated but not measured; with none, both P95s are the same."""
    base = dict(
        profiles_dir=str(PROFILES),
        policies=("fewest_requests",),
        loads=(0.9,),
        duration_s=20.0,
        num_workers=2,
        max_batch=2,
        steps=3,
        num_templates=12,
        ram_templates=2,
        prerecorded=0.5,
    )
    every = run_route_bench(RouteBenchConfig(warmup_fraction=0.0, **base))["results"][0]
    assert every["measured_jobs"] == every["num_jobs"] == every["completed"]
    assert every["p95_latency_s"] == every["p95_all_latency_s"]
    half = run_route_bench(RouteBenchConfig(warmup_fraction=0.5, **base))["results"][0]
    assert half["num_jobs"] == every["num_jobs"] and half["completed"] == every["completed"]
    assert (
        0 < half["measured_jobs"] < every["measured_jobs"]
        and half["p95_all_latency_s"] == every["p95_all_latency_s"]
    )


# ----- the simulated cluster's timing (admission rules: tests/test_admission_scenarios.py) -------
def _sim(policy="fewest_requests", workers=1, disk=(), **kw):
    from backend.bench.route_sim import ClusterSimulation
    from backend.dispatch.router import Router

    cfg = RouteBenchConfig(
        profiles_dir=str(PROFILES), num_workers=workers, max_batch=2, steps=4, noise_cv=0.0, **kw
    )
    model = cost_model_for(cfg)
    router = Router(
        policy,
        {(cfg.model_id, cfg.device): model},
        allow_queueing=not cfg.late_binding,
        queue_depth=cfg.queue_depth,
    )
    return (
        cfg,
        model,
        lambda trace: ClusterSimulation(cfg, model, router, trace, {f"tpl{t}" for t in disk}),
    )


def _req(index, at, template, mask=0.1):
    from backend.bench.trace import TraceRequest

    return TraceRequest(index, at, template, mask, seed=index)


def test_sim_a_held_row_joins_at_the_first_step_end_after_its_read_without_stalling_the_batch():
    cfg, model, make = _sim(disk=(0, 1))
    read = model.disk_read_s(cfg.steps)
    alone = model.step_latency([(0.1, "tpl0", True)])
    pair = model.step_latency([(0.1, "tpl0", True), (0.1, "tpl1", True)])
    assert alone < read < 2 * alone  # job 1's read lands during job 0's second step
    sim = make([_req(0, 0.0, 0), _req(1, read + 0.1 * alone, 1)])
    sim.run()
    assert sim.counts["disk_reads"] == 2 and sim.counts["held"] == 2  # each held once
    # job 0 steps alone twice (job 1's read stalls no step), then beside job 1, which joined at
    # the first step end after its read landed and finishes alone
    assert sim.done_at[0] == pytest.approx(read + 2 * alone + 2 * pair)
    assert sim.done_at[1] == pytest.approx(read + 2 * alone + 2 * pair + 2 * alone)


def test_sim_a_measured_step_shape_prices_each_step_by_its_row_count():
    cfg, model, make = _sim(disk=(0, 1), step_shape=(1.0, 1.5))
    read = model.disk_read_s(cfg.steps)
    alone = model.step_latency([(0.1, "tpl0", True)])
    pair = model.step_latency([(0.1, "tpl0", True), (0.1, "tpl1", True)])
    sim = make([_req(0, 0.0, 0), _req(1, read + 0.1 * alone, 1)])
    sim.run()
    # as without a shape (the test above), but the steps of two rows take 1.5 times the profile's
    assert sim.done_at[0] == pytest.approx(read + 2 * alone + 2 * 1.5 * pair)
    assert sim.done_at[1] == pytest.approx(read + 2 * alone + 2 * 1.5 * pair + 2 * alone)


def test_sim_an_idle_worker_wakes_when_the_held_read_lands():
    cfg, model, make = _sim(disk=(1,))
    sim = make([_req(0, 1.0, 1)])
    sim.run()
    read = model.disk_read_s(cfg.steps)
    assert sim.done_at[0] == pytest.approx(
        1.0 + read + 4 * model.step_latency([(0.1, "tpl1", True)])
    )


def test_sim_records_a_template_once_per_worker_and_its_other_rows_read_the_cache():
    cfg, model, make = _sim()
    sim = make([_req(0, 0.0, 5), _req(1, 0.1, 5)])
    sim.run()
    read = model.disk_read_s(cfg.steps)
    # the commit's read into RAM
    assert sim.counts["dense_rows"] == 1 and sim.counts["disk_reads"] == 1
    assert sim.done_at[1] > sim.done_at[0] + read  # held until the recording landed in RAM
    assert sim.disk.templates == {"tpl5"}  # published on the shared disk


def test_sim_late_binding_holds_jobs_in_arrival_order_until_a_slot_frees():
    cfg, model, make = _sim(late_binding=True, disk=(0,))
    sim = make([_req(i, 0.01 * i, 0) for i in range(4)])
    sim.run()
    assert not sim.held and sorted(sim.done_at) == [0, 1, 2, 3]
    assert sorted(sim.done_at, key=sim.done_at.get) == [0, 1, 2, 3]  # FIFO
    alone = model.step_latency([(0.1, "tpl0", True)])
    assert sim.done_at[2] >= sim.done_at[0] + 4 * alone  # dispatched only once job 0 had left
    # jobs 2 and 3 were refused (held at the dispatcher) before a slot freed
    assert len(sim.decisions) > 4


def test_sim_a_worker_keeps_at_most_its_ram_budget_of_templates():
    cfg, model, make = _sim(disk=range(12), ram_templates=2, workers=2)
    sim = make([_req(i, 0.05 * i, i % 12) for i in range(40)])
    sim.run()
    assert sorted(sim.done_at) == list(range(40))
    for worker in sim.workers:
        assert len(worker.caches.manager.resident(Tier.RAM)) <= 2


def test_a_load_what_if_makes_small_masks_load_bound_and_shared_templates_cheap():
    measured = cost_model_for(RouteBenchConfig(profiles_dir=str(PROFILES)))
    slow = cost_model_for(RouteBenchConfig(profiles_dir=str(PROFILES), load_ratio=1.02))
    distinct = [(0.05, f"t{i}", True) for i in range(8)]
    shared = [(0.05, "t0", True)] * 8
    # eight templates' loads
    assert slow.step_latency(distinct) > 3 * measured.step_latency(distinct)
    assert slow.step_latency(shared) < slow.step_latency(distinct) / 3  # one template's, paid once
    assert slow.step_latency([(1.0, "t0", True)]) == pytest.approx(
        measured.step_latency([(1.0, "t0", True)])
    )
    with pytest.raises(ValueError, match="load_scale"):
        cost_model_for(RouteBenchConfig(profiles_dir=str(PROFILES), load_scale=0))


@pytest.mark.parametrize("model_id", ["small-flux-fill", "small-sdxl-inpaint", "small-sd2-inpaint"])
def test_a_load_ratio_what_if_puts_a_mean_mask_request_s_loads_at_that_multiple_of_its_compute(
    model_id,
):
    """--load-ratio 1.02 (FlashPS measured sequential loads adding 102% to an edit on an H800): the
    scaled profile's loads are 1.02x the compute of a mean-mask request; this CPU's are under 2%."""
    cfg = RouteBenchConfig(profiles_dir=str(PROFILES), model_id=model_id)
    measured = load_profile(cfg)
    assert load_compute_ratio(measured, cfg.mask_mean) < 0.02
    what_if = cost_model_for(
        RouteBenchConfig(profiles_dir=str(PROFILES), model_id=model_id, load_ratio=1.02)
    )
    assert load_compute_ratio(what_if.profile, cfg.mask_mean) == pytest.approx(1.02, rel=1e-6)
    scale = load_scale_for_ratio(measured, 1.02, cfg.mask_mean)
    assert what_if.profile.load.slope == pytest.approx(measured.load.slope * scale)
    assert (
        what_if.profile.compute == measured.compute
        and what_if.profile.load.intercept == measured.load.intercept
    )
    # a smaller mask computes less against the same loads: its ratio is higher
    assert (
        load_compute_ratio(what_if.profile, 0.05) > 1.02 > load_compute_ratio(what_if.profile, 0.3)
    )


def test_a_load_ratio_what_if_refuses_bad_values():
    for bad in (-1.0, 1e-9):  # negative; below what the load intercepts alone give
        with pytest.raises(ValueError, match="load_ratio"):
            cost_model_for(RouteBenchConfig(profiles_dir=str(PROFILES), load_ratio=bad))
    with pytest.raises(ValueError, match="not reachable"):  # a whole-image mask reads no cache
        cost_model_for(RouteBenchConfig(profiles_dir=str(PROFILES), load_ratio=1.02, mask_mean=1.0))
    with pytest.raises(ValueError, match="not both"):
        cost_model_for(
            RouteBenchConfig(profiles_dir=str(PROFILES), load_ratio=1.02, load_scale=650)
        )


def _report(seed: int, p95: dict[tuple[float, str], float]) -> dict:
    return {
        "config": {"seed": seed},
        "capacity_rps": 4.0 + seed,
        "load_compute_ratio": 0.5,
        "results": [
            {
                "load": load,
                "policy": policy,
                "rps": load * 4,
                "avg_latency_s": v / 2,
                "p95_latency_s": v,
                "p95_all_latency_s": v * 1.1,
            }
            for (load, policy), v in p95.items()
        ],
    }


def test_summarize_seeds_averages_the_policies_and_cuts_against_the_best_other_of_each_seed():
    a = _report(
        0, {(0.5, "mask_aware"): 8.0, (0.5, "fewest_tokens"): 10.0, (0.5, "fewest_requests"): 16.0}
    )
    b = _report(
        1, {(0.5, "mask_aware"): 6.0, (0.5, "fewest_tokens"): 12.0, (0.5, "fewest_requests"): 8.0}
    )
    summary = summarize_seeds([a, b])
    assert summary["seeds"] == [0, 1] and summary["capacity_rps"] == 4.5
    mean = {r["policy"]: r["p95_latency_s"] for r in summary["results"]}
    assert mean == {"mask_aware": 7.0, "fewest_tokens": 11.0, "fewest_requests": 12.0}
    cut = summary["cuts"]["0.5"]
    assert cut["best_other"] == {
        "mean": pytest.approx(0.225),
        "min": pytest.approx(0.2),
        "max": pytest.approx(0.25),
    }
    assert cut["fewest_requests"]["mean"] == pytest.approx((0.5 + 0.25) / 2)
    table = summary_table(summary)
    assert (
        "| 0.5 (2.00) | **7.0** | 11.0 | 12.0 | 22% (20% to 25%) | 35% | 38% |"
        in table.splitlines()
    )
    with pytest.raises(ValueError, match="same loads and policies"):
        summarize_seeds([a, _report(2, {(0.5, "mask_aware"): 1.0})])
    with pytest.raises(ValueError, match="no reports"):
        summarize_seeds([])


@pytest.mark.slow
def test_the_route_bench_command_runs_several_seeds_and_writes_their_mean(tmp_path, capsys):
    from backend.cli import main

    out = tmp_path / "route.json"
    rc = main(
        [
            "bench",
            "route",
            "--profiles-dir",
            str(PROFILES),
            "--loads",
            "0.4,0.8",
            "--duration",
            "20",
            "--workers",
            "3",
            "--max-batch",
            "2",
            "--steps",
            "3",
            "--templates",
            "12",
            "--ram-templates",
            "2",
            "--policies",
            "mask_aware,fewest_tokens",
            "--seeds",
            "0,1",
            "--decisions",
            "0",
            "--load-ratio",
            "1.02",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "1.02x its compute (what-if, not a measured device)" in printed
    assert (
        "| load (req/s) | mask_aware | fewest_tokens | cut vs best other | vs fewest_tokens |"
        in printed
    )
    per_seed = [json.loads((tmp_path / f"route-seed{s}.json").read_text()) for s in (0, 1)]
    summary = json.loads(out.read_text())
    assert [r["config"]["seed"] for r in per_seed] == summary["seeds"] == [0, 1]
    assert all(
        p.exists()
        for p in (
            out.with_suffix(".png"),
            tmp_path / "route-seed0.png",
            tmp_path / "route-seed1.png",
        )
    )
    first = summary["results"][0]
    assert first["p95_latency_s"] == pytest.approx(
        sum(r["results"][0]["p95_latency_s"] for r in per_seed) / 2
    )
    for bad in (["--load-ratio", "-1"], ["--seeds", "0,x"], ["--seeds", "1,1"], ["--seeds", "5-3"]):
        assert (
            main(["bench", "route", "--profiles-dir", str(PROFILES), *bad, "--json", str(out)]) == 2
        )
    err = capsys.readouterr().err
    assert "--seeds takes integers and ranges, e.g. 0,1,2 or 3-12" in err
    assert "--seeds repeats a seed" in err and "runs backwards: write 3-5" in err


# ----- adapters in the simulation ---------------------------------------------------------------
def test_sim_a_row_takes_its_adapter_late_and_blocks_only_at_its_join_deadline():
    from backend.dispatch.router import AdapterNeed

    for join_by in (0.0, 0.25):
        cfg, model, make = _sim(num_adapters=1, adapter_join_by=join_by)
        dense = model.step_latency([(0.1, "tpl0", False)])  # tpl0 on no disk: it records
        nbytes = int(
            3 * dense / (model.adapter_loads.read_s_per_byte + model.adapter_loads.copy_s_per_byte)
        )
        load = nbytes * (model.adapter_loads.read_s_per_byte + model.adapter_loads.copy_s_per_byte)
        sim = make([_req(0, 0.0, 0), _req(1, 20.0, 0)])
        need = (AdapterNeed("lora0", nbytes),)
        sim.adapters_of = {0: need, 1: need}
        sim.run()
        cached = model.step_latency([(0.1, "tpl0", True)])
        # K = 0: the first step waits for the whole load; K = 1 (of 4 steps): step 0 runs
        # without it, step 1 waits for the rest
        k = 0 if join_by == 0 else 1
        assert sim.done_at[0] == pytest.approx(max(k * dense, load) + (4 - k) * dense)
        counts = sim.counts
        assert counts["adapter_rows_blocked"] == 1 and counts["adapter_block_s"] > 0
        # the second job finds it on the device (pinned by none, kept by the tier's budget)
        assert sim.done_at[1] == pytest.approx(20.0 + 4 * cached)
        assert (counts["adapter_hits_device"], counts["adapter_hits_disk"]) == (1, 1)
        assert counts["adapter_reads"] == counts["adapter_copies"] == 1


def test_the_route_bench_with_adapters_completes_every_job_for_mask_aware_with_and_without():
    from backend.bench.route_bench import ADAPTER_BLIND, request_adapters

    cfg = RouteBenchConfig(
        profiles_dir=str(PROFILES),
        policies=("mask_aware", ADAPTER_BLIND, "fewest_requests"),
        loads=(0.7,),
        duration_s=30.0,
        num_workers=3,
        max_batch=4,
        steps=5,
        num_templates=12,
        ram_templates=3,
        num_adapters=20,
        adapter_device_mb=200,
        adapter_host_mb=600,
        adapter_read_gbps=0.2,
        calibrate=False,
    )
    report = run_route_bench(cfg)
    trace = offered_trace(cfg, report["results"][0]["rps"], cfg.seed)
    wanted = sum(len({a.sha256 for a in v}) for v in request_adapters(cfg, trace).values())
    for r in report["results"]:
        c = r["cache"]
        assert r["completed"] == r["num_jobs"] == len(trace) > 0, r["policy"]
        # every admitted row asked for each of its adapters once
        assert c["adapter_hits_device"] + c["adapter_hits_host"] + c["adapter_hits_disk"] == wanted
        assert 0 <= c["adapter_rows_blocked"] <= c["adapter_rows"]
    # the same requests draw the same adapters whatever the policy
    assert request_adapters(cfg, trace) == request_adapters(cfg, trace)

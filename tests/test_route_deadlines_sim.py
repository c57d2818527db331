"""`maskserve bench route-deadlines` at a toy scale: traces with service classes, the simulated
workers' parking and resuming, admission control, the report and its targets (not a timing test:
simulated time)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from backend.bench.machine_drift import DriftSpec, SpeedDrift
from backend.bench.route_bench import RouteBenchConfig, cost_model_for
from backend.bench.route_deadlines import (
    DeadlineBenchConfig,
    deadline_trace,
    run_deadline_bench,
    services_of,
    table,
    targets,
    write_outputs,
)
from backend.bench.route_deadlines_sim import (
    DeadlineClusterSimulation,
    Service,
    ShedRule,
    StepPlan,
)
from backend.bench.trace import TraceRequest, service_classes
from backend.dispatch.router import Router

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def toy(**kw) -> DeadlineBenchConfig:
    base = dict(
        profiles_dir=str(PROFILES),
        duration_s=40.0,
        num_workers=3,
        max_batch=2,
        steps=6,
        num_templates=10,
        ram_templates=3,
        prerecorded=0.7,
        loads=(0.6, 1.1),
        interactive_target_s=8.0,
        batch_target_s=120.0,
        burst_factor=10.0,
        burst_share=0.05,
        burst_s=2.0,
    )
    return DeadlineBenchConfig(**(base | kw))


# ----- traces -----------------------------------------------------------------------------------
def test_service_classes_are_seeded_and_take_their_share():
    classes = service_classes(5000, 0.3, seed=4)
    assert classes == service_classes(5000, 0.3, seed=4) != service_classes(5000, 0.3, seed=5)
    assert classes.count("interactive") / 5000 == pytest.approx(0.3, abs=0.02)
    assert set(service_classes(10, 0.0)) == {"batch"}
    with pytest.raises(ValueError, match="interactive share"):
        service_classes(3, 1.5)


def test_deadline_traces_offer_the_rate_and_bursts_cluster_arrivals_at_the_same_times():
    cfg = toy(duration_s=600.0, burst_factor=20.0, burst_share=0.02, burst_s=3.0)
    poisson, bursty = deadline_trace(cfg, "poisson", 4.0, 0), deadline_trace(cfg, "bursty", 4.0, 0)
    assert len(poisson) == len(bursty) == 2400  # exactly the rate offered
    assert all(0 <= r.arrival_s <= 600 for r in bursty)
    assert [r.arrival_s for r in bursty] == sorted(r.arrival_s for r in bursty)

    def busiest_second(trace):
        counts: dict[int, int] = {}
        for r in trace:
            counts[int(r.arrival_s)] = counts.get(int(r.arrival_s), 0) + 1
        return max(counts.values())

    assert busiest_second(bursty) > 3 * busiest_second(poisson)

    # the bursts do not move with the rate: the busiest seconds are the same at half the rate
    def busy(trace):
        counts: dict[int, int] = {}
        for r in trace:
            counts[int(r.arrival_s)] = counts.get(int(r.arrival_s), 0) + 1
        return {sec for sec, n in counts.items() if n >= 4 * len(trace) / 600}

    assert busy(bursty) and len(busy(bursty) & busy(deadline_trace(cfg, "bursty", 2.0, 0))) >= 3
    services = services_of(cfg, bursty)
    for req, s in zip(bursty, services):
        target = (
            cfg.interactive_target_s if s.service_class == "interactive" else cfg.batch_target_s
        )
        assert s.deadline == pytest.approx(req.arrival_s + target)
    with pytest.raises(ValueError, match="trace must be one of"):
        deadline_trace(cfg, "diurnal", 1.0, 0)


# ----- the simulated workers --------------------------------------------------------------------
def one_worker(
    scheduler: str,
    records: bool = False,
    clock: bool = False,
    drift=None,
    slack_steps: float = 6.0,
    urgent_parks: bool = True,
):
    """One worker, one slot, 20 steps a job: a batch job runs from t=0; an interactive job arrives
    5.5 steps in, with ``slack_steps`` of slack (6: it must start by step 10 and a half).
    ``records``: the batch job's template is in no tier (it records it), the interactive job's
    another one. ``clock`` and ``drift``: the plan's step clock and the machine's drift."""
    route = RouteBenchConfig(
        profiles_dir=str(PROFILES),
        num_workers=1,
        max_batch=1,
        steps=20,
        num_templates=2,
        ram_templates=2,
        prerecorded=1.0,
        noise_cv=0.0,
        disk_read_s_per_byte=0.0,
    )
    truth, routing = cost_model_for(route, "exact"), cost_model_for(route)
    t = truth.step_latency([(0.1, "tpl0", True)])
    trace = [TraceRequest(0, 0.0, 0, 0.1, 1), TraceRequest(1, 5.5 * t, int(records), 0.1, 2)]
    due = trace[1].arrival_s + (20 + slack_steps) * t
    services = [Service("batch", 600.0), Service("interactive", due)]
    sim = DeadlineClusterSimulation(
        route,
        truth,
        Router("mask_aware", {(route.model_id, route.device): routing}),
        trace,
        {"tpl1"} if records else {"tpl0"},
        services,
        StepPlan(scheduler, round_steps=5, clock=clock, urgent_parks=urgent_parks),
        routing,
        drift=drift,
    )
    sim.run()
    return sim, t, services


def test_the_slack_scheduler_parks_the_batch_row_for_the_tight_one_which_resumes_after():
    sim, t, services = one_worker("slack")
    # the planning round at step 10 parks the batch job (10 steps left) for the interactive one
    assert sim.done_at[1] == pytest.approx(30 * t, rel=0.02)
    assert sim.done_at[1] <= services[1].deadline
    assert sim.done_at[0] == pytest.approx(40 * t, rel=0.02)  # it resumed for its last 10 steps
    batch, interactive = sim.finished[0], sim.finished[1]
    assert batch.parks == 1 and batch.steps_done == 20 and interactive.steps_done == 20
    assert batch.wait_s == pytest.approx(20 * t, rel=0.02)  # parked from step 10 to 30
    # one row a step (max_batch 1), each job's 20 steps counted once, the parked one's 10 + 10
    assert sim.batch_rows == [1] * 40
    counts = sim.scheduler_counts()
    assert counts["parks"] == counts["resumes"] == 1 and counts["rounds"] >= 7  # every 5 steps
    assert sim.predicted[1] <= services[1].deadline  # the router expected the park


@pytest.mark.parametrize("urgent_parks", [True, False])
def test_a_job_late_by_the_next_round_has_the_batch_row_parked_at_once(urgent_parks):
    """Three steps of slack when it arrives (step 5.5): the round at step 10 is too late for it.
    With urgent parks the batch row is parked at the next step boundary (6) and the tight job is
    done by step 26; with parks at rounds only it starts at 10 and is late."""
    sim, t, services = one_worker("slack", slack_steps=3.0, urgent_parks=urgent_parks)
    start = 6 if urgent_parks else 10
    assert sim.done_at[1] == pytest.approx((start + 20) * t, rel=0.02)
    assert (sim.done_at[1] <= services[1].deadline) == urgent_parks
    assert sim.finished[0].parks == 1 and sim.done_at[0] == pytest.approx(40 * t, rel=0.02)


@pytest.mark.parametrize("scheduler", ["fifo", "edf"])
def test_without_parking_the_tight_job_waits_for_the_slot_and_is_late(scheduler):
    sim, t, services = one_worker(scheduler)
    assert sim.done_at[0] == pytest.approx(20 * t, rel=0.02)
    assert sim.done_at[1] == pytest.approx(40 * t, rel=0.02)
    assert sim.done_at[1] > services[1].deadline
    assert sim.scheduler_counts()["parks"] == 0 and sim.finished[0].parks == 0
    tight_job = 1
    assert tight_job in sim.accepted_late  # predicted late, and accepted (interactive is not shed)


def test_a_row_recording_its_template_is_never_parked():
    sim, _, services = one_worker("slack", records=True)
    assert sim.finished[0].records and sim.scheduler_counts()["parks"] == 0
    assert sim.done_at[1] > sim.done_at[0] and sim.done_at[1] > services[1].deadline


def test_a_drifting_machine_slows_every_step_by_its_factor_and_the_clock_learns_it():
    steady = DriftSpec(cv=0.5, tau_s=1e12)  # one draw that holds for the whole run
    factor = SpeedDrift(steady, [0, 0, 7]).factor(0.0)  # the worker's machine: seed, index, 7
    assert abs(factor - 1.0) > 0.05  # the test needs a machine off the average
    plain, t, _ = one_worker("slack", clock=True)
    drifting, _, _ = one_worker("slack", clock=True, drift=steady)
    # every step took ``factor`` times as long, so every job ended that much later
    for index in (0, 1):
        assert drifting.done_at[index] == pytest.approx(factor * plain.done_at[index], rel=1e-4)
    # the worker's step clock learnt the machine's speed from its steps: its one-row calibration
    # (speed x shape) is the factor off the undrifting machine's
    plain_clock, drifting_clock = plain.workers[0].clock, drifting.workers[0].clock
    calibration = [c.scale * c.shape_of(1) for c in (plain_clock, drifting_clock)]
    assert calibration[1] == pytest.approx(factor * calibration[0], rel=0.02)
    assert one_worker("slack")[0].workers[0].clock is None  # the fixed cost model's figure
    assert one_worker("fifo", clock=True)[0].workers[0].clock is None  # fifo plans nothing


def test_the_shed_rule_is_the_apis():
    rule = ShedRule(("batch",), late_factor=2.0, max_queue=10)
    batch, interactive = Service("batch", 100.0), Service("interactive", 100.0)
    assert rule.refuses(batch, 30.0, 20.0, queued=3) == ""
    assert rule.refuses(batch, 41.0, 20.0, queued=3) == "deadline"
    assert rule.refuses(batch, 1.0, 20.0, queued=10) == "queue"
    assert rule.refuses(interactive, 1000.0, 20.0, queued=1000) == ""


# ----- the bench --------------------------------------------------------------------------------
def test_the_deadline_bench_runs_every_scheduler_on_the_same_traces_and_writes_its_report(
    tmp_path,
):
    cfg = toy(max_queue=6)
    report = run_deadline_bench(cfg)
    results = report["results"]
    assert report["capacity_rps"] > 0
    assert [(r["trace"], r["load"], r["scheduler"]) for r in results] == [
        (k, load, a) for k in cfg.traces for load in cfg.loads for a in cfg.schedulers
    ]
    for r in results:
        same = [x for x in results if (x["trace"], x["load"]) == (r["trace"], r["load"])]
        assert {x["num_jobs"] for x in same} == {r["num_jobs"]}  # one trace per (process, load)
        # every accepted job completes; refused ones never run
        assert r["completed"] == r["accepted"] == r["num_jobs"] - sum(r["refused"].values())
        for cls in ("interactive", "batch"):
            c = r["classes"][cls]
            assert 0.0 <= c["attainment"] <= 1.0 and 0.0 <= c["shed_rate"] <= 1.0
            assert c["p50_latency_s"] <= c["p95_latency_s"]
            assert 0.0 <= c["avg_wait_s"] <= c["avg_latency_s"]  # waiting is part of latency
            # the router predicted every accepted job's finish at placement: both figures exist
            assert c["finish_vs_predicted_mean_s"] is not None and c["finish_error_p95_s"] >= 0.0
        assert r["classes"]["interactive"]["shed_rate"] == 0.0  # only batch is shed
        if r["scheduler"] != "slack":
            assert r["parks_per_job"] == 0.0
    assert any(sum(r["refused"].values()) for r in results)  # the queue bound of 6 bites
    # rows per step: more load fills the batches fuller (what a step counts: the parking test)
    rows = {(r["trace"], r["load"], r["scheduler"]): r["mean_batch_rows"] for r in results}
    for kind in cfg.traces:
        for arm in cfg.schedulers:
            assert rows[(kind, 0.6, arm)] < rows[(kind, 1.1, arm)]
    assert {(c["trace"], c["load"], c["scheduler"]) for c in report["comparison"]} == {
        (k, load, a) for k in cfg.traces for load in cfg.loads for a in ("edf", "slack")
    }
    text = table(report)
    assert "**poisson**" in text and "**bursty**" in text and "slack vs fifo" in text
    plot = write_outputs(report, tmp_path / "route-deadlines.json")
    assert plot.exists() and plot.stat().st_size > 0
    assert json.loads((tmp_path / "route-deadlines.json").read_text())["config"]["steps"] == 6


def test_targets_take_the_worst_load_in_range():
    def run(kind, load, points, tput, starved=0, wait=10.0):
        return (
            {"trace": kind, "load": load, "scheduler": "slack", "interactive_points": points}
            | {"batch_throughput_ratio": tput},
            {"trace": kind, "load": load, "scheduler": "slack"}
            | {"starved_jobs": starved, "max_wait_s": wait},
        )

    pairs = [
        run("bursty", 0.5, 5.0, 0.5),  # outside 0.8-1.0: ignored
        run("bursty", 0.8, 40.0, 0.99),
        run("bursty", 1.0, 31.0, 0.96, wait=50.0),
        run("poisson", 0.9, 2.0, 1.0, starved=1),
    ]
    report = {"comparison": [c for c, _ in pairs], "results": [r for _, r in pairs]}
    out = targets(report, 300.0)
    assert out["bursty"] == {
        "interactive_points_min": 31.0,
        "interactive_30_points": True,
        "batch_throughput_ratio_min": 0.96,
        "batch_throughput_within_5pct": True,
        "max_wait_s": 50.0,
        "starved_jobs": 0,
        "no_job_starved": True,
    }
    assert not out["poisson"]["interactive_30_points"] and not out["poisson"]["no_job_starved"]


def test_the_command_writes_the_report(tmp_path, capsys):
    from backend.cli import main

    out = tmp_path / "dl.json"
    code = main(
        [
            "bench",
            "route-deadlines",
            "--profiles-dir",
            str(PROFILES),
            "--duration",
            "20",
            "--workers",
            "2",
            "--max-batch",
            "2",
            "--steps",
            "4",
            "--templates",
            "6",
            "--ram-templates",
            "2",
            "--loads",
            "0.9",
            "--traces",
            "bursty",
            "--interactive-target",
            "5",
            "--burst-factor",
            "10",
            "--burst-share",
            "0.05",
            "--json",
            str(out),
        ]
    )
    assert code == 0 and out.exists() and out.with_suffix(".png").exists()
    from PIL import Image

    with Image.open(out.with_suffix(".png")) as plot:  # a panel per class, 5 inches at 110 dpi
        assert plot.width == 2 * 5 * 110
    printed = capsys.readouterr().out
    assert "bursty, loads 0.8-1.0, slack vs fifo" in printed and "wrote" in printed


def test_several_seeds_are_averaged_and_each_kept(tmp_path, capsys):
    from backend.cli import main

    out = tmp_path / "dl.json"
    args = ["bench", "route-deadlines", "--profiles-dir", str(PROFILES), "--duration", "15"]
    args += ["--workers", "2", "--max-batch", "2", "--steps", "4", "--templates", "6"]
    args += ["--loads", "0.8,1.0", "--traces", "poisson", "--interactive-target", "4"]
    assert main([*args, "--seeds", "0,1", "--json", str(out)]) == 0
    mean = json.loads(out.read_text())
    seeds = [json.loads((tmp_path / f"dl-seed{s}.json").read_text()) for s in (0, 1)]
    assert mean["seeds"] == [0, 1] and set(mean["targets_per_seed"]) == {"0", "1"}
    for i, r in enumerate(mean["results"]):
        one, two = seeds[0]["results"][i], seeds[1]["results"][i]
        for cls in ("interactive", "batch"):
            assert r["classes"][cls]["attainment"] == pytest.approx(
                (one["classes"][cls]["attainment"] + two["classes"][cls]["attainment"]) / 2
            )
        assert r["max_batch_wait_s"] == max(one["max_batch_wait_s"], two["max_batch_wait_s"])
        assert r["starved_jobs"] == one["starved_jobs"] + two["starved_jobs"]
        assert r["scheduler"] == one["scheduler"] and r["load"] == one["load"]
    assert "the mean over seeds [0, 1]" in capsys.readouterr().out


def test_serving_interactive_jobs_alone_runs_the_same_interactive_jobs_and_judges_no_target():
    cfg = toy(loads=(1.0,), traces=("bursty",), schedulers=("fifo", "slack"), shed=False)
    both = run_deadline_bench(cfg)
    alone = run_deadline_bench(replace(cfg, serve_classes=("interactive",)))
    for mixed, solo in zip(both["results"], alone["results"]):
        assert solo["classes"]["interactive"]["jobs"] == mixed["classes"]["interactive"]["jobs"]
        assert solo["classes"]["batch"]["jobs"] == solo["classes"]["batch"]["completed"] == 0
        assert solo["num_jobs"] < mixed["num_jobs"]
    assert both["targets"] and alone["targets"] == {}
    # the batch class's cells say it was not served, rather than a vacuous 100%
    assert "| - / - |" in table(alone) and "| - / - |" not in table(both)


@pytest.mark.parametrize("classes", [(), ("bulk",), ("interactive", "vip")])
def test_unknown_classes_to_serve_are_refused(classes):
    with pytest.raises(ValueError, match="classes to serve must be some of interactive, batch"):
        run_deadline_bench(toy(serve_classes=classes))


def test_the_command_says_a_run_of_one_class_judges_no_target(tmp_path, capsys):
    from backend.cli import main

    out = tmp_path / "alone.json"
    args = ["bench", "route-deadlines", "--profiles-dir", str(PROFILES), "--duration", "15"]
    args += ["--workers", "2", "--max-batch", "2", "--steps", "4", "--templates", "6"]
    args += ["--loads", "1.0", "--traces", "bursty", "--interactive-target", "4"]
    assert (
        main([*args, "--serve-classes", "interactive", "--seeds", "0,1", "--json", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert "only interactive served: a reference, no target judged" in printed
    assert "slack vs fifo: interactive attainment" not in printed
    assert json.loads(out.read_text())["config"]["serve_classes"] == ["interactive"]
    from PIL import Image

    # one panel, for the class served: half the width of a plot of both classes (10 inches)
    with Image.open(out.with_suffix(".png")) as plot:
        assert plot.width == 5 * 110

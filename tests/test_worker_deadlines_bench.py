"""`maskserve bench worker-deadlines` end to end at a toy scale: a real engine worker serves the
same short traces under each step scheduler, and the report accounts for every job (not a timing
test: no figure is compared with another)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from backend.bench.route_deadlines import comparison, deadline_trace, services_of
from backend.bench.worker_deadlines import (
    WorkerDeadlineConfig,
    rotated,
    rows_per_step,
    run_worker_deadline_bench,
)
from backend.bench.worker_deadlines_report import (
    forecast_table,
    mean_comparison,
    mean_table,
    table,
    target_lines,
    write_outputs,
)
from backend.config import load_settings


def toy_config(**kw) -> WorkerDeadlineConfig:
    """Two templates, 3 steps, batches of 2, 2 s of arrivals at a given capacity (no saturation
    run)."""
    base = dict(
        steps=3,
        max_batch=2,
        num_templates=2,
        ram_templates=2,
        duration_s=2.0,
        loads=(1.0,),
        probe_jobs=1,
        burst_factor=4.0,
        burst_share=0.1,
        burst_s=0.5,
    )
    return WorkerDeadlineConfig(**(base | kw))


def test_every_scheduler_serves_the_same_trace_and_the_report_accounts_for_every_job(
    models_dir, tmp_path
):
    cfg = toy_config(capacity_rps=3.0, drain_timeout_s=120.0, speed_band=1.3, retries=1)
    # a forecast at every step: a toy job ends well inside the default 0.5 s between forecasts
    settings = load_settings(
        env={"MASKSERVE_FORECAST_REFRESH_S": "0"},
        paths={"data_dir": str(tmp_path), "models_dir": str(models_dir)},
    )
    report = run_worker_deadline_bench(cfg, settings, progress=lambda line: None)

    assert report["capacity_rps"] == 3.0 and report["calibration"]["service_s"] > 0
    assert report["device"].endswith("1 torch thread") and report["config"]["torch_threads"] == 1
    # the speed gauge's reference, over steps of every row count up to the batch
    cal = report["calibration"]
    assert set(cal["step_ratios"]) == {"1", "2"} and min(cal["step_ratios"].values()) > 0
    assert min(cal["step_ratios"].values()) <= cal["step_ratio"] <= max(cal["step_ratios"].values())
    t = report["targets_s"]
    service = report["calibration"]["service_s"]
    assert (t["interactive"], t["batch"]) == (5.0 * service, 100.0 * service)
    runs = {(r["trace"], r["scheduler"]): r for r in report["results"]}
    assert set(runs) == {(k, a) for k in ("poisson", "bursty") for a in ("fifo", "edf", "slack")}
    workload = cfg.workload(t)
    for kind in ("poisson", "bursty"):
        trace = deadline_trace(workload, kind, 3.0, cfg.seed)
        classes = [s.service_class for s in services_of(workload, trace)]
        for arm in ("fifo", "edf", "slack"):
            r = runs[(kind, arm)]
            # the same trace for every scheduler, every job of it accounted for
            assert r["num_jobs"] == len(trace) == r["completed"] == r["accepted"] > 0
            for cls, c in r["classes"].items():
                assert c["jobs"] == c["accepted"] == c["completed"] == classes.count(cls)
                assert 0.0 <= c["attainment"] <= 1.0 and c["shed_rate"] == 0.0
                assert c["finish_vs_predicted_mean_s"] is None  # no router predicted them
                if c["completed"]:
                    assert 0 < c["p50_latency_s"] <= c["p95_latency_s"]
                    # waiting (queued, parked) is part of a job's latency, never more than it
                    assert 0 <= c["avg_wait_s"] < c["avg_latency_s"]
            # every parked row resumed (every job finished)
            assert r["parks_per_job"] >= 0 and r["resumes_per_job"] == r["parks_per_job"]
            assert r["max_batch_wait_s"] >= 0 and r["mean_step_ms"] > 0
            # the machine's speed against the calibration; a run out of the band ran again once
            attempts = r["attempt_slowdowns"]
            assert r["slowdown"] in attempts and min(attempts) > 0 and len(attempts) in (1, 2)
            assert r["in_band"] == (1 / 1.3 <= r["slowdown"] <= 1.3)
            if len(attempts) == 2:
                assert not 1 / 1.3 <= attempts[0] <= 1.3
            for cls, sizes in r["rows_per_step"].items():  # mean batch of its jobs: 1..max_batch
                assert max(sizes.values()) >= 1 and classes.count(cls) > 0
                assert all(v == 0.0 or 1.0 <= v <= cfg.max_batch for v in sizes.values())
            # the finish each job was told against its real one: every job heard one by its
            # first step, the forecast being made at every step
            assert set(r["forecast"]) == set(r["classes"])
            for cls, by_horizon in r["forecast"].items():
                assert set(by_horizon) == {"first", "start"}
                for f in by_horizon.values():
                    assert f["jobs"] == r["classes"][cls]["completed"]
                    assert f["median_abs_s"] <= f["p90_abs_s"] and 0 <= f["late_share"] <= 1
                    assert f["median_rel"] >= 0
            if arm != "slack":  # only the full scheduler parks rows, or keeps slots free
                assert r["parks_per_job"] == 0 and r["deferrals_per_job"] == 0
    # every other arm against fifo, per process and load; the issue's targets per process
    assert {(c["trace"], c["scheduler"]) for c in report["comparison"]} == {
        (k, a) for k in ("poisson", "bursty") for a in ("edf", "slack")
    }
    assert set(report["targets"]) == set(report["targets_worst_repeat"]) == {"poisson", "bursty"}
    # one repeat: its mean is the one run's figures
    assert report["comparison_mean"] == mean_comparison(report["comparison"])
    for c in report["comparison_mean"]:
        assert c["repeats"] == 1
        assert c["interactive_points"] == c["interactive_points_lowest"]
    assert report["targets"] == report["targets_worst_repeat"]
    assert report["speed_adjusted"] == []  # two pairs per arm: too few for a line
    assert len(table(report).splitlines()) == 2 + 6 and len(target_lines(report)) == 4
    assert len(mean_table(report).splitlines()) == 2 + 4
    told_rows = sum(len(r["forecast"]) for r in report["results"])
    assert len(forecast_table(report).splitlines()) == 2 + told_rows

    plot = write_outputs(report, tmp_path / "worker-deadlines.json")
    assert json.loads((tmp_path / "worker-deadlines.json").read_text())["results"]
    assert plot.exists() and plot.stat().st_size > 0
    # the intermediates (pre-processed requests, per-job masks, final latents) are gone
    left = {p.parent.name for p in (tmp_path / "blobs").rglob("*") if p.is_file()}
    assert not left & {"prepared", "latents"}


def test_serving_the_interactive_jobs_alone_runs_exactly_those_of_the_trace(models_dir, tmp_path):
    cfg = toy_config(
        schedulers=("fifo", "slack"),
        traces=("bursty",),
        serve_classes=("interactive",),
        capacity_rps=4.0,
        speed_band=0.0,
    )
    settings = load_settings(
        env={}, paths={"data_dir": str(tmp_path), "models_dir": str(models_dir)}
    )
    lines: list[str] = []
    report = run_worker_deadline_bench(cfg, settings, progress=lines.append)
    workload = cfg.workload(report["targets_s"])
    trace = deadline_trace(workload, "bursty", 4.0, cfg.seed)
    interactive = sum(s.service_class == "interactive" for s in services_of(workload, trace))
    assert 0 < interactive < len(trace)
    for r in report["results"]:
        assert r["num_jobs"] == r["completed"] == interactive
        assert r["classes"]["interactive"]["completed"] == interactive
        assert r["classes"]["batch"]["jobs"] == 0
    assert report["targets"] == report["targets_worst_repeat"] == {}
    assert target_lines(report) == []
    # a class no job of which was served has no attainment to show (not a vacuous 100%)
    runs = [line for line in lines if "attainment interactive" in line]
    assert len(runs) == len(report["results"])
    assert all("batch -," in line for line in runs)


@pytest.mark.parametrize(
    "arm, sizing, quantile, refresh_s, parks",
    [
        ("slack", (True, True), 0.0, 0.5, 5),
        ("slack-noshrink", (True, False), 0.0, 0.5, 5),
        ("slack-nosize", (False, False), 0.0, 0.5, 5),
        ("slack-margin", (True, True), 0.9, 0.5, 5),
        ("slack-everystep", (True, True), 0.0, 0.0, 5),
        ("slack-parks2", (True, True), 0.0, 0.5, 2),
        ("slack-parks8", (True, True), 0.0, 0.5, 8),
    ],
)
def test_the_ablation_arms_are_the_slack_scheduler_without_one_part(
    tmp_path, arm, sizing, quantile, refresh_s, parks
):
    from backend.bench.worker_deadlines_arms import arm_deadlines, arm_plan

    settings = load_settings(
        env={}, paths={"data_dir": str(tmp_path)}, deadlines={"forecast_refresh_s": 0.5}
    )
    cfg = WorkerDeadlineConfig(schedulers=("fifo", arm), max_parks_per_round=5)
    deadlines = arm_deadlines(settings, cfg, arm, 10.0)
    plan, clock, join = arm_plan(settings, cfg, deadlines)
    assert (plan.scheduler, plan.size_batches, plan.shrink_batches) == ("slack", *sizing)
    assert plan.max_wait_s == 10.0 and plan.round_steps == cfg.round_steps
    assert clock.plan_quantile == quantile
    assert join is None  # the serving worker's: rows join while slots are free by default
    assert deadlines.forecast_refresh_s == refresh_s
    assert plan.max_parks_per_round == parks  # the bench's churn bound (5), but for parks2/8


def test_the_nokeep_arm_lets_the_next_ready_row_take_a_slot_kept_for_a_read(tmp_path):
    from backend.bench.worker_deadlines_arms import arm_deadlines, arm_plan

    settings = load_settings(env={}, paths={"data_dir": str(tmp_path)})
    cfg = WorkerDeadlineConfig(schedulers=("slack", "slack-nokeep"))
    for arm, keep in (("slack", True), ("slack-nokeep", False)):
        plan, _, _ = arm_plan(settings, cfg, arm_deadlines(settings, cfg, arm, 10.0))
        assert plan.scheduler == "slack" and plan.keep_slot_while_reading is keep


def _parsed(*argv: str):
    import argparse

    from backend.bench.worker_deadlines_cli import add_worker_deadlines_parser

    parser = argparse.ArgumentParser()
    add_worker_deadlines_parser(parser.add_subparsers())
    return parser.parse_args(["worker-deadlines", *argv])


def test_the_command_takes_rounds_churn_and_speed_band_else_the_deadline_settings(tmp_path):
    from backend.bench.worker_deadlines_cli import config_of

    settings = load_settings(
        env={"MASKSERVE_ROUND_STEPS": "3", "MASKSERVE_MAX_PARKS_PER_ROUND": "1"},
        paths={"data_dir": str(tmp_path)},
    )
    cfg = config_of(_parsed(), settings)
    assert (cfg.round_steps, cfg.max_parks_per_round) == (3, 1)
    assert (cfg.speed_band, cfg.retries) == (1.3, 2)
    given = "--round-steps 4 --max-parks-per-round 0 --speed-band 0 --retries 5".split()
    cfg = config_of(_parsed(*given), settings)
    assert (cfg.round_steps, cfg.max_parks_per_round, cfg.speed_band, cfg.retries) == (4, 0, 0, 5)
    with pytest.raises(ValueError, match="retries must be >= 0"):
        config_of(_parsed("--retries", "-1"), settings)
    # the worker's torch threads: one unless told (the stack's worker takes every core)
    assert config_of(_parsed(), settings).torch_threads == 1
    assert config_of(_parsed("--threads", "2"), settings).torch_threads == 2
    with pytest.raises(ValueError, match="torch_threads must be at least 1, got 0"):
        config_of(_parsed("--threads", "0"), settings)
    assert config_of(_parsed(), settings).serve_classes == ("interactive", "batch")
    alone = config_of(_parsed("--serve-classes", "interactive"), settings)
    assert alone.serve_classes == ("interactive",)
    with pytest.raises(ValueError, match="classes to serve must be some of interactive, batch"):
        config_of(_parsed("--serve-classes", "interactive,bulk"), settings)


def test_each_repeat_rotates_the_arms_so_each_runs_first_once():
    arms = ("fifo", "edf", "slack")
    orders = [rotated(arms, repeat) for repeat in range(4)]
    assert orders[:3] == [arms, ("edf", "slack", "fifo"), ("slack", "fifo", "edf")]
    assert orders[3] == arms and {order[0] for order in orders[:3]} == set(arms)
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        WorkerDeadlineConfig(repeats=0)


def _run(scheduler: str, repeat: int, interactive: float, batch_rps: float) -> dict:
    classes = {
        "interactive": {"attainment": interactive, "p95_latency_s": 1.0, "throughput_rps": 1.0},
        "batch": {"attainment": 1.0, "p95_latency_s": 2.0, "throughput_rps": batch_rps},
    }
    return {"trace": "bursty", "load": 0.9, "scheduler": scheduler, "repeat": repeat} | {
        "classes": classes
    }


def test_each_arm_is_compared_with_fifo_of_its_own_repeat_and_the_pairs_are_averaged():
    # fifo's attainment drifts between repeats (0.5, then 0.2); slack is 0.3 above it each time
    results = [
        _run("fifo", 0, 0.5, 1.0),
        _run("slack", 0, 0.8, 0.9),
        _run("slack", 1, 0.5, 1.0),
        _run("fifo", 1, 0.2, 0.8),
    ]
    pairs = comparison({"results": results})
    assert sorted((c["repeat"], round(c["interactive_points"], 6)) for c in pairs) == [
        (0, 30.0),
        (1, 30.0),
    ]
    (mean,) = mean_comparison(pairs)
    assert mean["repeats"] == 2 and mean["interactive_points"] == pytest.approx(30.0)
    assert mean["batch_throughput_ratio"] == pytest.approx((0.9 + 1.25) / 2)
    assert mean["interactive_points_lowest"] == pytest.approx(mean["interactive_points_highest"])


def test_the_plot_takes_repeats_whose_mean_differs_from_equal_values_in_the_last_bit(tmp_path):
    # 19 of 75 jobs on time in three runs (as measured once): the mean of the three equal
    # percentages is below each of them in the last bit
    runs = [_run(arm, repeat, 19 / 75, 1.0) for repeat in range(3) for arm in ("fifo", "slack")]
    report = {
        "results": runs,
        "targets_s": {"interactive": 1.0, "batch": 20.0},
        "config": {"model_id": "tiny-sd2-inpaint", "size": 128, "max_batch": 8},
        "capacity_rps": 5.0,
        "device": "cpu",
    }
    plot = write_outputs(report, tmp_path / "repeats.json")
    assert plot.exists() and plot.stat().st_size > 0


def test_rows_per_step_averages_each_job_then_the_jobs_that_met_or_missed():
    services = [
        SimpleNamespace(service_class="interactive", deadline=1.0),
        SimpleNamespace(service_class="interactive", deadline=1.0),
        SimpleNamespace(service_class="interactive", deadline=1.0),
        SimpleNamespace(service_class="batch", deadline=10.0),
    ]
    sizes = {0: [1, 3], 1: [4, 4, 4, 4], 2: [6], 3: [2]}
    done_at = {0: 0.5, 1: 1.5, 2: 2.0, 3: 9.0}
    assert rows_per_step(sizes, done_at, services) == {
        "batch": {"met": 2.0, "missed": 0.0},
        "interactive": {"met": 2.0, "missed": 5.0},  # jobs 1 and 2: (4 + 6) / 2
    }


def test_the_speed_adjusted_line_finds_the_points_at_equal_machine_speed():
    import math

    from backend.bench.worker_deadlines_report import speed_adjusted, speed_lines

    # slack's points over fifo = 10 - 100 x log(its slowdown / fifo's), exactly, over 4 repeats
    results = []
    for repeat, (mine, fifo) in enumerate([(1.0, 1.2), (1.3, 1.0), (1.1, 1.1), (1.5, 1.2)]):
        points = 10.0 - 100.0 * math.log(mine / fifo)
        results.append(_run("fifo", repeat, 0.5, 1.0) | {"slowdown": fifo})
        results.append(_run("slack", repeat, 0.5 + points / 100, 1.0) | {"slowdown": mine})
    # edf ran at fifo's speed in every repeat: no line can be drawn through one speed ratio
    fifo_speeds = [1.2, 1.0, 1.1, 1.2]
    results += [_run("edf", r, 0.6, 1.0) | {"slowdown": f} for r, f in enumerate(fifo_speeds)]
    (line,) = speed_adjusted({"results": results})
    assert line["scheduler"] == "slack" and line["pairs"] == 4
    assert line["intercept"] == pytest.approx(10.0) and line["slope"] == pytest.approx(-100.0)
    assert line["intercept_se"] == pytest.approx(0.0, abs=1e-6)
    assert line["correlation"] == pytest.approx(-1.0)
    # as run, slack's mean is off the intercept: its runs were slower than fifo's on the whole
    assert line["mean_points"] < line["intercept"]
    (text,) = speed_lines({"speed_adjusted": [line]})
    assert "+10.0" in text and "4 pairs" in text

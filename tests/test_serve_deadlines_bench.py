"""`maskserve bench serve-deadlines`: the scenario's pure parts on made-up records (fast: the burst
schedule, attainment and margins from job records, the comparison, the report's table and plot),
and the whole benchmark on the tiny model at a tiny scale (slow): both schedulers' stacks started,
every job finished, the report complete. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from backend.bench.serve_deadlines import (
    ArmRun,
    BurstConfig,
    LevelledClient,
    arm_env,
    build_report,
    compare,
    count_parks,
    metric_values,
    outcomes,
    plan_burst,
    plot,
    summarize,
    summary_text,
    worker_during,
    worker_totals,
)
from backend.bench.serve_stats import ServeRecord

NOW = 1_700_000_000.0


def test_the_burst_comes_at_once_and_the_interactive_jobs_inside_it():
    cfg = BurstConfig(batch_jobs=5, interactive_jobs=3, interactive_x=3.0, start_x=1.0, every_x=2.0)
    plan = plan_burst(cfg, single_s=0.5)
    assert [p.service_class for p in plan] == ["batch"] * 5 + ["interactive"] * 3
    assert [p.request.index for p in plan] == list(range(8))
    assert [p.request.arrival_s for p in plan] == [0.0] * 5 + [0.5, 1.5, 2.5]
    assert [p.deadline_s for p in plan] == [600.0] * 5 + [1.5] * 3
    assert len({p.request.seed for p in plan}) == 8  # the client finds a job's level by its seed
    # the same requests whatever the single-job latency: only arrivals and deadlines move
    other = plan_burst(cfg, single_s=2.0)
    assert [(p.request.template, p.request.seed) for p in other] == [
        (p.request.template, p.request.seed) for p in plan
    ]
    fixed = plan_burst(BurstConfig(batch_jobs=5, interactive_jobs=3, interactive_deadline_s=4.0), 9)
    assert {p.deadline_s for p in fixed if p.service_class == "interactive"} == {4.0}


def test_bad_arguments_exit_2_naming_what_to_fix(capsys):
    from backend.cli import main

    for argv, named in (
        (["--batch-jobs", "0"], "--batch-jobs"),
        (["--interactive-x", "0"], "--interactive-x"),
        (["--schedulers", "fifo,lifo"], "--schedulers (lifo; use fifo, edf, slack, fifo-cpu"),
        (["--schedulers", "slack-cpu-fifo"], "--schedulers (slack-cpu-fifo; use"),
        (["--schedulers", ","], "--schedulers (none;"),
    ):
        assert main(["bench", "serve-deadlines", *argv]) == 2, argv
        assert named in capsys.readouterr().err


def test_an_arm_is_a_step_scheduler_and_at_most_one_variant_of_the_stack():
    assert arm_env("slack") == {
        "MASKSERVE_BATCHING": "continuous",
        "MASKSERVE_STEP_SCHEDULER": "slack",
    }
    assert arm_env("edf-cpu-arrival") == {
        "MASKSERVE_BATCHING": "continuous",
        "MASKSERVE_CPU_SERVICE_ORDER": "false",
        "MASKSERVE_STEP_SCHEDULER": "edf",
    }
    assert arm_env("slack-no-tail") == {
        "MASKSERVE_BATCHING": "continuous",
        "MASKSERVE_FINISH_TAIL": "false",
        "MASKSERVE_STEP_SCHEDULER": "slack",
    }
    assert arm_env("slack-margin")["MASKSERVE_PLAN_QUANTILE"] == "0.9"
    assert arm_env("slack-no-keep")["MASKSERVE_KEEP_SLOT_WHILE_READING"] == "false"
    assert (
        BurstConfig(schedulers=("slack", "slack-cpu-arrival")).schedulers[1] == "slack-cpu-arrival"
    )


def _record(index: int, status="done", latency=None, submitted=0.0, message="") -> ServeRecord:
    record = ServeRecord("slack", "burst", index, 0.0, 0, 0.1, "blob", 100 + index)
    record.timings = {"denoise_s": (latency or 0.0) / 2, "total_s": latency or 0.0}
    record.status, record.message, record.submitted_s = status, message, submitted
    if status != "refused":
        record.job_id = f"job{index}"
    if latency is not None:
        record.latency_s, record.finished_s = latency, submitted + latency
    return record


def _job(created: float, deadline_s: float, total: float, late=False) -> dict:
    done_at = created + total
    deadline = created + deadline_s
    return {"deadline": deadline, "done_at": done_at, "met_deadline": done_at <= deadline,
            "late": late}  # fmt: skip


def _scenario():
    """Two batch jobs (one refused by admission control), two interactive ones (one met by 0.5 s,
    one late by 1 s after a park)."""
    cfg = BurstConfig(batch_jobs=2, interactive_jobs=2, interactive_x=2.0, every_x=1.0)
    plan = plan_burst(cfg, single_s=1.0)  # interactive at 1 s and 2 s, deadline 2 s
    records = [
        _record(0, latency=3.0),
        _record(1, status="refused", message="HTTP 429: predicted latency 900 s"),
        _record(2, latency=1.5, submitted=1.0),
        _record(3, latency=3.0, submitted=2.0),
    ]
    jobs = {
        "job0": _job(NOW, 600.0, 3.0),
        "job2": _job(NOW + 1, 2.0, 1.5),
        "job3": _job(NOW + 2, 2.0, 3.0, late=True),
    }
    return plan, records, jobs, {"job3": 1}


def test_attainment_margins_and_refusals_come_from_the_job_records():
    rows = outcomes(*_scenario())
    assert [r["met"] for r in rows] == [True, False, True, False]
    assert rows[2]["margin_s"] == pytest.approx(0.5) and rows[3]["margin_s"] == pytest.approx(-1.0)
    assert rows[1]["refused_429"] and rows[1]["latency_s"] is None and rows[1]["margin_s"] is None
    figures = summarize(rows)
    inter, batch = figures["interactive"], figures["batch"]
    assert figures["all"]["jobs"] == 4 and figures["all"]["makespan_s"] == 5.0
    assert "margin_mean_s" not in figures["all"]
    assert (inter["jobs"], inter["done"], inter["met"], inter["attainment"]) == (2, 2, 1, 0.5)
    assert inter["margin_min_s"] == pytest.approx(-1.0)
    assert inter["margin_mean_s"] == pytest.approx(-0.25)
    assert inter["mean_s"] == pytest.approx(2.25) and inter["p95_s"] == 3.0
    assert (inter["parked_jobs"], inter["parks"], inter["accepted_late"]) == (1, 1, 1)
    assert (batch["refused_429"], batch["met"], batch["attainment"]) == (1, 1, 0.5)
    assert batch["makespan_s"] == 3.0 and batch["throughput_rps"] == pytest.approx(1 / 3)
    assert inter["stages_s"]["denoise_s"] == pytest.approx(1.125)  # half of 1.5 s and 3 s


def test_the_margin_falls_back_to_the_deadline_asked_without_the_record_times():
    plan, records, _, _ = _scenario()
    rows = outcomes(plan, records, {"job2": {"met_deadline": True}}, {})
    assert rows[2]["margin_s"] == pytest.approx(0.5) and rows[2]["met"]
    assert not rows[3]["met"] and rows[3]["margin_s"] == pytest.approx(-1.0)


def test_each_scheduler_is_compared_with_fifo():
    fifo = {"interactive": {"attainment": 0.0, "margin_mean_s": -3.0},
            "batch": {"throughput_rps": 2.0, "makespan_s": 10.0}}  # fmt: skip
    slack = {"interactive": {"attainment": 1.0, "margin_mean_s": 0.5},
             "batch": {"throughput_rps": 1.9, "makespan_s": 10.5}}  # fmt: skip
    out = compare({"fifo": fifo, "slack": slack})
    assert set(out) == {"slack"}
    assert out["slack"]["interactive_attainment_points"] == 100.0
    assert out["slack"]["interactive_margin_mean_gain_s"] == 3.5
    assert out["slack"]["batch_throughput_ratio"] == pytest.approx(0.95)
    assert out["slack"]["batch_makespan_ratio"] == pytest.approx(1.05)
    assert compare({"slack": slack}) == {}


def test_parks_are_counted_from_events_and_the_worker_figures_from_its_metrics():
    events = [
        {"status": "running", "message": ""},
        {"status": "running", "message": "parked at step 5: jobs with tighter deadlines run first"},
        {"status": "running", "message": "resumed at step 5"},
    ]
    assert count_parks(events) == 1

    def exposition(parks, steps, step_s, rows, tail=0.0, held=0.0):
        return (
            f"# TYPE maskserve_worker_finish_tail_s gauge\nmaskserve_worker_finish_tail_s {tail}\n"
            "# TYPE maskserve_worker_held_row_schedules counter\n"
            f"maskserve_worker_held_row_schedules_total {held}\n"
            f"# TYPE maskserve_worker_parks counter\nmaskserve_worker_parks_total {parks}\n"
            f"# TYPE maskserve_worker_steps counter\nmaskserve_worker_steps_total {steps}\n"
            f"# TYPE maskserve_worker_mean_step_s gauge\nmaskserve_worker_mean_step_s {step_s}\n"
            f"# TYPE maskserve_worker_mean_batch_rows gauge\n"
            f"maskserve_worker_mean_batch_rows {rows}\n"
            '# TYPE maskserve_worker_jobs counter\nmaskserve_worker_jobs_total{key="done"} 4.0\n'
        )

    before = metric_values(exposition(1.0, 10.0, 0.1, 1.0))
    assert before == {
        "parks": 1.0,
        "held": 0.0,
        "steps": 10.0,
        "mean_step_s": 0.1,
        "mean_batch_rows": 1.0,
        "finish_tail_s": 0.0,
    }
    # 10 steps of 1 row at 0.1 s, then 30 of 5 rows at 0.3 s: lifetime means 0.25 s and 4 rows
    after = metric_values(exposition(4.0, 40.0, 0.25, 4.0, tail=0.04, held=6.0))
    during = worker_during(worker_totals(before), worker_totals(after))
    assert during["parks"] == 3.0 and during["resumes"] == 0.0 and during["steps"] == 30.0
    assert during["held"] == 6.0
    assert during["mean_step_s"] == pytest.approx(0.3)
    assert during["mean_batch_rows"] == pytest.approx(5.0)
    assert during["finish_tail_s"] == 0.04  # a gauge: its latest reading, not a difference
    assert worker_during({}, {})["mean_step_s"] is None


def test_the_client_submits_each_request_with_its_service_level():
    plan, *_ = _scenario()
    sent = []

    class Fake:
        def submit(self, mask, prompt="", **params):
            sent.append(params)
            return {"job_id": "x"}

        def jobs(self, limit=50):
            return [limit]

    client = LevelledClient(Fake(), plan)
    client.submit(b"png", "a cat", seed=plan[2].request.seed, steps=2)
    client.submit(b"png", "a cat", seed=plan[0].request.seed, steps=2)
    assert sent[0] == {"service_class": "interactive", "deadline_s": 2.0,
                       "seed": plan[2].request.seed, "steps": 2}  # fmt: skip
    assert sent[1]["service_class"] == "batch" and sent[1]["deadline_s"] == 600.0
    assert client.jobs(limit=4) == [4]  # everything else goes to the client unchanged


def test_the_report_prints_every_interactive_job_and_plots_them(tmp_path):
    plan, records, jobs, parks = _scenario()
    cfg = BurstConfig(batch_jobs=2, interactive_jobs=2, interactive_x=2.0, every_x=1.0)
    runs = []
    for name in ("fifo", "slack"):
        run = ArmRun(name, single_s=1.0, records=records, jobs=jobs, parks=parks)
        run.counters = {"before": {"parks": 1.0, "steps": 5.0, "rows": 5.0},
                        "after": {"parks": 2.0, "steps": 15.0, "rows": 45.0}}  # fmt: skip
        runs.append(run)
    report = build_report(cfg, plan, runs, "CPU only, 2 CPU cores, x86_64", 12.0)
    worker = report["arms"]["slack"]["worker"]
    assert worker["parks"] == 1.0 and worker["steps"] == 10.0 and worker["mean_batch_rows"] == 4.0
    assert report["comparison"]["slack"]["interactive_attainment_points"] == 0.0
    assert [r["service_class"] for r in report["schedule"]["requests"]] == [
        "batch", "batch", "interactive", "interactive"
    ]  # fmt: skip
    text = summary_text(report)
    assert "#2" in text and "#3" in text and "(+0.50)" in text and "(-1.00)" in text
    assert "slack vs fifo" in text
    assert json.loads(json.dumps(report))["arms"]["fifo"]["summary"]["batch"]["refused_429"] == 1
    plot(report, tmp_path / "serve-deadlines.png")
    assert (tmp_path / "serve-deadlines.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.model
def test_bench_serve_deadlines_end_to_end_every_job_done(models_dir, tmp_path, monkeypatch, capsys):
    from backend.cli import main

    monkeypatch.setenv("MASKSERVE_MODELS_DIR", str(models_dir))
    for name in ("MASKSERVE_REDIS_URL", "REDIS_URL"):  # each stack starts its own Redis
        monkeypatch.delenv(name, raising=False)
    report_path = tmp_path / "out" / "serve-deadlines.json"
    status = main(
        [
            "bench", "serve-deadlines", "--steps", "2", "--size", "64", "--templates", "2",
            "--batch-jobs", "2", "--interactive-jobs", "1", "--warmup", "1", "--single", "1",
            "--interactive-deadline-s", "60", "--no-progress", "--json", str(report_path),
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed
    report = json.loads(report_path.read_text())
    assert report_path.with_suffix(".png").stat().st_size > 0
    assert set(report["arms"]) == {"fifo", "slack"} and set(report["comparison"]) == {"slack"}
    for name, arm in report["arms"].items():
        assert arm["env"]["MASKSERVE_STEP_SCHEDULER"] == name and arm["single_s"] > 0
        assert set(arm["summary"]) == {"interactive", "batch", "all"}
        assert all(job["status"] == "done" and job["latency_s"] > 0 for job in arm["jobs"])
        assert [job["service_class"] for job in arm["jobs"]] == ["batch", "batch", "interactive"]
        assert arm["worker"]["steps"] > 0 and arm["worker"]["mean_batch_rows"] >= 1
        assert arm["summary"]["batch"]["refused_429"] == 0
    # the same requests went to both stacks
    seeds = {name: [r["seed"] for r in arm["records"]] for name, arm in report["arms"].items()}
    assert seeds["fifo"] == seeds["slack"]
    assert "slack vs fifo" in printed

"""`maskserve bench adapters`: the figures on made-up results, the CLI's refusals, the request mix,
and the whole bench end to end on the tiny model (every arm finishes every request; no timing is
asserted)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from backend.bench.adapter_bench import ArmResult, request_adapters
from backend.bench.adapter_bench_cli import add_adapters_parser
from backend.bench.adapter_catalog import CatalogAdapter
from backend.bench.adapter_report import headline, summary_text
from backend.bench.trace import poisson_trace
from backend.cli import main


def result(arm, rps, mean, thru, trace="poisson", rows=0, blocked=0, hits=None) -> ArmResult:
    return ArmResult(
        arm=arm,
        trace=trace,
        rps=rps,
        num_jobs=10,
        avg_latency_s=mean,
        p95_latency_s=2 * mean,
        throughput_rps=thru,
        mean_batch_rows=1.0,
        rows_with_adapters=rows,
        rows_blocked=blocked,
        hits=hits or {},
    )


def test_headline_reads_the_reference_points():
    results = [
        result("baseline", 0.1, 10.0, 0.1),
        result("baseline", 0.2, 100.0, 0.15),
        result("baseline", 0.4, 400.0, 0.15),
        result("maskserve", 0.1, 2.0, 0.1, rows=10, blocked=1),
        result("maskserve", 0.2, 2.5, 0.2, rows=10, blocked=0),
        result("maskserve", 0.4, 4.0, 0.38, rows=10, blocked=2),
        result("base-model", 0.4, 3.0, 0.4),
        result("one-set", 0.4, 20.0, 0.3),
        result("join-if-pays", 0.2, 3.0, 0.2),
        result("join-if-pays", 0.4, 2.0, 0.38),
        result("maskserve", 1.0, 9.0, 0.5, trace="bursty"),  # not a Poisson run: ignored
    ]
    head = headline(results)
    # capacity 0.15/s: the highest rate not above it is 0.1
    assert head["saturation_rps"] == 0.1 and head["latency_x"] == pytest.approx(5.0)
    assert head["past_rps"] == 0.2 and head["latency_x_past"] == pytest.approx(40.0)
    assert head["mixed_throughput_share"] == pytest.approx(0.38 / 0.4)
    # 80% of 0.38 = 0.304: the closest rate is 0.4 (0.096 away) over 0.2 (0.104)
    assert head["load80_rps"] == 0.4 and head["blocked_share"] == pytest.approx(0.2)
    assert head["one_set_latency_x"] == pytest.approx(5.0)
    assert head["join_if_pays_latency_x"] == pytest.approx(4.0 / 2.0)  # the highest common rate
    text = summary_text({"results": [r.__dict__ for r in results], "headline": head})
    assert "latency_x: 5.000 (target >= 7.8: missed)" in text
    assert "blocked_share: 0.200 (target <= 0.05: missed)" in text
    assert "join_if_pays_latency_x: 2.000" in text


def test_a_calibrated_capacity_sets_the_saturation_rate():
    capacity = 0.15
    results = [
        result("baseline", 0.8 * capacity, 10.0, 0.11),
        result("baseline", capacity, 30.0, 0.14),  # a finite trace at load 1 falls short of it
        result("baseline", 1.2 * capacity, 90.0, 0.14),
        result("maskserve", 0.8 * capacity, 2.0, 0.12),
        result("maskserve", capacity, 3.0, 0.15),
        result("maskserve", 1.2 * capacity, 4.0, 0.18),
    ]
    # measured throughputs alone would put saturation at 0.8 x capacity (0.14 < 0.15)
    assert headline(results)["saturation_rps"] == pytest.approx(0.8 * capacity)
    head = headline(results, baseline_capacity=capacity)
    assert head["saturation_rps"] == capacity and head["latency_x"] == pytest.approx(10.0)
    assert head["past_rps"] == pytest.approx(1.2 * capacity)
    assert head["latency_x_past"] == pytest.approx(22.5)


def test_headline_without_some_arms_says_only_what_it_can():
    head = headline([result("maskserve", 0.1, 1.0, 0.1, rows=4, blocked=0)])
    assert set(head) == {"load80_rps", "blocked_share"} and head["blocked_share"] == 0.0


def test_requests_carry_zero_to_three_distinct_adapters_popular_first():
    catalog = [CatalogAdapter(f"id{i}", f"{i:064x}", 1000 + i, 8, None) for i in range(50)]
    trace = poisson_trace(5.0, 100.0, 4, 0.1, seed=1)
    uses = request_adapters(trace, catalog, 1.0, seed=1)
    counts = [len(u) for u in uses.values()]
    assert set(counts) <= {0, 1, 2, 3} and 0.9 < sum(c > 0 for c in counts) / len(counts)
    assert all(len({x.sha256 for x in u}) == len(u) for u in uses.values())
    popular = sum(x.adapter_id == "id0" for u in uses.values() for x in u)
    rare = sum(x.adapter_id == "id49" for u in uses.values() for x in u)
    assert popular > 5 * max(rare, 1) and all(
        0.6 <= x.scale <= 1.0 for u in uses.values() for x in u
    )
    assert request_adapters(trace, catalog, 1.0, seed=1) == uses  # seeded


@pytest.mark.parametrize(
    "argv",
    [
        ["--arms", "baseline,nope"],
        ["--rps", ""],
        ["--rps", "fast"],
        ["--adapters", "0"],
        ["--loads", "0.8,x"],
        ["--loads", "0,1"],
        ["--loads", "1", "--arms", "maskserve,base-model"],  # no baseline to calibrate
        ["--loads", "1", "--calibration-requests", "0"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert main(["bench", "adapters", *argv]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_trace_without_requests_exits_2_saying_what_to_raise(capsys):
    argv = ["bench", "adapters", "--rps", "0.001", "--duration-s", "1", "--burst-rps", "0"]
    assert main(argv) == 2
    assert "has no request in 1 s: raise --duration-s" in capsys.readouterr().err


def test_the_parser_registers_every_option():
    import argparse

    parser = argparse.ArgumentParser()
    add_adapters_parser(parser.add_subparsers())
    args = parser.parse_args(["adapters", "--rps", "0.5,1", "--join-by", "0.1"])
    assert args.rps == "0.5,1" and args.join_by == 0.1


@pytest.mark.model
@pytest.mark.slow
def test_the_bench_runs_every_arm_end_to_end(tmp_path, models_dir, monkeypatch):
    monkeypatch.setenv("MASKSERVE_MODELS_DIR", str(models_dir))
    out = tmp_path / "adapters.json"
    code = main(
        [
            "bench", "adapters", "--model", "tiny-sd2-inpaint", "--size", "64", "--steps", "3",
            "--adapters", "4", "--templates", "2", "--rps", "2", "--burst-rps", "0",
            "--duration-s", "600", "--max-requests", "4", "--loads", "0.5",
            "--calibration-requests", "2", "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert {r["arm"] for r in report["results"]} == {
        "baseline",
        "one-set",
        "maskserve",
        "base-model",
    }
    assert all(r["num_jobs"] == 4 and r["failed"] == 0 for r in report["results"])
    for r in report["results"]:  # each request's latency split by stage, in every arm
        split = r["split"]
        stages = {"preprocess_s", "queue_s", "admit_s", "denoise_s", "postprocess_s"}
        assert set(split) == stages and split["denoise_s"] > 0
        assert min(split.values()) >= 0 and r["mean_step_s"] > 0
        # the baseline runs the ordinary pipeline: it never reads a template cache
        assert 0.0 <= r["cached_share"] <= 1.0 and (r["arm"] != "baseline" or not r["cached_share"])
        assert sum(split.values()) == pytest.approx(r["avg_latency_s"])
        # the mean step per batch size: the baseline serves one request at a time
        sizes = [int(rows) for rows in r["step_s_by_rows"]]
        assert sizes == sorted(sizes) and min(sizes) >= 1 and min(r["step_s_by_rows"].values()) > 0
        assert r["arm"] != "baseline" or sizes == [1]
    ours = next(r for r in report["results"] if r["arm"] == "maskserve")
    assert ours["rows_with_adapters"] >= 1 and sum(ours["hits"].values()) >= 1
    assert ours["cached_share"] > 0  # rows with adapters read the base model's template caches
    assert report["catalog"]["adapters"] == 4 and "latency_x" in report["headline"]
    # the rate is half the baseline's capacity measured on requests arriving at once
    capacity = report["baseline_capacity_rps"]
    assert capacity > 0 and report["results"][0]["rps"] == pytest.approx(0.5 * capacity)
    assert report["config"]["rps"] == [pytest.approx(0.5 * capacity)]  # the rate run
    assert report["headline"]["baseline_capacity_rps"] == capacity
    assert out.with_suffix(".png").exists()
    assert not out.with_suffix(".partial.json").exists()  # kept only while the runs go on
    baseline = next(r for r in report["results"] if r["arm"] == "baseline")
    if baseline["phases"]:  # the baseline's requests with adapters: time split per phase
        assert baseline["phases"]["pipeline_s"] > 0 and baseline["phases"]["adapter_load_s"] > 0


def test_partial_results_are_written_after_each_run(tmp_path, capsys):
    from backend.bench.adapter_bench import ArmResult
    from backend.bench.adapter_report import write_partial

    path = tmp_path / "adapters.partial.json"
    first = ArmResult("baseline", "poisson", 0.5, 4, 2.0, 3.0, 0.4, 1.0)
    write_partial({"model_id": "m"}, [first], path)
    write_partial({"model_id": "m"}, [first, replace(first, arm="maskserve")], path)
    saved = json.loads(path.read_text())
    assert [r["arm"] for r in saved["results"]] == ["baseline", "maskserve"]
    assert "maskserve: mean 2.00 s" in capsys.readouterr().out

"""`maskserve bench serve`: its settings, its quality comparison on made-up results (fast), and the
whole benchmark end to end on the tiny model at a tiny scale (slow): every arm's stack started,
every request finished, the report complete. No timing is asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.bench.serve import (
    COLD,
    TEMPLATE_SEED,
    ArmResult,
    ServeConfig,
    build_traces,
    single_trace,
)
from backend.bench.serve_load import RequestBank, request_mask
from backend.bench.serve_report import quality
from backend.bench.serve_stats import ARMS, ServeRecord
from backend.bench.trace import TraceRequest
from templates_store.samples import sample_template


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rps": ()}, "--rps"),
        ({"rps": (1.0, -2.0)}, "--rps"),
        ({"max_requests": 501}, "--max-requests"),
        ({"slo_factor": 1.0}, "--slo-factor"),
        ({"arms": ("full", "fastest")}, "unknown arms"),
        ({"url": "http://127.0.0.1:9"}, "--api-key"),
    ],
)
def test_bad_settings_are_refused_naming_what_to_fix(changes, named):
    with pytest.raises(ValueError, match=named):
        ServeConfig(**changes)


def test_bad_arguments_exit_2_with_the_reason(capsys):
    from backend.cli import main

    assert main(["bench", "serve", "--arms", "full,turbo"]) == 2
    assert "unknown arms" in capsys.readouterr().err
    assert main(["bench", "serve", "--rps", "0"]) == 2
    assert "--rps" in capsys.readouterr().err


def test_every_arm_replays_the_same_bounded_traces():
    cfg = ServeConfig(rps=(2.0, 0.5), burst_rps=(1.0,), duration_s=50.0, max_requests=40)
    traces = build_traces(cfg)
    assert list(traces) == ["poisson@0.5", "poisson@2", "bursty@1"]  # rates in rising order
    assert all(0 < len(requests) <= 40 for requests in traces.values())
    assert traces == build_traces(cfg)  # seeded: the same requests for every arm and run
    assert len({r.seed for r in traces["poisson@2"]}) == len(traces["poisson@2"])
    assert len(single_trace(cfg)) == cfg.single
    bank = RequestBank(cfg.size)
    first = traces["poisson@2"][0]
    assert bank.mask_png("poisson@2", first) is bank.mask_png("poisson@2", first)


def _result(arm: str, size: int, requests: list[TraceRequest], edit) -> ArmResult:
    """An arm's result whose images are the template with ``edit(image, mask)`` applied."""
    result = ArmResult(arm, quality_trace="poisson@1")
    for request in requests:
        result.records.append(
            ServeRecord(
                arm, "poisson@1", request.index, 0.0, request.template, request.mask_ratio,
                "blob", request.seed, status="done", latency_s=1.0,
            )
        )  # fmt: skip
        image = np.asarray(sample_template(size, size, seed=TEMPLATE_SEED + request.template))
        result.images[request.index] = edit(image.copy(), request_mask(request, size))
    return result


def test_quality_compares_the_same_requests_and_checks_outside_the_mask():
    cfg = ServeConfig(size=32)
    requests = [TraceRequest(i, 0.0, i % 2, 0.2, 100 + i) for i in range(4)]

    def paint(value):
        def edit(image, mask):
            image[mask] = value
            return image

        return edit

    def leak(image, mask):
        image[~mask] = 0  # a result that changed pixels outside its mask
        return image

    results = [
        _result("baseline", 32, requests, paint(200)),
        _result("full", 32, requests, paint(200)),
        _result("nocache", 32, requests, paint(100)),
        _result(COLD, 32, requests, leak),
    ]
    report = quality(results, cfg)
    assert (
        report["baseline"]["outside_identical"] == 4
        and "against_baseline" not in report["baseline"]
    )
    same = report["full"]["against_baseline"]
    assert same["pairs"] == 4 and same["identical"] == 4 and same["ssim_mask_mean"] == 1.0
    other = report["nocache"]["against_baseline"]
    assert other["identical"] == 0 and other["ssim_mask_mean"] < 1.0 and other["ssim_mean"] < 1.0
    assert report["nocache"]["outside_identical"] == 4
    assert report[COLD]["outside_identical"] == 0


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.model
def test_bench_serve_end_to_end_every_arm_every_request_done(
    models_dir, tmp_path, monkeypatch, capsys
):
    from backend.cli import main

    monkeypatch.setenv("MASKSERVE_MODELS_DIR", str(models_dir))
    monkeypatch.delenv("MASKSERVE_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    report_path = tmp_path / "out" / "serve.json"
    status = main(
        [
            "bench", "serve", "--steps", "2", "--size", "64", "--templates", "2",
            "--rps", "2", "--burst-rps", "2", "--duration-s", "2", "--max-requests", "3",
            "--warmup", "1", "--single", "1", "--quality", "2", "--all-rates",
            "--no-progress", "--json", str(report_path),
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed
    report = json.loads(report_path.read_text())
    assert report_path.with_suffix(".png").stat().st_size > 0
    arms = [*ARMS, COLD]
    assert set(report["summary"]) == set(arms) == set(report["single_s"])
    for arm in arms:
        traces = report["summary"][arm]
        assert set(traces) == ({"poisson@2"} if arm == COLD else {"poisson@2", "bursty@2"})
        for figures in traces.values():
            assert figures["done"] == figures["requests"] > 0, (arm, figures)
            assert set(figures["breakdown_s"]) == {
                "queue",
                "pre",
                "wait",
                "denoise",
                "post",
                "other",
            }
            assert figures["p50_s"] <= figures["p95_s"] <= figures["p99_s"]
        assert report["quality"][arm]["outside_identical"] == report["quality"][arm]["results"] > 0
    for arm in ("nocache", "full", COLD):
        assert report["quality"][arm]["against_baseline"]["pairs"] > 0
    records = report["records"]
    assert all(r["status"] == "done" and r["job_id"] for r in records)
    # the same requests went to every arm
    replayed = [r for r in records if r["trace"] == "poisson@2"]
    seeds = {arm: sorted(r["seed"] for r in replayed if r["arm"] == arm) for arm in arms}
    assert len({tuple(s) for s in seeds.values()}) == 1
    assert {r["worker_id"] for r in records} == {"worker-0"}
    assert "sustained rate" in printed and set(report["headline"]) >= {"full", "nocache"}

"""`bench serve`'s figures from per-request records, and its bursty trace (pure, milliseconds)."""

from __future__ import annotations

import numpy as np
import pytest

from backend.bench.serve_stats import (
    ServeRecord,
    breakdown,
    headline,
    meets_slo,
    slo_bound,
    summarize,
    sustained,
)
from backend.bench.trace import mmpp_trace, poisson_trace


def record(arm="full", trace="poisson@1", index=0, latency=1.0, status="done", at=0.0, **timings):
    return ServeRecord(
        arm=arm,
        trace=trace,
        index=index,
        arrival_s=at,
        template=0,
        mask_ratio=0.1,
        mask_kind="blob",
        seed=index,
        status=status,
        submitted_s=at,
        finished_s=at + (latency or 0.0),
        latency_s=latency if status == "done" else None,
        timings=timings,
    )


def group(arm, trace, latencies, gap=1.0):
    return [record(arm, trace, i, lat, at=i * gap) for i, lat in enumerate(latencies)]


def test_summary_figures_of_one_trace():
    records = group("full", "poisson@1", [1.0, 2.0, 3.0, 4.0]) + [
        record("full", "poisson@1", 9, status="failed", at=9.0)
    ]
    figures = summarize(records)["full"]["poisson@1"]
    assert figures["requests"] == 5 and figures["done"] == 4
    assert figures["statuses"] == {"done": 4, "failed": 1}
    assert figures["mean_s"] == pytest.approx(2.5)
    assert (figures["p50_s"], figures["p95_s"], figures["max_s"]) == (2.0, 4.0, 4.0)
    # 4 done between the first submission (0 s) and the last finish (3 + 4 = 7 s)
    assert figures["throughput_rps"] == pytest.approx(4 / 7)


def test_a_trace_with_nothing_done_has_counts_only():
    figures = summarize([record(status="unfinished"), record(index=1, status="refused")])
    assert figures["full"]["poisson@1"] == {
        "requests": 2,
        "done": 0,
        "statuses": {"unfinished": 1, "refused": 1},
    }


def test_breakdown_means_stages_and_what_they_leave():
    done = [
        record(latency=2.0, queue_s=0.1, pre_s=0.2, wait_s=0.3, denoise_s=1.0, post_s=0.2),
        record(index=1, latency=4.0, queue_s=0.3, pre_s=0.2, wait_s=1.7, denoise_s=1.0, post_s=0.4),
    ]
    parts = breakdown(done)
    assert parts == pytest.approx(
        {"queue": 0.2, "pre": 0.2, "wait": 1.0, "denoise": 1.0, "post": 0.3, "other": 0.3}
    )


def test_slo_needs_every_request_done_and_p95_within():
    fine = summarize(group("a", "poisson@1", [1.0] * 20))["a"]["poisson@1"]
    assert meets_slo(fine, 1.0) and not meets_slo(fine, 0.9)
    lost = summarize(
        group("a", "poisson@1", [1.0] * 3) + [record("a", index=7, status="unfinished")]
    )
    assert not meets_slo(lost["a"]["poisson@1"], 100.0)
    assert slo_bound(0.5, 5.0, 0.0) == 2.5 and slo_bound(0.5, 5.0, 3.0) == 3.0
    assert slo_bound(None, 5.0, 0.0) is None


def test_sustained_rate_is_the_highest_poisson_rate_within_the_slo():
    summary = summarize(
        group("a", "poisson@1", [1.0] * 10)
        + group("a", "poisson@2", [1.5] * 10)
        + group("a", "poisson@4", [9.0] * 10)
        + group("a", "bursty@8", [1.0] * 10)  # bursty traces never count as a sustained rate
    )["a"]
    assert sustained(summary, slo_s=2.0) == 2.0
    assert sustained(summary, slo_s=0.5) is None


def test_headline_ratios_at_the_baseline_saturation_rate():
    records = (
        group("baseline", "poisson@1", [2.0] * 10)
        + group("baseline", "poisson@2", [20.0] * 10)  # saturated: P95 20 s > 5 x 2 s
        + group("full", "poisson@1", [0.5] * 10)
        + group("full", "poisson@2", [0.5] * 10)
        + group("full", "poisson@4", [2.0] * 10)  # 4 x its single latency 0.5: within 5x
    )
    head = headline(summarize(records), {"baseline": 10.0, "full": 2.5})
    assert head["saturation_trace"] == "poisson@1"
    assert head["past_saturation_trace"] == "poisson@2"
    assert head["sustained_rps"] == {"baseline": 1.0, "full": 4.0}
    assert head["full"]["latency_gain"] == pytest.approx(4.0)  # 2.0 s / 0.5 s at 1 rps
    assert head["full"]["latency_gain_past"] == pytest.approx(40.0)  # 20 s / 0.5 s at 2 rps
    assert head["full"]["throughput_gain"] == pytest.approx(4.0)
    assert head["full"]["peak_gain"] > 1.0


def test_headline_without_a_sustained_baseline_rate_gives_no_latency_ratio():
    records = group("baseline", "poisson@1", [50.0] * 5) + group("full", "poisson@1", [1.0] * 5)
    head = headline(summarize(records), {"baseline": 10.0, "full": 5.0})
    assert head["saturation_trace"] is None and head["past_saturation_trace"] == "poisson@1"
    assert head["full"]["latency_gain"] is None and head["full"]["throughput_gain"] is None
    assert head["full"]["latency_gain_past"] == pytest.approx(50.0)


def test_mmpp_trace_keeps_its_mean_rate_and_bursts():
    trace = mmpp_trace(2.0, 2000.0, 8, 0.11, seed=4, burst_factor=10.0, burst_share=0.05)
    assert len(trace) / 2000.0 == pytest.approx(2.0, rel=0.1)
    arrivals = np.array([r.arrival_s for r in trace])
    per_second = np.bincount(arrivals.astype(int))
    poisson = np.bincount(
        np.array([r.arrival_s for r in poisson_trace(2.0, 2000.0, 8, 0.11, seed=4)]).astype(int)
    )
    assert per_second.max() >= 2 * poisson.max()  # bursts far above a plain Poisson's peaks
    assert trace == mmpp_trace(2.0, 2000.0, 8, 0.11, seed=4)  # seeded
    assert all(0.02 <= r.mask_ratio <= 0.9 for r in trace)


@pytest.mark.parametrize("share, factor", [(0.2, 10.0), (0.0, 10.0), (0.05, 0.5)])
def test_mmpp_trace_refuses_rates_it_cannot_keep(share, factor):
    with pytest.raises(ValueError):
        mmpp_trace(1.0, 10.0, 2, 0.1, burst_share=share, burst_factor=factor)

"""Forecasts of the deadline scheduler (``BatchScheduler.forecast``, ``deadlines.simulate``):
hand-computed batches, parked rows, and rows that batch sizing holds back, checked against the
scheduler's own run on a fake clock (pure: no torch, no clock)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from backend.worker.batch_rows import Row
from backend.worker.batching import BatchScheduler
from backend.worker.deadlines import RowForecast
from tests.deadline_factory import by_size, constant, make_plan, make_row, sizing_scheduler


def run(
    s: BatchScheduler, step_time: Callable[[Sequence[Row]], float], now: float = 0.0
) -> tuple[dict[str, float], dict[str, float]]:
    """Runs ``s`` to its end, each step taking ``step_time`` of its batch: when each row started
    (running rows: ``now``) and when its last step ended."""
    started = {job_id: now for job_id in s.running}
    ended: dict[str, float] = {}
    while s.running or s.waiting:
        out = s.schedule(now)
        started |= {job_id: now for job_id in out.admitted}
        now += step_time(list(s.running.values()))
        ended |= {r.job_id: now for r in s.update_from_output(list(s.running))}
    return started, ended


# ----- forecast --------------------------------------------------------------------------------
def test_forecast_on_a_hand_computed_batch():
    step_time = by_size(0.5, 0.5)  # 1 s for one row, 1.5 s for two
    calls = []

    def counted(rows):
        calls.append(len(rows))
        return step_time(rows)

    for scheduler in ("fifo", "edf"):
        s = BatchScheduler(2, plan=make_plan(scheduler, step_time=counted))
        s.add(make_row("a", steps=2))
        s.add(make_row("b", steps=4))
        s.schedule(100.0)  # a and b run; nothing stepped yet
        s.add(make_row("c", steps=3, at=100.0))
        s.add(make_row("d", steps=1, deadline=104.0, at=100.5))
        calls.clear()
        f = s.forecast(100.0)
        assert f["a"] == RowForecast(0, 100.0, 103.0)  # 2 steps of 1.5 s
        assert f["b"] == RowForecast(0, 100.0, 106.0)
        if scheduler == "fifo":
            # c joins when a ends (103), d when b ends (106); then one step of two rows
            assert f["c"] == RowForecast(1, 103.0, 107.5)
            assert f["d"] == RowForecast(2, 106.0, 107.5)
            assert len(calls) == 3
        else:
            # d is due first: it joins at 103 and ends at 104.5; c joins then, b ends at 106,
            # and c runs its last step alone (1 s)
            assert f["d"] == RowForecast(1, 103.0, 104.5)
            assert f["c"] == RowForecast(2, 104.5, 108.0)
            assert len(calls) <= 2 + 4
    with pytest.raises(ValueError, match="step time"):
        BatchScheduler(2).forecast(0.0)
    assert BatchScheduler(2).forecast(0.0, constant(1.0)) == {}


def test_forecast_of_a_parked_row_counts_its_remaining_steps_only():
    s = BatchScheduler(1, plan=make_plan(round_steps=1))
    s.add(make_row("a", steps=10, deadline=1000.0))
    s.update_from_output(s.schedule(0.0).admitted)
    s.add(make_row("t", steps=3, deadline=4.0, at=1.0))
    assert s.schedule(1.0).parked == ["a"]
    f = s.forecast(1.0)
    assert f["t"] == RowForecast(0, 1.0, 4.0)
    assert f["a"] == RowForecast(1, 4.0, 13.0)  # 9 steps left


def test_the_forecast_puts_a_row_due_for_the_starvation_bound_first_as_the_run_does():
    # one slot, held by a row that may not leave (recording its template's cache): "old" is due
    # (it would pass its 6 s bound before the slot frees) and goes before the tighter "fresh"
    s = BatchScheduler(1, plan=make_plan(round_steps=1, max_wait_s=6.0))
    recording = make_row("recording", steps=4)
    recording.parkable = False
    s.add(recording)
    s.update_from_output(s.schedule(0.0).admitted)
    s.add(make_row("old", steps=2, at=-4.0))  # no deadline, waited 5 s by the next step
    s.add(make_row("fresh", steps=2, deadline=20.0, at=1.0))
    assert s.schedule(1.0).admitted == [] and s.waiting["old"].due
    forecast = s.forecast(1.0)
    started, ended = run(s, constant(1.0), now=1.0)
    assert (forecast["old"].position, forecast["fresh"].position) == (1, 2)
    for job_id in ("old", "fresh"):
        assert (forecast[job_id].start, forecast[job_id].finish) == (
            started[job_id],
            ended[job_id],
        )
    assert started["old"] == 4.0 < started["fresh"]


@pytest.mark.parametrize("size_batches", [True, False])
def test_the_forecast_holds_back_a_row_that_sizing_keeps_out_as_the_run_does(size_batches):
    # (shrinking, off without sizing here, parks rows: forecasts do not foresee parks)
    s = sizing_scheduler(size_batches, shrink_batches=size_batches)
    s.add(make_row("loose", steps=10, deadline=1000.0))
    forecast = s.forecast(0.0)
    started, ended = run(s, by_size(1.0, 1.0))
    # kept out, "loose" joins at 18 (one step of "tight" left) and ends at 21 + 9 x 2 = 39;
    # without sizing it joins at once: 10 steps of 3 s end both at 30, "tight" late
    expected = (
        {"loose": (18.0, 39.0), "tight": (0.0, 21.0)}
        if size_batches
        else {"loose": (0.0, 30.0), "tight": (0.0, 30.0)}
    )
    for job_id, (start, end) in expected.items():
        assert (started[job_id], ended[job_id]) == pytest.approx((start, end))
        assert (forecast[job_id].start, forecast[job_id].finish) == pytest.approx((start, end))


def test_the_forecast_of_many_held_rows_matches_the_run_and_skips_the_steps_between_joins():
    # a step costs 1/8 s plus 1/16 s per row (exact in binary, so the forecast and the run add up
    # alike). "tight" (50 steps, due at 11) is on time alone (9.375 s) but not beside a second row
    # (12.5 s) until 24 of its steps are done: the loose rows are held back until then, the
    # second until the first ends, the rest until "tight" ends (by its deadline)
    step_time = by_size(0.125, 0.0625)
    calls = []

    def counted(rows):
        calls.append(len(rows))
        return step_time(rows)

    s = BatchScheduler(8, plan=make_plan(step_time=counted, max_parks=0))
    s.add(make_row("tight", steps=50, deadline=11.0))
    s.schedule(0.0)
    for i in range(12):
        s.add(make_row(f"loose{i}", steps=20, deadline=1000.0 + i, at=0.01 * i))
    calls.clear()
    forecast = s.forecast(0.0)
    asked = len(calls)
    started, ended = run(s, step_time)
    assert started["loose0"] == 24 * 0.1875  # held back while "tight" needs short steps
    assert started["loose1"] == ended["loose0"] and started["loose2"] == ended["tight"] == 11.0
    for job_id, f in forecast.items():
        assert (f.start, f.finish) == pytest.approx((started[job_id], ended[job_id])), job_id
    # asking every held row after every step costs a prediction per row per step: 12 x 24
    assert asked < 12 * 24


def test_the_forecast_lets_a_held_row_in_when_its_slack_runs_short_as_the_run_does():
    # steps of 1 s plus 1 s per row, a round a step. "tight" (20 steps, due at 40.5, of higher
    # priority) can be on time only alone (40 s): "mid" (4 steps, due at 22) is held back until
    # its slack beside "tight" runs under two rounds (two steps of 3 s) at 6 s; it joins then, on
    # time (ends at 18), and "tight" ends late at 44. Had it waited past 10 s it could not be on
    # time beside "tight" and would wait for it to end: the forecast must not skip that window
    s = BatchScheduler(4, plan=make_plan(step_time=by_size(1.0, 1.0), round_steps=1))
    s.add(make_row("tight", steps=20, deadline=40.5, priority=1))
    s.schedule(0.0)
    s.add(make_row("mid", steps=4, deadline=22.0))
    forecast = s.forecast(0.0)
    started, ended = run(s, by_size(1.0, 1.0))
    assert (started["mid"], ended["mid"], ended["tight"]) == pytest.approx((6.0, 18.0, 44.0))
    for job_id, f in forecast.items():
        assert (f.start, f.finish) == pytest.approx((started[job_id], ended[job_id])), job_id

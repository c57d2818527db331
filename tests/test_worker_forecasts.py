"""Forecast notes: which waiting rows are told their queue position and predicted start/finish."""

import pytest

from backend.worker.deadlines import RowForecast
from backend.worker.forecasts import ForecastNotes


class FakeScheduler:
    def __init__(self):
        self.answer: dict[str, RowForecast] = {}
        self.timed_by = None

    def forecast(self, now, step_time=None):
        self.timed_by = step_time
        return dict(self.answer)


def notes():
    scheduler = FakeScheduler()
    return scheduler, ForecastNotes(scheduler, step_time=lambda rows: 1.0, min_move_s=2.0)


def test_a_waiting_row_is_told_once_then_only_when_its_forecast_moves():
    scheduler, n = notes()
    scheduler.answer = {"run": RowForecast(0, 0.0, 5.0), "w": RowForecast(1, 5.0, 25.0)}
    n.update(0.0)
    assert n.due(0.0) == [("w", RowForecast(1, 5.0, 25.0))]  # running rows: on step events
    n.update(1.0)
    assert n.due(1.0) == []
    scheduler.answer["w"] = RowForecast(1, 6.5, 26.5)  # moved 1.5 s: not enough
    n.update(2.0)
    assert n.due(2.0) == []
    scheduler.answer["w"] = RowForecast(1, 9.0, 29.0)  # moved 4 s from what it was told
    n.update(3.0)
    assert n.due(3.0) == [("w", RowForecast(1, 9.0, 29.0))]
    scheduler.answer["w"] = RowForecast(2, 9.0, 29.0)  # another row went ahead of it
    n.update(4.0)
    assert [job for job, _ in n.due(4.0)] == ["w"]


def test_far_starts_move_relatively_before_they_are_told_again():
    scheduler, n = notes()
    scheduler.answer = {"w": RowForecast(5, 100.0, 120.0)}
    n.update(0.0)
    n.due(0.0)
    scheduler.answer = {"w": RowForecast(5, 108.0, 128.0)}  # 8 s of 100 s left: under 10%
    n.update(0.0)
    assert n.due(0.0) == []
    scheduler.answer = {"w": RowForecast(5, 113.0, 133.0)}  # 13 s of 113 s
    n.update(0.0)
    assert n.due(0.0) != []


def test_finish_of_and_forget():
    scheduler, n = notes()
    scheduler.answer = {"run": RowForecast(0, 0.0, 7.5)}
    n.update(0.0)
    assert n.finish_of("run") == 7.5 and n.finish_of("gone") == 0.0
    n.forget("run")
    assert n.finish_of("run") == 0.0


def test_without_a_step_clock_nothing_is_forecast():
    scheduler = FakeScheduler()
    scheduler.answer = {"w": RowForecast(1, 1.0, 2.0)}
    n = ForecastNotes(scheduler, step_time=None)
    assert n.update(0.0) == {} and n.due(0.0) == []


def test_the_forecast_is_timed_by_the_notes_step_time_not_the_plans():
    scheduler = FakeScheduler()

    def prediction(rows):
        return 1.0

    ForecastNotes(scheduler, step_time=prediction).update(0.0)
    assert scheduler.timed_by is prediction


class CountingScheduler(FakeScheduler):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forecast(self, now, step_time=None):
        self.calls += 1
        return super().forecast(now, step_time)


def test_the_forecast_is_made_again_only_once_it_is_refresh_s_old():
    scheduler = CountingScheduler()
    n = ForecastNotes(scheduler, step_time=lambda rows: 1.0, refresh_s=0.5)
    scheduler.answer = {"w": RowForecast(1, 5.0, 25.0)}
    assert n.update(10.0) == {"w": RowForecast(1, 5.0, 25.0)}
    scheduler.answer = {"w": RowForecast(1, 5.0, 25.0), "new": RowForecast(2, 25.0, 45.0)}
    assert n.update(10.3) == {"w": RowForecast(1, 5.0, 25.0)}  # 0.3 s old: kept
    assert scheduler.calls == 1 and n.finish_of("new") == 0.0
    assert n.update(10.5) == scheduler.answer  # 0.5 s old: made again
    assert scheduler.calls == 2
    # a row that queued between two forecasts is told at the next one
    assert [job for job, _ in n.due(10.5)] == ["w", "new"]


def test_refresh_zero_forecasts_at_every_update_and_a_clock_going_back_refreshes():
    scheduler = CountingScheduler()
    every = ForecastNotes(scheduler, step_time=lambda rows: 1.0)
    for now in (1.0, 1.0, 1.001):
        every.update(now)
    assert scheduler.calls == 3
    lazy = ForecastNotes(scheduler, step_time=lambda rows: 1.0, refresh_s=10.0)
    lazy.update(5.0)
    lazy.update(4.0)  # the wall clock stepped back: the forecast's age is unknown
    assert scheduler.calls == 5


def test_a_negative_refresh_is_refused():
    with pytest.raises(ValueError, match="refresh_s must be >= 0"):
        ForecastNotes(FakeScheduler(), step_time=None, refresh_s=-1.0)

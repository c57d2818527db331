"""What a worker tells each job about its future: queue position, predicted start and finish
(pure: no torch, no clock; ``now`` is an argument).

Every iteration the worker calls ``ForecastNotes.update(now)``; every ``refresh_s`` seconds that
asks the scheduler for a new forecast (``BatchScheduler.forecast``, timed by ``step_time``: the
worker's step clock's prediction, not the margin its plan decides on). The forecast runs the whole
queue forward, and its cost grows with the queue: asked at every step of a burst it lengthens
the very steps it forecasts (docs/bench/worker-deadlines.md, "The forecast's cost in the loop"),
while a forecast a fraction of a second old tells a user as much. Running rows carry their
predicted finish on every step event; a waiting row gets a ``waiting`` event only when its
forecast changed enough to matter to whoever watches it (``due``), so a long queue does not flood
the job records with an event per row per step.

Invariants: the forecast is at most ``refresh_s`` old (``refresh_s`` = 0: made at every update); a
waiting row is told its forecast at least once (at the first forecast after it queued) and again
whenever its position changes or its predicted start moves by more than ``min_move_s`` and
``rel_move`` of the time left until it; a job that left is forgotten (``forget``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from backend.worker.deadlines import RowForecast


class Forecaster(Protocol):
    """The scheduler as the notes read it (``backend.worker.batching.BatchScheduler``)."""

    def forecast(
        self, now: float, step_time: Callable[[Sequence[Any]], float] | None = None
    ) -> dict[str, RowForecast]: ...


class ForecastNotes:
    def __init__(
        self,
        scheduler: Forecaster,
        step_time: Callable[[Sequence[Any]], float] | None,
        min_move_s: float = 2.0,
        rel_move: float = 0.1,
        refresh_s: float = 0.0,
    ):
        if refresh_s < 0:
            raise ValueError(f"refresh_s must be >= 0, got {refresh_s}")
        self.scheduler, self.step_time = scheduler, step_time
        self.min_move_s, self.rel_move, self.refresh_s = min_move_s, rel_move, refresh_s
        self.latest: dict[str, RowForecast] = {}  # the last forecast, every row it knew
        self._made_at: float | None = None  # when ``latest`` was made (None: never)
        self._told: dict[str, RowForecast] = {}  # what each waiting row was last told

    def update(self, now: float) -> dict[str, RowForecast]:
        """The forecast of every row, made again when the last is ``refresh_s`` old (empty without
        a step clock)."""
        if self.step_time is None:
            self.latest = {}
        elif self._made_at is None or now - self._made_at >= self.refresh_s or now < self._made_at:
            self.latest = self.scheduler.forecast(now, self.step_time)
            self._made_at = now
        return self.latest

    def due(self, now: float) -> list[tuple[str, RowForecast]]:
        """Waiting rows whose forecast should be told now (module docstring); marks them told."""
        due = []
        for job_id, forecast in self.latest.items():
            if forecast.position == 0:
                continue  # running: its step events carry its forecast
            told = self._told.get(job_id)
            if told is None or self._moved(told, forecast, now):
                self._told[job_id] = forecast
                due.append((job_id, forecast))
        return due

    def _moved(self, told: RowForecast, forecast: RowForecast, now: float) -> bool:
        if told.position != forecast.position:
            return True
        threshold = max(self.min_move_s, self.rel_move * max(0.0, forecast.start - now))
        return abs(forecast.start - told.start) > threshold

    def finish_of(self, job_id: str) -> float:
        """The row's predicted finish this iteration (0: no forecast)."""
        forecast = self.latest.get(job_id)
        return forecast.finish if forecast is not None else 0.0

    def forget(self, job_id: str) -> None:
        self._told.pop(job_id, None)
        self.latest.pop(job_id, None)

"""What a worker tells each job about its future: queue position, predicted start and finish
(pure: no torch, no clock; ``now`` is an argument).

Once per iteration the worker asks ``ForecastNotes.update(now)`` for the scheduler's forecast
(``BatchScheduler.forecast``, timed by ``step_time``: the worker's step clock's prediction, not the
margin its plan decides on): running rows carry their predicted
finish on every step event; a waiting row gets a ``waiting`` event only when its forecast changed
enough to matter to whoever watches it (``due``), so a long queue does not flood the job records
with an event per row per step.

Invariants: a waiting row is told its forecast at least once (its first update after it queued)
and again whenever its position changes or its predicted start moves by more than ``min_move_s``
and ``rel_move`` of the time left until it; a job that left is forgotten (``forget``).
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
    ):
        self.scheduler, self.step_time = scheduler, step_time
        self.min_move_s, self.rel_move = min_move_s, rel_move
        self.latest: dict[str, RowForecast] = {}  # this iteration's, every row
        self._told: dict[str, RowForecast] = {}  # what each waiting row was last told

    def update(self, now: float) -> dict[str, RowForecast]:
        """This iteration's forecast of every row (empty without a step clock)."""
        if self.step_time is None:
            self.latest = {}
        else:
            self.latest = self.scheduler.forecast(now, self.step_time)
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

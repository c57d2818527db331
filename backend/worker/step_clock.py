"""Predicted seconds of one denoising step of a batch, for the deadline scheduler's slack and the
worker's forecasts (pure: no torch, no clock).

TetriServe's observation is that a step's time is predictable: it is a function of the batch.
The fitted cost model (``maskserve profile``, the router's ``RoutingCostModel.step_latency``)
gives its shape over mask ratios and cache reads; this worker's measured steps calibrate its scale
(the profile was fitted at one resolution, on one machine): prediction = model(batch) x an
exponentially weighted mean of measured / modelled. Without a cost model the clock predicts
``rows x`` a weighted mean of the measured seconds per row.

Invariants: predictions are > 0 and finite; before the first measurement the model's own figure
is used (or ``initial_row_s`` per row); one measurement moves the scale by at most ``alpha`` of
the way to what it saw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol


class StepRow(Protocol):
    """A row as the clock sees it (``backend.worker.batching.Row``)."""

    mask_ratio: float
    template: str


# seconds of one step of a batch of (mask_ratio, template, reads_cache) rows
StepModel = Callable[[Sequence[tuple[float, str, bool]]], float]


class StepClock:
    def __init__(
        self, model: StepModel | None = None, alpha: float = 0.2, initial_row_s: float = 0.5
    ):
        if not 0.0 < alpha <= 1.0 or initial_row_s <= 0.0:
            raise ValueError("alpha must be in (0, 1] and initial_row_s > 0")
        self.model, self.alpha = model, alpha
        self.scale = 1.0  # measured / modelled, weighted towards recent steps
        self.row_s = initial_row_s  # measured seconds per row (no model)

    def _modelled(self, rows: Sequence[StepRow]) -> float:
        assert self.model is not None
        return self.model([(r.mask_ratio, r.template, bool(r.template)) for r in rows])

    def __call__(self, rows: Sequence[StepRow]) -> float:
        """Predicted seconds of one step of a batch of ``rows`` (0 rows: 0)."""
        if not rows:
            return 0.0
        if self.model is None:
            return self.row_s * len(rows)
        return max(1e-6, self._modelled(rows) * self.scale)

    def observe(self, rows: Sequence[StepRow], seconds: float) -> None:
        """A step of ``rows`` took ``seconds``: move the calibration towards it."""
        if not rows or not math.isfinite(seconds) or seconds <= 0.0:
            return
        if self.model is None:
            self.row_s += self.alpha * (seconds / len(rows) - self.row_s)
            return
        modelled = self._modelled(rows)
        if modelled > 0.0:
            self.scale += self.alpha * (seconds / modelled - self.scale)

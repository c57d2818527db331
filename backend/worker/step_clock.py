"""Predicted seconds of one denoising step of a batch, for the deadline scheduler's slack and the
worker's forecasts (pure: no torch, no clock).

TetriServe's observation is that a step's time is predictable: it is a function of the batch.
The fitted cost model (``maskserve profile``, the router's ``RoutingCostModel.step_latency``)
gives its shape over mask ratios and cache reads; without one, a step costs ``initial_row_s`` per
row. This worker's measured steps calibrate it twice over (the profile was fitted at one
resolution, on one machine, with its own thread count):

* ``scale``: an exponentially weighted mean of measured / predicted over every step: how much
  slower or faster this machine is now (it drifts);
* ``shape[n]``: the same over the steps of ``n`` rows only, relative to ``scale``: how a step's
  time grows with its rows here. Batch sizing and parking decide on what one row more or less
  costs, and a profile fitted elsewhere can get that badly wrong (a fixed part that a machine
  with one thread does not have). A row count never measured takes the shape of the nearest
  counts measured (linear between two, the nearest's beyond them; 1 before any).

prediction = model(batch) x ``scale`` x ``shape[rows]``.

The join rule (``joining_pays``: whether a waiting row should join the running batch) prices
batches apart from the prediction: model(batch) x ``join_speed(rows)``, the measured / modelled
seconds of this machine's steps of that many rows (an exponentially weighted mean, from the first
step), taken once ``JOIN_SAMPLES`` such steps were measured. The shape learns too slowly for it: a
profile that says two rows cost 1.4x one, on a machine where they cost 2x, would keep rows joining
for dozens of two-row steps.

With ``plan_quantile`` q > 0 planning takes a step as long as it came out on most recent steps,
not on average: ``planned`` is the prediction times ``margin``, the q quantile of measured /
predicted over the last ``window`` steps (each step against the prediction made before it was
measured), never below 1. TetriServe plans on the prediction alone (q = 0, the default) because
its steps vary by under 1%, where the margin would stay 1 anyway. On a machine whose speed moves
from one second to the next, a plan that a step 10% slower than average breaks misses half its
deadlines, and the margin is the headroom the machine's own recent noise says it needs. The
worker's forecasts keep the prediction itself (what a user is told is the expected finish, not a
bound).

Invariants: predictions are > 0 and finite; before the first measurement the model's own figure
is used (or ``initial_row_s`` per row); one measurement moves ``scale`` by at most ``alpha`` of the
way to what it saw, and the shape of its row count by at most ``SHAPE_RATE x alpha``: a slowdown
seen on one row count moves mostly ``scale``, and so every count's prediction; ``margin`` is 1
until ``MIN_SAMPLES`` steps were measured (and with ``plan_quantile`` 0) and >= 1 always.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from backend.costmodel.batch_gain import joining_pays


class StepRow(Protocol):
    """A row as the clock sees it (``backend.worker.batch_rows.Row``)."""

    mask_ratio: float
    template: str


# seconds of one step of a batch of (mask_ratio, template, reads_cache) rows
StepModel = Callable[[Sequence[tuple[float, str, bool]]], float]
# whether a waiting row should join the running batch (``StepClock.joining_pays``)
JoinRule = Callable[[Sequence[StepRow], StepRow], bool]
# the shape learns this much slower than the scale: it is how this machine's steps grow with rows,
# which changes little, where the scale follows the machine's speed, which drifts
SHAPE_RATE = 0.25
# steps measured before the margin is taken from them: a quantile of a handful is noise itself
MIN_SAMPLES = 20
# steps of a row count measured before the join rule takes their speed over the profile's shape
JOIN_SAMPLES = 3


class StepClock:
    def __init__(
        self,
        model: StepModel | None = None,
        alpha: float = 0.2,
        initial_row_s: float = 0.5,
        *,
        plan_quantile: float = 0.0,
        window: int = 256,
    ):
        if not 0.0 < alpha <= 1.0 or initial_row_s <= 0.0:
            raise ValueError("alpha must be in (0, 1] and initial_row_s > 0")
        if not 0.0 <= plan_quantile < 1.0 or window < MIN_SAMPLES:
            raise ValueError(f"plan_quantile must be in [0, 1) and window >= {MIN_SAMPLES}")
        self.model, self.alpha, self.initial_row_s = model, alpha, initial_row_s
        self.plan_quantile = plan_quantile
        self.scale = 1.0  # measured / predicted, weighted towards recent steps
        self.shape: dict[int, float] = {}  # rows -> measured / (modelled x scale), per row count
        # rows -> (steps measured, their measured / modelled: the first, then weighted towards
        # recent steps by ``alpha``): what the join rule prices batches with (``joining_pays``)
        self.speed_by_rows: dict[int, tuple[int, float]] = {}
        self.margin = 1.0  # ``planned`` / prediction (module docstring)
        self._surprises: deque[float] = deque(maxlen=window)  # measured / predicted, per step

    def modelled(self, rows: Sequence[StepRow]) -> float:
        """The cost model's seconds for a step of ``rows``, before this machine's calibration."""
        if self.model is None:
            return self.initial_row_s * len(rows)
        return self.model([(r.mask_ratio, r.template, bool(r.template)) for r in rows])

    def shape_of(self, num_rows: int) -> float:
        """The shape factor of a batch of ``num_rows`` rows (module docstring)."""
        if num_rows in self.shape:
            return self.shape[num_rows]
        below = max((n for n in self.shape if n < num_rows), default=None)
        above = min((n for n in self.shape if n > num_rows), default=None)
        if below is None or above is None:
            nearest = below if above is None else above
            return 1.0 if nearest is None else self.shape[nearest]
        weight = (num_rows - below) / (above - below)
        return self.shape[below] + weight * (self.shape[above] - self.shape[below])

    def __call__(self, rows: Sequence[StepRow]) -> float:
        """Predicted seconds of one step of a batch of ``rows`` (0 rows: 0)."""
        if not rows:
            return 0.0
        return self._predicted(self.modelled(rows), len(rows))

    def _predicted(self, modelled: float, num_rows: int) -> float:
        return max(1e-6, modelled * self.scale * self.shape_of(num_rows))

    def joining_pays(self, batch: Sequence[StepRow], row: StepRow) -> bool:
        """Whether waiting ``row`` should join the running ``batch``: whether that lowers the
        rows' summed finish times (``costmodel.batch_gain.joining_pays``), each batch priced by
        the model times the speed measured here on steps of its row count (``join_speed``).

        Not on the predictions themselves: their shape learns slowly on purpose (a slowdown moves
        the scale, module docstring), and a profile fitted where batching paid would keep rows
        joining for dozens of steps of two rows; measured per row count, a few such steps tell."""
        if not batch:
            return True
        n = len(batch)
        return joining_pays(
            self.modelled(batch) * self.join_speed(n),
            self.modelled([*batch, row]) * self.join_speed(n + 1),
            self.modelled([row]) * self.join_speed(1),
            n,
        )

    def join_rule(self, enabled: bool) -> JoinRule | None:
        """``joining_pays`` when ``enabled`` (``worker.join_when_it_pays``) and this clock has a
        cost model; None otherwise: without a profile it knows nothing of how a step grows with
        its rows until rows have batched, so there rows join while slots are free."""
        return self.joining_pays if enabled and self.model is not None else None

    def join_speed(self, num_rows: int) -> float:
        """Measured / modelled seconds of steps of ``num_rows`` rows, once ``JOIN_SAMPLES`` were
        measured; else that of the largest row count below it that was (the model's own shape
        from there on); 1.0 before any."""
        known = [n for n, (count, _) in self.speed_by_rows.items() if count >= JOIN_SAMPLES]
        below = max((n for n in known if n <= num_rows), default=None)
        return 1.0 if below is None else self.speed_by_rows[below][1]

    def planned(self, rows: Sequence[StepRow]) -> float:
        """Seconds of one step of ``rows`` to plan on: the prediction times ``margin``."""
        return self(rows) * self.margin

    def observe(self, rows: Sequence[StepRow], seconds: float) -> None:
        """A step of ``rows`` took ``seconds``: move the calibration towards it."""
        if not rows or not math.isfinite(seconds) or seconds <= 0.0:
            return
        modelled = self.modelled(rows)
        if not modelled > 0.0:
            return
        num_rows = len(rows)
        shape = self.shape_of(num_rows)
        self._note_surprise(seconds / self._predicted(modelled, num_rows))
        self.scale += self.alpha * (seconds / (modelled * shape) - self.scale)
        seen = seconds / (modelled * self.scale)
        self.shape[num_rows] = shape + SHAPE_RATE * self.alpha * (seen - shape)
        count, speed = self.speed_by_rows.get(num_rows, (0, seconds / modelled))
        speed += self.alpha * (seconds / modelled - speed)
        self.speed_by_rows[num_rows] = (count + 1, speed)

    def _note_surprise(self, ratio: float) -> None:
        """One step's measured / predicted; the margin follows the window's quantile."""
        self._surprises.append(ratio)
        if self.plan_quantile > 0.0 and len(self._surprises) >= MIN_SAMPLES:
            ranked = sorted(self._surprises)
            self.margin = max(1.0, ranked[int(self.plan_quantile * len(ranked))])

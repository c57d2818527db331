"""A machine whose speed drifts, for the simulations (pure: numpy's generator only, no clock).

The route simulation prices a step at the cost model's figure times a lognormal factor drawn
afresh for every step (``noise_cv``): noise that averages out within a job. The CPU the worker
benches ran on moves differently: a fixed matmul loop took 43 to 116 ms from one second to the
next, and whole runs of a minute ran 1.3 x slower than the one before
(docs/bench/worker-deadlines.md, "The machine's speed"). That is a slow factor shared by every step
of a stretch of seconds, which a plan made on the average step cannot absorb.

``SpeedDrift`` models it: the log of the slowdown follows an Ornstein-Uhlenbeck process with
stationary standard deviation ``sigma = sqrt(log(1 + cv**2))`` and correlation time ``tau_s``
(the correlation of two readings ``dt`` apart is ``exp(-dt / tau_s)``); ``factor(now)`` is
``exp(x - sigma**2 / 2)``, so its stationary mean is 1 and its coefficient of variation ``cv``.

Invariants: readings are made at non-decreasing times (an earlier ``now`` than the last reading is
an error); the same seed and the same reading times give the same factors; ``cv`` 0 gives 1 at
every time; the process starts from its stationary distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DriftSpec:
    """How a simulated machine's speed drifts: ``cv`` of the slowdown, its correlation time."""

    cv: float = 0.0
    tau_s: float = 5.0

    def __post_init__(self) -> None:
        if self.cv < 0 or not self.tau_s > 0:
            raise ValueError(f"drift needs cv >= 0 and tau_s > 0, got {self.cv}, {self.tau_s}")


class SpeedDrift:
    """One machine's slowdown over simulated time (module docstring)."""

    def __init__(self, spec: DriftSpec, seed: int | list[int]):
        self.spec = spec
        self.sigma = math.sqrt(math.log1p(spec.cv**2))
        self._rng = np.random.default_rng(seed)
        self._at = 0.0
        self._x = self.sigma * float(self._rng.standard_normal())

    def factor(self, now: float) -> float:
        """The slowdown at ``now`` (1.0: as fast as on average)."""
        if now < self._at:
            raise ValueError(f"drift read at {now} after a reading at {self._at}")
        if self.sigma == 0.0:
            return 1.0
        if now > self._at:
            keep = math.exp(-(now - self._at) / self.spec.tau_s)
            fresh = self.sigma * math.sqrt(1.0 - keep * keep) * float(self._rng.standard_normal())
            self._x = self._x * keep + fresh
            self._at = now
        return math.exp(self._x - self.sigma * self.sigma / 2.0)

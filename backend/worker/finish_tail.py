"""How long a job takes after its engine worker hands it on: the hand-off, the post-processing
queue and task (decode, paste back, encode), storing the result and the ``done`` event (pure: no
redis, no clock; times are arguments).

A job's deadline covers the whole job, but the worker's steps end before that tail. A worker that
plans a row's last step for its deadline makes it late by the tail, a few tens of milliseconds on
the shipped models (docs/bench/serve-deadlines.md, "A 1.0 s deadline"). So the worker measures the
tail of the jobs it hands on, from their records (``handed_on``, then ``resolve`` with the time
the record says the job was done), and plans each new row against its deadline less
``reserve_s``: a high quantile of the recent tails.

Invariants: ``reserve_s`` is 0.0 until a tail was measured, never negative, and is the
``quantile`` of the last ``window`` tails; at most ``max_pending`` jobs await their record (the
oldest is forgotten first), and one handed on ``max_age_s`` ago or more is forgotten unread (its
post-processing was lost or is retried: not a tail of the normal path).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class FinishTail:
    window: int = 64
    quantile: float = 0.9
    max_age_s: float = 60.0
    max_pending: int = 256
    _pending: dict[str, float] = field(default_factory=dict, init=False)  # job id -> handed on
    _tails: deque = field(default_factory=deque, init=False)  # seconds, the last ``window``
    # ``reserve_s``, kept with the tails: it is read for every row at every step
    _reserve_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if self.max_age_s <= 0 or self.max_pending < 1:
            raise ValueError("max_age_s must be > 0 and max_pending >= 1")

    def handed_on(self, job_id: str, at: float) -> None:
        """The worker handed the job on (to post-processing) at epoch ``at``."""
        self._pending.pop(job_id, None)  # re-inserted last: the oldest stay first
        self._pending[job_id] = at
        while len(self._pending) > self.max_pending:
            del self._pending[next(iter(self._pending))]

    def unresolved(self, now: float) -> list[str]:
        """The jobs whose record to read now, oldest first; forgets those ``max_age_s`` old."""
        for job_id in [j for j, at in self._pending.items() if now - at >= self.max_age_s]:
            del self._pending[job_id]
        return list(self._pending)

    def resolve(self, job_id: str, done_at: float | None, ended: bool) -> None:
        """What the job's record says: ``done_at`` when it was done (its tail is measured), else
        whether it ``ended`` otherwise (failed, cancelled, gone: forgotten unmeasured); neither:
        still on its way, asked again later."""
        handed_at = self._pending.get(job_id)
        if handed_at is None:
            return
        if done_at is not None:
            del self._pending[job_id]
            self._tails.append(max(0.0, done_at - handed_at))
            if len(self._tails) > self.window:
                self._tails.popleft()
            ordered = sorted(self._tails)  # the quantile by nearest rank
            self._reserve_s = ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)]
        elif ended:
            del self._pending[job_id]

    def reserve_s(self) -> float:
        """The ``quantile`` of the recent tails (nearest rank), 0.0 before the first."""
        return self._reserve_s

    @property
    def measured(self) -> int:
        """Tails in the window."""
        return len(self._tails)

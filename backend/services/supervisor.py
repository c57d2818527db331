"""When to restart a supervised role, and how long to wait before reconnecting (pure).

``maskserve up`` (``backend.services.stack``) keeps one ``RoleRecord`` per role (and one for the
Redis it started); the engine worker keeps a ``Reconnect`` for its Redis. Both wait along the same
``Backoff``: the initial delay, doubled at each consecutive failure, never above the cap.

Invariants: a role is never given up on (after many crashes it is retried every ``cap_s``); a role
that ran ``stable_s`` or longer before exiting counts as healthy, so its next delay is the initial
one again; ``restarts`` only grows (it is the Prometheus counter).
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_DOUBLINGS = 60  # 2**60 x any delay is far above every cap: no float overflow after many tries


@dataclass(frozen=True)
class Backoff:
    """``initial_s``, ``2 x initial_s``, ``4 x initial_s``, ... capped at ``cap_s``."""

    initial_s: float
    cap_s: float

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.cap_s:
            raise ValueError(
                f"backoff needs 0 < initial_s <= cap_s, got {self.initial_s} and {self.cap_s}"
            )

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` consecutive failures (``failures >= 1``)."""
        if failures < 1:
            raise ValueError(f"failures counts from 1, got {failures}")
        doublings: int = min(failures - 1, _MAX_DOUBLINGS)
        return min(self.cap_s, self.initial_s * float(2**doublings))


@dataclass(frozen=True)
class RestartPolicy:
    """How a supervisor restarts a role that exited."""

    backoff: Backoff
    stable_s: float


@dataclass
class RoleRecord:
    """What the supervisor knows of one role. Times are the supervisor's monotonic clock."""

    name: str
    started_at: float
    restarts: int = 0  # restarts done (not counting the first start)
    failures: int = 0  # consecutive exits after a short run
    last_exit: int | None = None  # exit status of the last exit
    restart_at: float | None = None  # set while the role is down, waiting for its restart

    @property
    def running(self) -> bool:
        return self.restart_at is None

    def exited(self, now: float, status: int, policy: RestartPolicy) -> float:
        """Record an exit; returns the delay before the restart (also kept in ``restart_at``)."""
        if not self.running:
            raise ValueError(f"{self.name} exited while it was not running")
        stable = now - self.started_at >= policy.stable_s
        self.failures = 1 if stable else self.failures + 1
        delay = policy.backoff.delay(self.failures)
        self.last_exit, self.restart_at = status, now + delay
        return delay

    def due(self, now: float) -> bool:
        """Whether the role is down and its restart delay has passed."""
        return self.restart_at is not None and now >= self.restart_at

    def restarted(self, now: float) -> None:
        if self.running:
            raise ValueError(f"{self.name} restarted while it was running")
        self.restarts += 1
        self.started_at, self.restart_at = now, None


@dataclass
class Reconnect:
    """A role's view of its Redis connection: how long to wait after each failed attempt."""

    backoff: Backoff
    failures: int = 0

    @property
    def connected(self) -> bool:
        return self.failures == 0

    def failed(self) -> float:
        """One more failure in a row; returns the wait before the next attempt."""
        self.failures += 1
        return self.backoff.delay(self.failures)

    def succeeded(self) -> bool:
        """Redis answered; True when this ends an outage (the role re-registers itself then)."""
        outage, self.failures = self.failures > 0, 0
        return outage

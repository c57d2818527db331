"""Settings of keeping a stack running and its storage bounded (``Settings.retention``,
``Settings.supervisor``): how long blobs and job records are kept, how ``maskserve up`` restarts
roles that exit and rotates their logs, and its processes' Prometheus ports."""

from __future__ import annotations

from pydantic import Field, field_validator

from backend.config_base import Strict

MIN_JOB_RECORD_S = 7 * 24 * 3600  # a finished job's record is kept at least a week


class RetentionSettings(Strict):
    """How long blobs (``backend.blobs``: uploads, masks, prepared requests, latents, results) are
    kept, in hours after their job finished (done, failed or cancelled); 0 keeps them forever.

    Inputs and intermediates are worth little once the job is over; results and thumbnails are what
    users come back for. A blob that a job which has not finished references is never deleted. The
    API process runs the janitor (``backend.janitor``) every ``sweep_every_s`` (0: it never runs).
    Job records (status, timings, result references: what ``GET /v1/jobs/{id}`` and the histories
    read) expire ``job_record_s`` after the job finished: as long as its results are kept, and at
    least a week; never when results are kept forever.
    """

    inputs_hours: float = Field(default=24.0, ge=0.0)
    """Uploads, masks, prepared requests and latents: hours kept after their job finished; 0:
    forever."""
    results_hours: float = Field(default=168.0, ge=0.0)
    """Results and thumbnails: hours kept after their job finished; 0: forever. Job records are
    kept as long, and at least a week."""
    sweep_every_s: float = Field(default=600.0, ge=0.0)
    """Seconds between janitor sweeps in the API process; 0: no janitor."""

    @property
    def job_record_s(self) -> int:
        """Seconds a finished job's record is kept (0: forever); a result is reachable as long as
        it is kept."""
        return (
            0 if self.results_hours == 0 else max(MIN_JOB_RECORD_S, int(self.results_hours * 3600))
        )


class SupervisorSettings(Strict):
    """Self-healing: how ``maskserve up`` restarts a role (or its own Redis) that exits, and how a
    role whose Redis went away reconnects. Delays double from the initial one up to the cap; a role
    that ran ``restart_stable_s`` before exiting starts again from the initial delay."""

    restart_initial_s: float = Field(default=1.0, gt=0.0, le=60.0)
    """Seconds before the first restart of a role that exited."""
    restart_max_s: float = Field(default=30.0, gt=0.0, le=600.0)
    """Cap of the doubling restart delay: a role that keeps crashing is retried this often, forever
    (each attempt logged and counted)."""
    restart_stable_s: float = Field(default=60.0, gt=0.0)
    """A role that ran this long before exiting counts as healthy: its next delay is the initial
    one again."""
    reconnect_initial_s: float = Field(default=0.2, gt=0.0, le=10.0)
    """First wait of a role (the engine worker) whose Redis stopped answering, before it tries
    again."""
    reconnect_max_s: float = Field(default=5.0, gt=0.0, le=60.0)
    """Cap of the doubling reconnection wait."""
    log_max_mb: float = Field(default=64.0, ge=0.0)
    """A role's log under ``<data_dir>/logs`` is rotated past this size: copied to ``<role>.log.1``
    (replacing the older copy) and emptied, so the logs of a long-running stack hold at most twice
    this per role; 0: never rotated."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Port of ``maskserve up``'s own Prometheus ``/metrics`` on ``metrics_host``
    (``maskserve_role_restarts_total{role=...}``, ``maskserve_role_up{role=...}``); 0: its fixed
    port, ``metrics_base_port``."""
    metrics_base_port: int = Field(default=9101, ge=0, le=65000)
    """First of the fixed Prometheus ports of ``maskserve up``'s processes, the same at every
    start: ``up`` itself at this port, the dispatcher +1, ``cpu-worker-N`` +10+N, ``worker-N``
    +20+N (9101, 9102, 9111.., 9121..). A kind whose own ``metrics_port`` is set uses that one; a
    fixed port already taken is replaced by a free one (logged, printed, and in
    ``stack-status.json``); 0: free ports at every start."""

    @field_validator("restart_max_s")
    @classmethod
    def _cap_above_initial(cls, value: float, info) -> float:
        initial = info.data.get("restart_initial_s", 0.0)
        if value < initial:
            raise ValueError(f"restart_max_s ({value}) must be >= restart_initial_s ({initial})")
        return value

    @field_validator("reconnect_max_s")
    @classmethod
    def _reconnect_cap_above_initial(cls, value: float, info) -> float:
        initial = info.data.get("reconnect_initial_s", 0.0)
        if value < initial:
            raise ValueError(
                f"reconnect_max_s ({value}) must be >= reconnect_initial_s ({initial})"
            )
        return value

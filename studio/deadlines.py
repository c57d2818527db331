"""How the studio words a job's service level: the forecast while it waits and runs ("start in
~3 s", "finish in ~9 s", relative to the current time), whether it was accepted late, and when it
is done whether it met its deadline ("on time", "2.4 s late").

Pure functions of a job's fields (``protocol.JobRecord``: ``deadline``, ``late``,
``predicted_start``, ``predicted_finish``, ``met_deadline`` and ``done_at``, epoch seconds; 0 or
None: not known) and of ``now``, so every wording is unit-tested without a clock.

The studio submits every edit as ``interactive`` (``STUDIO_CLASS``): someone is watching it.
"""

from __future__ import annotations

STUDIO_CLASS = "interactive"
# statuses before the job's first denoising step: its predicted start is still ahead of it
BEFORE_START = ("queued", "preprocessing", "waiting")
# statuses whose predicted finish (the end of denoising) is still ahead
BEFORE_FINISH = (*BEFORE_START, "running")
LATE = "late: predicted past its deadline"


def seconds(value: float) -> str:
    """Two significant figures under ten seconds, whole seconds above."""
    return f"{value:.2g}" if abs(value) < 10 else f"{value:.0f}"


def relative(at: float, now: float) -> str:
    """``at`` (epoch seconds) as seen from ``now``: "in ~N s" (at least 1), "in ~N min" from
    100 s on, "due now" once it has come (a forecast that has not caught up yet)."""
    ahead = at - now
    if ahead < 0.5:
        return "due now"
    if ahead < 99.5:
        return f"in ~{max(1, round(ahead))} s"
    return f"in ~{round(ahead / 60)} min"


def forecast_parts(
    status: str,
    predicted_start: float = 0.0,
    predicted_finish: float = 0.0,
    late: bool = False,
    now: float = 0.0,
) -> list[str]:
    """What the status line adds for a job that is not done: its predicted start (before it
    starts), its predicted finish (until it has denoised), each while it is still ahead (a
    forecast that has passed says nothing until the next one comes), and "late" when admission
    control accepted it past its deadline."""
    parts = []
    if status in BEFORE_START and predicted_start - now >= 0.5:
        parts.append(f"start {relative(predicted_start, now)}")
    if status in BEFORE_FINISH and predicted_finish - now >= 0.5:
        parts.append(f"finish {relative(predicted_finish, now)}")
    if late and status not in ("done", "failed", "cancelled"):
        parts.append(LATE)
    return parts


def outcome(met_deadline: bool | None, deadline: float = 0.0, done_at: float = 0.0) -> str:
    """A done job against its deadline: "on time", "N s late" (how late its result was stored),
    or "" (no deadline, or not done)."""
    if met_deadline is None:
        return ""
    if met_deadline:
        return "on time"
    if deadline and done_at and done_at > deadline:
        return f"{seconds(done_at - deadline)} s late"
    return "late"


def job_outcome(job: dict) -> str:
    """``outcome`` of a job as the service gives it; for one still under way, "late" when it was
    accepted late."""
    if job.get("status") == "done":
        return outcome(job.get("met_deadline"), job.get("deadline", 0.0), job.get("done_at", 0.0))
    if job.get("late") and job.get("status") not in ("failed", "cancelled"):
        return "late"
    return ""


def service_line(job: dict) -> str:
    """A finished edit's service level for its summary: "interactive · on time", with its
    priority when it had one ("interactive · priority 5 · 2.4 s late")."""
    parts = [job.get("service_class", "")]
    if job.get("priority"):
        parts.append(f"priority {job['priority']}")
    parts.append(job_outcome(job))
    return " · ".join(part for part in parts if part)


def requested_deadline_s(job: dict, target_s: float) -> float:
    """The deadline (seconds from submission) a job asked for, as the editor's field holds it:
    0 when it took its class's target (``target_s``) or had none."""
    deadline, created = job.get("deadline") or 0.0, job.get("created_at") or 0.0
    if not deadline or not created:
        return 0.0
    asked = round(deadline - created, 1)
    return 0.0 if abs(asked - target_s) < 0.5 else asked

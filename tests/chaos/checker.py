"""The one invariant checker every chaos test ends with (pure: records, events and result bytes
in, violations out; ``harness.collect`` reads them from the running stack).

For every job the API accepted (202):
1. it reached exactly one terminal state (done / failed / cancelled) within the bound: its record is
   terminal and its event stream holds exactly one terminal event;
2. a ``done`` job has one result, whose pixels outside the job's mask are the template's own,
   and a ``failed`` job says why (its record's message);
3. its denoising completed at most once: the record's ``denoised`` counter (incremented by every
   hand-off of a finished denoise to post-processing, duplicates included) is at most 1, and 1 for
   a done job; and its event stream holds at most one ``postprocessing`` event;
4. a job submitted after the fault ended ``done`` (unless the test expects it to fail).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

TERMINAL = ("done", "failed", "cancelled")


@dataclass
class Submitted:
    """A job the API accepted: what was sent, and when (wall clock, like the job record)."""

    job_id: str
    at: float
    template: Image.Image
    mask: np.ndarray  # bool, True = repainted; the upload's size
    expect: str = "done"  # the terminal status the test expects ("failed" for a poison job)


@dataclass
class Observed:
    """What the stack says about one job once the wait is over."""

    record: dict | None  # the job record (``JobStateStore.get``), None when it is gone
    statuses: list[str]  # the statuses of its event stream, in order
    result: bytes | None = None  # the result PNG of a done job


@dataclass
class Verdict:
    violations: list[str] = field(default_factory=list)
    first_new_done_s: float | None = None  # fault -> first job submitted after it is done
    all_terminal_s: float | None = None  # fault -> every accepted job terminal

    @property
    def ok(self) -> bool:
        return not self.violations


def job_violations(job: Submitted, seen: Observed, after_fault: bool) -> list[str]:
    """Every invariant ``job`` breaks (empty when it keeps them all)."""
    if seen.record is None:
        return [f"{job.job_id}: accepted, but its record is gone"]
    status = seen.record["status"]
    problems = []
    if status not in TERMINAL:
        problems.append(f"{job.job_id}: not terminal ({status}, step {seen.record.get('step')})")
    terminal_events = [s for s in seen.statuses if s in TERMINAL]
    if status in TERMINAL and terminal_events != [status]:
        problems.append(f"{job.job_id}: terminal events {terminal_events}, record says {status}")
    denoised = int(seen.record.get("denoised", 0))
    if seen.statuses.count("postprocessing") > 1 or denoised > 1:
        problems.append(f"{job.job_id}: denoised more than once ({denoised}): {seen.statuses}")
    if status == "done" and denoised != 1:
        problems.append(f"{job.job_id}: done, but its record counts {denoised} denoises")
    if status == "done":
        problems += _result_violations(job, seen.result)
    if status == "failed" and not seen.record.get("message"):
        problems.append(f"{job.job_id}: failed without saying why")
    if after_fault and status in TERMINAL and status != job.expect:
        problems.append(
            f"{job.job_id}: submitted after the fault, ended {status} "
            f"({seen.record.get('message')!r}), expected {job.expect}"
        )
    return problems


def _result_violations(job: Submitted, result: bytes | None) -> list[str]:
    if not result:
        return [f"{job.job_id}: done without a result"]
    try:
        image = np.asarray(Image.open(io.BytesIO(result)).convert("RGB"))
    except OSError as exc:
        return [f"{job.job_id}: unreadable result ({exc})"]
    template = np.asarray(job.template.convert("RGB"))
    if image.shape != template.shape:
        return [f"{job.job_id}: result {image.shape} != template {template.shape}"]
    outside = ~job.mask
    changed = int((image[outside] != template[outside]).any(axis=-1).sum())
    if changed:
        return [f"{job.job_id}: {changed} pixels outside the mask differ from the template"]
    return []


def verdict(
    jobs: list[Submitted],
    seen: dict[str, Observed],
    fault_at: float,
    healed_at: float | None = None,
    min_new: int = 1,
) -> Verdict:
    """Check every job and measure recovery from ``fault_at`` (wall clock). Jobs accepted after
    ``healed_at`` (default: the fault itself, for faults the stack heals alone) are the new jobs
    that must end as expected; a job accepted while a disk stayed full may fail, clearly.
    ``min_new``: how many new jobs there must be (invariant 4 needs some)."""
    result = Verdict()
    new_from = fault_at if healed_at is None else healed_at
    new = [job for job in jobs if job.at >= new_from]
    if len(new) < min_new:
        result.violations.append(f"only {len(new)} jobs accepted after the fault (< {min_new})")
    for job in jobs:
        result.violations += job_violations(job, seen[job.job_id], job.at >= new_from)
    finished = [_finished_at(seen[job.job_id]) for job in jobs]
    if finished and all(at is not None for at in finished):
        result.all_terminal_s = max(0.0, max(finished) - fault_at)  # type: ignore[type-var]
    new_done = [
        _finished_at(seen[job.job_id])
        for job in new
        if seen[job.job_id].record and seen[job.job_id].record["status"] == "done"
    ]
    if new_done:
        result.first_new_done_s = min(new_done) - fault_at  # type: ignore[operator]
    return result


def _finished_at(seen: Observed) -> float | None:
    record = seen.record
    if record is None or record["status"] not in TERMINAL:
        return None
    return record.get(f"{record['status']}_at") or record.get("updated_at")

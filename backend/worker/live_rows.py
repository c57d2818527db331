"""A scheduler's rows as a worker's heartbeat reports them (``backend.protocol``'s ``RunningRow``
and ``WaitingRow``): what the router and admission control replay the worker's slots from,
starvation-bound state included (a waiting row's wait so far, the rows due)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backend.protocol.messages import RunningRow, WaitingRow
from backend.worker.deadlines import waited_s

if TYPE_CHECKING:
    from backend.worker.batch_rows import Row


def _shared(row: Row) -> dict[str, Any]:
    """The fields both kinds of reported row carry."""
    return {
        "template": row.template,
        "adapters": list(row.adapters),
        "deadline": row.deadline,
        "priority": row.priority,
        "due": row.due,
    }


def running_row(row: Row) -> RunningRow:
    return RunningRow(row.job_id, row.mask_ratio, row.remaining_steps, **_shared(row))


def waiting_row(row: Row, now: float) -> WaitingRow:
    """``row`` as reported at ``now``: its wait counts up to then (queued or parked)."""
    return WaitingRow(
        row.job_id,
        row.mask_ratio,
        row.num_steps,
        step=row.step,
        waited_s=waited_s(row, now),
        **_shared(row),
    )

"""How far a batch got, from its items' job states: pure bookkeeping over dataclasses (no Redis).

An item is one job; its progress is 0 until it runs, ``step / num_steps`` while it denoises (at
most 0.99: post-processing is still ahead) and 1 once it finished (done, failed, cancelled) or
its record expired. The batch's progress is the mean over its items; its status:

* ``queued`` while no item has started (every item ``queued``);
* ``running`` while any item is unfinished and some item started or finished;
* once every item finished: ``done`` (all done), ``partial`` (some done, others not),
  ``failed`` (none done, some failed), ``cancelled`` (none done, none failed).

Invariants (tested): progress is within [0, 1], and 1 exactly when every item finished (a
redelivered or restarted item goes back to step 0, so progress may go down); an item's event
never changes another item; a finished item never changes again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from backend.protocol.records import TERMINAL

EXPIRED = "expired"  # an item whose job record is gone (retention): finished, result lost
FINISHED = (*TERMINAL, EXPIRED)
UNFINISHED_MAX = 0.99  # the most an unfinished item's progress shows
BATCH_STATES = ("queued", "running", "done", "partial", "failed", "cancelled")


@dataclass(frozen=True)
class ItemProgress:
    index: int
    job_id: str
    status: str = "queued"
    step: int = 0
    num_steps: int = 0
    message: str = ""

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def progress(self) -> float:
        if self.finished:
            return 1.0
        if self.status == "running" and self.num_steps > 0:
            # below 1 until it finished: post-processing is still ahead after the last step
            return min(UNFINISHED_MAX, max(0, self.step) / self.num_steps)
        return 0.0

    def after(self, event: dict[str, Any]) -> ItemProgress:
        """This item after one of its job's events (a dict as the job's event stream carries it).
        A finished item stays as it is: a job's first terminal status is its last."""
        if self.finished:
            return self
        status = event.get("status", self.status)
        step, num_steps = event.get("step", self.step), event.get("num_steps", self.num_steps)
        if status != "running":  # a step count is kept from running on; a restart resets it
            step = self.step if status in ("postprocessing", *TERMINAL) else 0
        return replace(
            self,
            status=status,
            step=int(step),
            num_steps=int(num_steps),
            message=event.get("message", self.message),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "job_id": self.job_id,
            "status": self.status,
            "step": self.step,
            "num_steps": self.num_steps,
            "progress": round(self.progress, 4),
            "message": self.message,
        }


def batch_status(statuses: Iterable[str]) -> str:
    """The batch's status from its items' (module docstring)."""
    seen = list(statuses)
    if not seen or all(status == "queued" for status in seen):
        return "queued"
    if any(status not in FINISHED for status in seen):
        return "running"
    if all(status == "done" for status in seen):
        return "done"
    if "done" in seen:
        return "partial"
    return "failed" if "failed" in seen else "cancelled"


def summary(items: Sequence[ItemProgress]) -> dict[str, Any]:
    """The batch as a whole: status, item counts by status, finished items and progress."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.status] = counts.get(item.status, 0) + 1
    progress = sum(item.progress for item in items) / len(items) if items else 1.0
    return {
        "status": batch_status(item.status for item in items),
        "total": len(items),
        "finished": sum(item.finished for item in items),
        "counts": counts,
        "progress": round(progress, 4),
    }


class BatchTracker:
    """A batch's items as its event stream follows them: ``apply`` one job's event, read the
    item it changed and the batch's ``summary``."""

    def __init__(self, items: Sequence[ItemProgress]):
        self.items = list(items)
        self._index = {item.job_id: item.index for item in self.items}

    def apply(self, job_id: str, event: dict[str, Any]) -> ItemProgress | None:
        """The item ``event`` changed (None when ``job_id`` is no item of this batch)."""
        index = self._index.get(job_id)
        if index is None:
            return None
        self.items[index] = self.items[index].after(event)
        return self.items[index]

    def index(self, job_id: str) -> int:
        """The index of the item ``job_id`` is (``KeyError`` for no item of this batch)."""
        return self._index[job_id]

    @property
    def finished(self) -> bool:
        return all(item.finished for item in self.items)

    def summary(self) -> dict[str, Any]:
        return summary(self.items)

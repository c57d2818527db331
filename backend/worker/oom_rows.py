"""The engine worker's rows when a step runs out of device memory: give memory back, retry the
forward's rows in halves, fail a row that does not fit even alone. A mixin of
``backend.worker.loop.EngineWorker`` (split out to keep each module small); it reads the worker's
``engine``, ``jobs``, ``memory``, ``stats``, ``scheduler`` and calls its ``_forward`` and
``_finish``. The rules are ``backend.worker.out_of_memory``'s.

Invariants: a row is never stepped twice in one step: a forward's rows are retried only while the
failed call left their states as they were (``step_progress``); a row failed here leaves like any
failed row (its recording aborted, its pins released, its job failed with the reason).
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from backend.engine.editor import EditState
from backend.worker.out_of_memory import after_oom, bytes_wanted, halves, oom_reason

if TYPE_CHECKING:
    from backend.worker.out_of_memory import StepOutcome

log = logging.getLogger(__name__)


def step_progress(state: EditState) -> tuple[int, int]:
    """What a step moves in a row's state: its step count and its recorded steps."""
    return state.step, len(state.recorded_latents)


class OutOfMemoryRows:
    """The out-of-memory side of ``EngineWorker`` (module docstring)."""

    def _after_oom(
        self,
        job_ids: list[str],
        progress: list[tuple[int, int]],
        error: str,
        outcome: StepOutcome,
        retried_alone: bool,
    ) -> tuple[list[str], float]:
        """The forward of ``job_ids`` ran out of memory (``error``; ``progress``: each row's
        ``step_progress`` before it): rows retried by ``after_oom``'s rule, or failed. The rows
        that stepped and the seconds of their forwards."""
        outcome.ran_out = True
        self.stats.oom_errors += 1
        freed = self._free_device_memory(error)
        moved = [j for j, p in zip(job_ids, progress) if step_progress(self.jobs[j].state) != p]
        if moved:  # a step taken in part cannot be taken again: these rows are lost
            log.error("out of memory after %s had moved: not retried (%s)", moved, error)
            self._fail_out_of_memory(job_ids)
            return [], 0.0
        action = after_oom(len(job_ids), freed, retried_alone)
        log.warning(
            "out of device memory stepping %d rows (%d bytes given back): %s",
            len(job_ids),
            freed,
            action,
            extra={"fields": {"event": "out_of_memory", "rows": len(job_ids), "action": action}},
        )
        if action == "fail":
            self._fail_out_of_memory(job_ids)
            return [], 0.0
        self.stats.oom_retried_rows += len(job_ids)
        if action == "retry":
            return self._forward(job_ids, outcome, retried_alone=True)
        stepped, forward_s = [], 0.0
        for half in halves(job_ids):
            ran, seconds = self._forward(half, outcome)
            stepped += ran
            forward_s += seconds
        return stepped, forward_s

    def _free_device_memory(self, error: str) -> int:
        """Give device memory back: the registered releasers, then the CUDA allocator's cached
        blocks; the bytes freed (as far as they can be counted)."""
        # the failed forward's frames may sit in reference cycles that still hold its activations
        gc.collect()
        freed = self.memory.release(bytes_wanted(error))
        device = torch.device(self.engine.adapter.device)
        if device.type == "cuda":
            reserved = torch.cuda.memory_reserved(device)
            torch.cuda.empty_cache()
            freed += max(0, reserved - torch.cuda.memory_reserved(device))
        return freed

    def _fail_out_of_memory(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            job = self.jobs[job_id]
            height, width = job.params.size
            self.stats.oom_failed_rows += 1
            self.scheduler.drop(job_id)
            self._finish(job_id, "failed", oom_reason(height, width, job.message.num_steps))

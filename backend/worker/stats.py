"""Per-step statistics of a worker loop (pure): step time, forward time, batching overhead, batch size.

Batching overhead of a step = the loop iteration's wall time minus the denoiser's forward time:
scheduling, admission, building and splitting the batch, per-row scheduler updates and events.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


@dataclass
class WorkerStats:
    step_s: list[float] = field(default_factory=list)
    forward_s: list[float] = field(default_factory=list)
    batch_rows: list[int] = field(default_factory=list)

    def record_step(self, num_rows: int, iteration_s: float, forward_s: float) -> None:
        self.step_s.append(iteration_s)
        self.forward_s.append(forward_s)
        self.batch_rows.append(num_rows)

    @property
    def overhead_s(self) -> list[float]:
        return [max(0.0, s - f) for s, f in zip(self.step_s, self.forward_s)]

    def snapshot(self) -> dict:
        steps = len(self.step_s)
        return {
            "steps": steps,
            "mean_step_s": sum(self.step_s) / steps if steps else 0.0,
            "mean_overhead_s": sum(self.overhead_s) / steps if steps else 0.0,
            "p50_overhead_s": percentile(self.overhead_s, 50),
            "mean_batch_rows": sum(self.batch_rows) / steps if steps else 0.0,
        }

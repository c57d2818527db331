"""What one edit's denoising will take, from a fitted cost profile: with the template's cache (the
loading plan the worker would pick) and as the ordinary pipeline (every token, every step), each
step's time outside the units (``CostProfile.step_rest``) added to both.

Pure: a profile and numbers in, seconds out. It is an estimate of an idle worker's denoising only
(no queue, no encode/decode); the studio shows it before a submit. Classifier-free guidance runs
two rows per step (the conditional and the unconditional half), as the engine does.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.costmodel.costs import CostProfile, RowWork
from backend.costmodel.plan import solve_plan

GUIDED_ABOVE = 1.0  # guidance above this runs the unconditional half too (diffusers' rule)


@dataclass(frozen=True)
class EditEstimate:
    """Seconds of denoising: ``cached_s`` with the template's cache, ``ordinary_s`` without.
    Invariant: 0 <= cached_s <= ordinary_s (the plan may always fall back to dense units)."""

    cached_s: float
    ordinary_s: float

    @property
    def speedup(self) -> float:
        return self.ordinary_s / self.cached_s if self.cached_s > 0 else 1.0


def estimate_edit(
    profile: CostProfile, mask_ratio: float, steps: int, guidance: float
) -> EditEstimate:
    """The estimate of one edit repainting ``mask_ratio`` (0..1] of the image in ``steps`` steps
    alone in a batch, its cache copied to the device at every step (the worst case: a template
    not yet resident)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    halves = 2 if guidance > GUIDED_ABOVE else 1
    rows = [RowWork(mask_ratio, "template", needs_load=True)] * halves
    costs = profile.unit_costs(rows)
    plan = solve_plan(costs, profile.stack_ids, monotone_within_stack=profile.mode == "kv")
    ordinary = sum(cost.compute_dense_s for cost in costs)
    rest = profile.rest_seconds(halves)  # the same either way: the cache spares units only
    return EditEstimate(
        cached_s=(min(plan.latency_s, ordinary) + rest) * steps,
        ordinary_s=(ordinary + rest) * steps,
    )

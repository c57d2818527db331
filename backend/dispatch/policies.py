"""Routing policies: one strategy object per policy, chosen by name from ``ROUTING_POLICIES``.

A policy only ranks the candidates the ``Router`` hands it (live workers serving the job's model,
with slack or, when all are full and queueing is allowed, the least loaded); it never decides
which workers are candidates nor what happens when none is. ``backend.dispatch.router``'s module
docstring defines each policy's cost.

Contract (tested over every entry of ``ROUTING_POLICIES``): ``choose`` returns one of the
candidates (a non-empty list sorted by worker id) with a cost for every candidate; a tie goes to
the smallest worker id, so a choice is a function of its inputs (and, for round_robin, of its last
choice); a policy with ``needs_cost_model`` is only asked when every candidate's device has one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from backend.costmodel.slack import NO_DEADLINE
from backend.dispatch.deadline_cost import choose_by_deadline

if TYPE_CHECKING:
    from backend.dispatch.router import JobRequest, RoutingCostModel, WorkerView

CostModelFor = Callable[[str, str], "RoutingCostModel | None"]  # (model id, device) -> model


@dataclass(frozen=True)
class Choice:
    worker_id: str
    costs: dict[str, float]  # candidate worker id -> the policy's cost (lower wins)
    why: str
    terms: dict[str, dict[str, float]] = field(default_factory=dict)  # the cost's terms


class RoutingPolicy(Protocol):
    needs_cost_model: bool

    def choose(
        self, job: JobRequest, candidates: Sequence[WorkerView], cost_model: CostModelFor
    ) -> Choice: ...


class _LowestCost(ABC):
    """The candidate with the lowest ``cost``; ties to the smallest worker id."""

    name = ""
    needs_cost_model = False

    @abstractmethod
    def cost(self, job: JobRequest, view: WorkerView, cost_model: CostModelFor) -> float: ...

    def choose(
        self, job: JobRequest, candidates: Sequence[WorkerView], cost_model: CostModelFor
    ) -> Choice:
        costs = {w.worker_id: self.cost(job, w, cost_model) for w in candidates}
        best = min(candidates, key=lambda w: (costs[w.worker_id], w.worker_id)).worker_id
        return Choice(best, costs, f"min {self.name} cost {costs[best]:.4g}")


class FewestRequests(_LowestCost):
    """Fewest running plus waiting rows."""

    name = "fewest_requests"

    def cost(self, job: JobRequest, view: WorkerView, cost_model: CostModelFor) -> float:
        return float(view.load)


class FewestTokens(_LowestCost):
    """Smallest sum of mask ratios over running and waiting rows (masked-token balancing)."""

    name = "fewest_tokens"

    def cost(self, job: JobRequest, view: WorkerView, cost_model: CostModelFor) -> float:
        return math.fsum(r.mask_ratio for r in (*view.running, *view.waiting))


class FlashPS(_LowestCost):
    """FlashPS Algorithm 2 as published (``RoutingCostModel.paper_cost``)."""

    name = "flashps"
    needs_cost_model = True

    def cost(self, job: JobRequest, view: WorkerView, cost_model: CostModelFor) -> float:
        return _model_of(job, view, cost_model).paper_cost(job, view)


class MaskAware:
    """Lowest estimated completion time (``RoutingCostModel.estimate``); says its terms. A job
    with a deadline: the least of it among the workers where it meets its deadline, else the
    least late (``backend.dispatch.deadline_cost``)."""

    needs_cost_model = True

    def choose(
        self, job: JobRequest, candidates: Sequence[WorkerView], cost_model: CostModelFor
    ) -> Choice:
        # T(J) shared by the estimates of this job on every candidate
        memo: dict[tuple[int, bool], float] = {}
        estimates = {
            w.worker_id: _model_of(job, w, cost_model).estimate(job, w, memo) for w in candidates
        }
        if job.deadline != NO_DEADLINE:
            best, costs, lead = choose_by_deadline(job, candidates, estimates)
        else:
            costs = {worker_id: est["total"] for worker_id, est in estimates.items()}
            best = min(candidates, key=lambda w: (costs[w.worker_id], w.worker_id)).worker_id
            lead = f"min estimated completion {estimates[best]['total']:.3f} s"
        terms = estimates[best]
        why = (
            f"{lead} (wait {terms['wait']:.3f} + run "
            f"{terms['run']:.3f} + residency {terms['residency']:.3f} + imposed "
            f"{terms['imposed']:.3f}"
            + (f" + adapters {terms['adapters']:.3f}" if job.adapters else "")
            + ")"
        )
        return Choice(best, costs, why, estimates)


class RoundRobin:
    """The next candidate by worker id after the last one chosen for the job's model."""

    needs_cost_model = False

    def __init__(self) -> None:
        self._last: dict[str, str] = {}  # model id -> worker id last chosen

    def choose(
        self, job: JobRequest, candidates: Sequence[WorkerView], cost_model: CostModelFor
    ) -> Choice:
        last = self._last.get(job.model_id)
        pick = next((w for w in candidates if last is None or w.worker_id > last), candidates[0])
        self._last[job.model_id] = pick.worker_id
        costs = {w.worker_id: float(i) for i, w in enumerate(candidates)}
        return Choice(pick.worker_id, costs, f"round_robin: next after {last}")


def _model_of(job: JobRequest, view: WorkerView, cost_model: CostModelFor) -> RoutingCostModel:
    model = cost_model(job.model_id, view.device)
    if model is None:
        raise LookupError(f"no cost model for {job.model_id} on {view.device}")
    return model


ROUTING_POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "mask_aware": MaskAware,
    "flashps": FlashPS,
    "round_robin": RoundRobin,
    "fewest_requests": FewestRequests,
    "fewest_tokens": FewestTokens,
}

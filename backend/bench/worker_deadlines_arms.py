"""The arms of `maskserve bench worker-deadlines`: the step schedulers and the slack scheduler's
variants, each as the ``Settings.deadlines`` it runs under and the serving worker's plan and step
clock built from them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.bench.route_deadlines_sim import ARMS as SCHEDULERS
from backend.config import Settings
from backend.config_deadlines import DeadlineSettings

if TYPE_CHECKING:  # the bench's module imports this one
    from backend.bench.worker_deadlines import WorkerDeadlineConfig

# the slack scheduler and its variants, by the ``Settings.deadlines`` each arm changes:
# ``noshrink`` never parks rows to make a batch smaller; ``nosize`` also fills every free slot;
# ``margin`` plans on the step clock's 0.9 quantile (``StepClock.margin``); ``everystep`` makes
# the users' forecast at every step, not every ``forecast_refresh_s``; ``parks2`` / ``parks8``
# set the churn bound (rows parked per round) to 2 / 8, whatever the deployment's default;
# ``nourgent`` parks for waiting rows at planning rounds only; ``anypark`` parks a row for any row
# that goes before it, whatever their deadlines (``park_by_deadline`` off); ``nokeep`` lets the
# next ready row take the slot of a row whose template's cache is being read
# (``keep_slot_while_reading`` off)
ABLATIONS: dict[str, dict[str, object]] = {
    "slack": {},
    "slack-noshrink": {"shrink_batches": False},
    "slack-nosize": {"size_batches": False, "shrink_batches": False},
    "slack-margin": {"plan_quantile": 0.9},
    "slack-everystep": {"forecast_refresh_s": 0.0},
    "slack-parks2": {"max_parks_per_round": 2},
    "slack-parks8": {"max_parks_per_round": 8},
    "slack-nourgent": {"urgent_parks": False},
    "slack-anypark": {"park_by_deadline": False},
    "slack-nokeep": {"keep_slot_while_reading": False},
}
ARMS = (*SCHEDULERS, *(arm for arm in ABLATIONS if arm not in SCHEDULERS))


def arm_deadlines(
    settings: Settings, cfg: WorkerDeadlineConfig, scheduler: str, max_wait_s: float
) -> DeadlineSettings:
    """The deadline settings of arm ``scheduler`` with this bench's bounds."""
    return settings.deadlines.model_copy(
        update={
            "scheduler": "slack" if scheduler in ABLATIONS else scheduler,
            "round_steps": cfg.round_steps,
            "max_wait_s": max_wait_s,
            "max_parks_per_round": cfg.max_parks_per_round,
            **ABLATIONS.get(scheduler, {}),
        }
    )


def arm_plan(settings: Settings, cfg: WorkerDeadlineConfig, deadlines: DeadlineSettings):
    """``worker.service.deadline_plan`` for an arm's ``deadlines`` (``arm_deadlines``) and this
    bench's model, with the serving worker's join rule on its clock: (plan, clock, rule)."""
    from backend.worker.service import deadline_plan  # the serving worker's (imports redis)

    engine = settings.engine.model_copy(update={"model_id": cfg.model_id})
    plan, clock = deadline_plan(
        settings.model_copy(update={"deadlines": deadlines, "engine": engine})
    )
    return plan, clock, clock.join_rule(settings.worker.join_when_it_pays)

"""Slack and precedence of jobs with deadlines: one definition shared by the engine worker's step
scheduler, the router and the API's admission control (pure: no torch, no redis, no clock).

* ``slack_s``: how long a row may still wait and meet its deadline, ``deadline - now -
  remaining_steps * step_s`` (``step_s``: the predicted time of one step of the batch it would run
  in). A job without a deadline (0) has infinite slack: it never displaces one that has one.
* ``last_step_by``: by when a job's last denoising step must end for the job to be done by its
  deadline, on a worker whose jobs take ``finish_tail_s`` after that step (the worker plans its
  rows against it, and the router and admission control rank a new job so).
* ``precedence``: the order in which rows claim a worker's slots, smaller first: rows past the
  starvation bound first (the longest waiting first), then higher priority, then least slack, then
  arrival order (FIFO among equals, so the order is total and stable).
* ``parks_for``: whether a running row may give its slot up for a row that goes before it: only
  for an earlier deadline.
"""

from __future__ import annotations

import math

NO_DEADLINE = 0.0
# the churn bound's default, rows a worker's planning round may park (``Settings.deadlines`` and
# the pure plans that stand for it): a whole default batch, so that a tight row joining a full
# batch on a device whose steps grow steeply with their rows can be put on time at once
DEFAULT_MAX_PARKS_PER_ROUND = 8
# the worker's step schedulers (``Settings.deadlines.scheduler``), as the router models them too
SCHEDULERS = ("fifo", "edf", "slack")
# A waiting row asks for a park only when fewer than this many rounds of slack are left: a row with
# more can wait for a later round (or a slot that frees by itself) and still be on time. Without
# this, least-slack-first parks running rows for fresh rows of the same deadline (a fresh row has
# more steps left, hence less slack) and the batch thrashes; two rounds leave one round of margin
# for step times that come out longer than predicted. The router's replay uses the same rule.
URGENT_ROUNDS = 2
# steps to spare when a row is due for the starvation bound (steps run longer than predicted): the
# worker marks rows due that far ahead, and the router's replay models it so
DUE_MARGIN_STEPS = 1


def slack_s(deadline: float, now: float, remaining_steps: int, step_s: float) -> float:
    """Seconds the row may wait and still finish by ``deadline``; inf without one, negative when it
    is already going to be late."""
    if deadline == NO_DEADLINE:
        return math.inf
    return deadline - now - max(0, remaining_steps) * step_s


def last_step_by(deadline: float, finish_tail_s: float) -> float:
    """``deadline`` less the worker's finish tail; no deadline stays none."""
    return deadline if deadline == NO_DEADLINE else deadline - max(0.0, finish_tail_s)


def precedence(
    *, starved: bool, waited_s: float, priority: int, slack: float, enqueued_at: float
) -> tuple[int, float, int, float, float]:
    """Sort key of a row (module docstring); ``waited_s`` only orders starved rows."""
    return (0 if starved else 1, -waited_s if starved else 0.0, -priority, slack, enqueued_at)


def parks_for(victim_deadline: float, deadline: float) -> bool:
    """Whether a running row due by ``victim_deadline`` may be parked for a row due by
    ``deadline`` when parks go by deadline (``deadlines.park_by_deadline``): only for an earlier
    one (a row without a deadline has the latest). Least slack alone would park a running row for
    a fresh row of the same class and a later deadline (more steps left, so less slack); in a
    burst every later arrival then pushes the parked row back, and it misses the deadline it was
    on time for."""
    later = math.inf if victim_deadline == NO_DEADLINE else victim_deadline
    return later > (math.inf if deadline == NO_DEADLINE else deadline)


def due_within_s(scheduler: str, round_steps: int, step_s: float) -> float:
    """How far ahead a worker finds a row due for the starvation bound, as a model of it (router,
    admission) takes it: its next planning round (``edf``: its next step) and
    ``DUE_MARGIN_STEPS`` more, at ``step_s`` a step."""
    steps = round_steps if scheduler == "slack" else 1
    return (steps + DUE_MARGIN_STEPS) * step_s


def comes_due(reported_due: bool, waited_s: float, within_s: float, max_wait_s: float) -> bool:
    """Whether a row a worker reported goes first for the starvation bound: the worker found it
    due, or its wait (``waited_s`` by now) passes ``max_wait_s`` within ``within_s``."""
    return reported_due or waited_s + within_s > max_wait_s

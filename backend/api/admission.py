"""Admission control in the API: an owner's own bound (``check_owner_queue``), and the
deployment's: ``AdmissionGate`` gathers what ``admission_control.decide`` needs from Redis, asks
it, and answers for the job service (429 for a class that sheds, late for one that does not).

Inputs, read per submission:

* the live workers serving the job's model (``protocol.heartbeats.live_heartbeats``), each with
  its running and waiting rows (deadline, priority, remaining steps) and its ``max_batch``;
* the jobs accepted and not running yet (``JobStateStore.unstarted``: the count for the queue bound,
  and the earliest deadlines among them; those of the job's model that no heartbeat lists yet are
  the forecast's unplaced jobs);
* the seconds of one step of each worker's batch with the job in it: the routing cost model of the
  model on the worker's device kind (``RoutingCostModel.step_latency`` from the shipped profile,
  ``paths.profiles_dir``, in ``engine.cache_mode``; loaded once per model and device, no torch),
  over its running rows then the waiting rows that fill its slots, plus the new job's row (a row
  whose template the worker's heartbeat lists on its device tier copies no cache, as routing
  reads it); without a profile, the worker's own measured mean step (``stats.mean_step_s`` in its
  heartbeat); without either, the worker is left out of the forecast. The new job's row: its mask
  ratio as the API sees it (``service_levels.mask_ratio_estimate``), reading a cache when it edits
  a gallery template with the cache on (gallery templates are the prepared ones), else computing
  densely (an upload is recorded on its first edit; a preparation records); its template's digest
  is not known yet (pre-processing computes it), so it is charged the copies of a RAM read.

Counters: ``maskserve_api_shed_total{class, reason}`` (429s) and
``maskserve_api_accepted_late_total{class}``; ``DeadlineCollector`` exports the deployment's
``maskserve_jobs_deadline_total{class, met}`` (done jobs with a deadline, counted by ``jobstate``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from backend.api.admission_control import Forecast, NewJob, Policy, Row, WorkerLoad, decide
from backend.api.checks import Overloaded, ServiceError
from backend.config import Settings
from backend.jobstate import TERMINAL, JobStateStore, deadline_counts
from backend.protocol import ServiceLevel, WorkerHeartbeat, to_text
from backend.protocol.heartbeats import live_heartbeats
from backend.protocol.keys import job_key

log = logging.getLogger(__name__)
NEW_JOB_TEMPLATE = "\0new job"  # the new job's template in a step estimate: shared with no row
JobRow = tuple[float, str, bool]  # (mask ratio, template, reads a cache), as step_latency takes


class AdmissionMetrics:
    """The API's admission counters, in the API's registry (its ``/metrics``)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        registry = registry if registry is not None else CollectorRegistry()
        self.shed = Counter(
            "maskserve_api_shed",
            "Jobs refused (429) by admission control, by service class and by the bound that "
            "refused them (deadline, queue)",
            ["class", "reason"],
            registry=registry,
        )
        self.accepted_late = Counter(
            "maskserve_api_accepted_late",
            "Jobs accepted though refused by a bound (their class does not shed): marked late",
            ["class"],
            registry=registry,
        )


class DeadlineCollector(Collector):
    """``maskserve_jobs_deadline_total{class, met}``: done jobs with a deadline, by whether their
    result was stored by it, read from Redis at scrape time (cluster-wide, like the job latency)."""

    def __init__(self, client):
        self.client = client

    def collect(self) -> Iterator:
        family = CounterMetricFamily(
            "maskserve_jobs_deadline",
            "Done jobs with a deadline, by service class and whether they met it (deadline "
            "attainment: met=true over all)",
            labels=["class", "met"],
        )
        try:
            counts = deadline_counts(self.client)
        except Exception as exc:  # Redis down: the other metrics are still served
            log.warning("deadline attainment not collected: %s", exc)
            counts = {}
        for (service_class, met), jobs in sorted(counts.items()):
            family.add_metric([service_class, "true" if met else "false"], float(jobs))
        yield family


class StepTimes:
    """Seconds of one step of a worker's batch with a new job in it (module docstring)."""

    def __init__(self, settings: Settings):
        self.profiles_dir, self.mode = settings.paths.profiles_dir, settings.engine.cache_mode
        self._models: dict[tuple[str, str], object | None] = {}

    def cost_model(self, model_id: str, device: str):
        from backend.costmodel.profiles import device_kind, load_profile

        key = (model_id, device_kind(device))
        if key not in self._models:
            from backend.dispatch.router import RoutingCostModel

            try:
                profile = load_profile(self.profiles_dir, model_id, key[1], self.mode)
                self._models[key] = RoutingCostModel.from_profile(profile)
            except (OSError, ValueError) as exc:
                log.info("admission: no cost profile for %s on %s (%s)", model_id, device, exc)
                self._models[key] = None
        return self._models[key]

    def step_s(self, beat: WorkerHeartbeat, job: JobRow) -> float:
        model = self.cost_model(beat.model_id, beat.device)
        if model is not None:
            rows: list[JobRow] = [
                (r.mask_ratio, r.template, bool(r.template)) for r in beat.running
            ]
            free = max(0, beat.max_batch - 1 - len(rows))
            rows += [(r.mask_ratio, r.template, bool(r.template)) for r in beat.waiting[:free]]
            on_device = frozenset(beat.resident_device)  # rows of these copy no cache
            return float(model.step_latency([*rows[: max(0, beat.max_batch - 1)], job], on_device))
        measured = beat.stats.get("mean_step_s", 0.0) if beat.stats.get("steps") else 0.0
        return float(measured) if isinstance(measured, int | float) else 0.0


def worker_load(beat: WorkerHeartbeat, step_s: float, now: float) -> WorkerLoad:
    """The worker's rows as admission control ranks them at ``now``: a waiting row goes on
    waiting after the heartbeat reported it."""
    since_beat = max(0.0, now - beat.at)
    running = tuple(
        Row(r.remaining_steps, r.deadline, r.priority, running=True, due=r.due)
        for r in beat.running
    )
    waiting = tuple(
        Row(
            max(0, r.num_steps - r.step),
            r.deadline,
            r.priority,
            due=r.due,
            waited_s=r.waited_s + since_beat,
        )
        for r in beat.waiting
    )
    return WorkerLoad(beat.worker_id, beat.max_batch, step_s, running + waiting, beat.finish_tail_s)


class AdmissionGate:
    def __init__(
        self,
        settings: Settings,
        client,
        jobstate: JobStateStore,
        registry: CollectorRegistry | None = None,
    ):
        self.settings, self.client, self.jobstate = settings, client, jobstate
        self.steps = StepTimes(settings)
        self.metrics = AdmissionMetrics(registry)

    def admit(
        self, level: ServiceLevel, model_id: str, steps: int, now: float, job: JobRow | None
    ) -> tuple[ServiceLevel, Forecast | None]:
        """The job's service level (``late`` set when it is accepted late) and its forecast;
        raises ``Overloaded`` when its class sheds and a bound refuses it. ``job``: its row for
        the step estimate; None for a job no worker runs (an erase: the queue bound only)."""
        d = self.settings.deadlines
        policy = Policy(
            d.late_factor,
            d.max_queue,
            tuple(d.shed_classes),
            d.scheduler,
            d.round_steps,
            d.max_wait_s,
        )
        queued, unstarted = self.jobstate.unstarted()
        loads: list[WorkerLoad] = []
        listed: set[str] = set()
        if job is not None:
            for beat in live_heartbeats(self.client).values():
                listed |= {r.job_id for r in beat.running} | {r.job_id for r in beat.waiting}
                if beat.model_id == model_id:
                    loads.append(worker_load(beat, self.steps.step_s(beat, job), now))
        unplaced = [
            Row(u.steps or steps, u.deadline, u.priority)
            for u in unstarted
            if u.model_id == model_id and u.job_id not in listed
        ]
        new = NewJob(level.service_class, level.deadline, level.priority, steps)
        verdict = decide(new, now, loads, unplaced, queued, policy)
        if not verdict.accept:
            self.metrics.shed.labels(level.service_class, verdict.reason).inc()
            detail: dict = {
                "reason": verdict.reason,
                "service_class": level.service_class,
                "retry_after_s": verdict.retry_after_s,
                "deadline_s": round(level.deadline - now, 3),
                "late_factor": d.late_factor,
                "queued": queued,
                "max_queue": d.max_queue,
            }
            if verdict.forecast is not None:
                detail["predicted_latency_s"] = round(verdict.forecast.finish - now, 3)
            raise Overloaded(verdict.message, verdict.retry_after_s, detail)
        if verdict.late:
            self.metrics.accepted_late.labels(level.service_class).inc()
            level = replace(level, late=True)
        return level, verdict.forecast


def check_owner_queue(client, history_index, owner: str, bound: int, adding: int = 1) -> None:
    """``too_many`` when ``owner``'s unfinished jobs (counted among its newest ``history_limit``
    jobs: the ones its history index holds) and the ``adding`` new ones would be more than
    ``bound`` (``api.max_queued_jobs``)."""
    if not bound or not owner:
        return
    with client.pipeline(transaction=False) as pipe:
        for job_id in history_index.job_ids(owner):
            pipe.hget(job_key(job_id), "status")
        statuses = [to_text(status) for status in pipe.execute() if status is not None]
    queued = sum(1 for status in statuses if status not in TERMINAL)
    if queued + adding > bound:
        asked = f", and this batch adds {adding}" if adding > 1 else ""
        raise ServiceError(
            f"{queued} of your jobs are queued or running{asked}, the bound is {bound}: wait for "
            "some to finish (or cancel some) before submitting more",
            "too_many",
        )

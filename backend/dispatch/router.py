"""Mask-aware request routing (FlashPS section 4.4, Algorithm 2) and its baselines. Pure Python.

Notation: worker W has ``max_batch`` B, running rows R (mask m, remaining steps s, template,
adapters), waiting rows Q (FIFO; mask, steps n, template, adapters), RAM / disk template sets and
device / host adapter sets (sha256). Job J has mask m_J, steps n_J, template t_J and LoRA adapters
A_J (sha256, bytes). T(X) is the per-step Algorithm-1 pipeline latency of batch X under W's cost
model (``RoutingCostModel.step_latency``); the loads of a template shared by rows are paid once.

Policies (``POLICIES``):

* ``flashps`` -- the paper's Algorithm 2: cost = T(R + J) * n_J, every row with a template read
  as cached and resident in host RAM (the paper's assumption); R includes the waiting rows that
  fill free slots at the next step (the paper's scheduler puts a dispatched job straight into the
  running batch); no queue, residency or remaining-steps terms.
* ``mask_aware`` -- the estimated completion time of J on W, plus, when J computes densely,
  the time it costs its co-runners: ``cost = wait + run + residency + imposed + adapters``:

  - residency of a row (for T): a template in W's RAM or disk is *cached* (masked compute plus the
    host->device copy of its unit caches each step); a template in W's device tier is cached with
    no copy (masked compute only: its loads are 0 and it is left out of a step's load count); a
    template in none of them is *recorded*: the row runs densely (all tokens, no copy). ``""``
    (no cache) is dense too. J's template also counts as in RAM when a row already on W uses it
    (that row brought it there).
  - admission: slots are replayed at step granularity: running rows free their slot after s
    steps, waiting rows take freed slots in FIFO order and hold them n steps; J is admitted at
    step a_J = 0 when a slot is free, else when the first slot frees. Co-runners C = the rows
    whose slot outlives a_J, each overlapping J for o_r = min(f_r - a_J, n_J) steps.
  - ``wait = a_J * T(R + the waiting rows admitted at the next step)``.
  - ``run = n_J * (T(J) + phi * (T(C + J) - T(J)))`` where ``phi = sum w_r o_r / (n_J sum w_r)``
    and w_r is row r's share of a step (seconds, from the fitted lines): its masked compute plus
    its template's cache loads split among the co-runners reading that template. The batch's
    extra latency shrinks as co-runners retire (remaining steps), weighted by how heavy each one
    is. phi = 1 when every co-runner outlives J, which gives the paper's ``n_J * T(R + J)``.
  - ``residency``, the time J is held in W's queue with its slot free (the worker's
    prefetch-gated admission, ``backend.worker.loop``: a row joins only once its cache can be
    acquired without waiting, so no read ever stalls the batch; J alone waits):
    ``max(0, pending + disk_read_s - wait)`` when t_J is only on W's disk: one read of the
    template's trajectory cache (n_J steps of unit caches, ``disk_read_s_per_byte`` per byte,
    default 1e-9 = 1 GB/s, a local NVMe/SSD order of magnitude) that W prefetches while J waits, one
    read at a time, so after ``pending``, the reads of the templates its waiting rows have only on
    disk (each once; one on W's device is not read). When t_J is in no tier of W but a running row
    of W has it (that row is recording it: a worker records a template once and holds its other rows
    until the commit, which loads the entry into RAM), J runs cached after
    ``max(0, r_rec * T(first batch) + disk_read_s - wait)``, r_rec the recorder's remaining steps
    (route to the recorder, rather than recording it again elsewhere). 0 for RAM (its copies are
    inside T), for the device tier (no copy) and for a recording (its dense compute is).
  - ``imposed = (T(C + J) - T(C)) * sum o_r`` when J runs densely (it records its template, or has
    none), else 0: the delay J's dense row adds to each co-runner's overlapping steps. A recording
    costs a step several cached rows' worth, so the rows beside it lose more than it waits itself.
    Charged for dense J only: for a cached J the same term (a weighted co-runner delay for every
    job) made P95 worse in the route simulation.

  - ``adapters``, loading J's LoRA adapters where W does not hold them, less what J's time in
    W's queue and its first K steps hide (``backend.dispatch.adapter_cost``: tiers, rates and
    the exact formula); 0 for a job without adapters.

  Invariants (tested): every term is >= 0; T(J) <= run / n_J <= T(C + J); more steps, a larger mask
  for J or one more running row (that applies none of A_J) never lower a cost; for one worker state
  t_J on the device <= in RAM (< when its copies show in T), RAM <= disk and RAM <= absent, and disk
  <= absent whenever recomputing densely costs more than the disk read (every shipped profile with a
  positive compute slope). The recording's cache write is not charged. Adapters: the term is 0
  without adapters and at most the whole load (reads + copies); it is 0 when the load fits in K
  steps of T(J); moving one adapter of A_J to a cheaper tier (disk -> arriving -> host -> device) or
  making any adapter smaller never raises a cost; the term can only lower what ``wait + residency``
  add (each second of queueing hides at most one second of reads), so the invariants above still
  hold.
* ``fewest_requests`` -- min len(R) + len(Q); ``fewest_tokens`` -- min sum of mask ratios over
  R + Q (masked-token balancing, as LLM routers balance tokens); ``round_robin`` -- the next
  candidate by worker id after the last one chosen for this model.

Each policy is a strategy object (``backend.dispatch.policies.ROUTING_POLICIES``); the ``Router``
picks the candidates and hands them to it. Before it asks the policy, an item of a batch (a job
with a ``batch_id``) goes to its batch's worker when that worker is a candidate
(``backend.dispatch.groups``: one template cache load, one running batch); the decision's policy
is then ``batch_affinity``.

Candidates are live workers serving J's model with slack (len(R) + len(Q) < B + ``queue_depth``,
default 0). When none has slack and ``allow_queueing`` (default True), a job waits in a worker's
queue rather than being rejected: the candidates become the least-loaded serving workers (fewest
rows) and the policy chooses among them (mask_aware then also weighs their queues; for a job with
a deadline every serving worker, since one that orders by deadline lets J pass looser rows, and
``backend.dispatch.deadline_cost`` chooses: on time at least cost, else least late; "on time" is
J's last step by its deadline less W's finish tail, ``planned_on``). Without it
(late binding, ``DispatcherSettings.late_binding``) the decision is None and the dispatcher holds
the job (FIFO) until a worker has slack. Every tie goes to the smallest worker id, so a decision
is a function of its inputs (and, for round_robin, of the last choice).

Cost model: each distinct unit shape's per-token FLOPs, intercepts and per-template load are
precomputed once, so a batch's unit costs are a few sums (FLOPs are linear in masked tokens; exact,
tested against ``batch_unit_costs``); plans use the paper's greedy Algorithm 1 in floats, which
equals the exact ``solve_plan`` on every shipped profile over random batches (tested: there the
loads are far below compute, so caching every unit is both the greedy choice and the optimum);
``planner="exact"`` keeps the exact solver for checks.
A fitted compute or load slope below 0 (noise in a tiny profile, e.g. tiny-flux-fill R^2 0.14)
is clamped to 0 here, so more work never costs less.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from backend.costmodel.costs import CostProfile, LinearModel, RowWork, batch_unit_costs, unit_flops
from backend.costmodel.plan import solve_plan
from backend.costmodel.profiles import all_profiles, device_kind
from backend.dispatch.adapter_cost import DEFAULT_ADAPTER_JOIN_BY, AdapterLoads
from backend.dispatch.adapter_cost import AdapterNeed as AdapterNeed
from backend.dispatch.deadline_cost import (
    FIFO,
    JOB,
    deadlines_matter,
    finish_terms,
    replay,
    row_order,
    sizing_hold,
)
from backend.dispatch.deadline_cost import RowOrder as RowOrder
from backend.dispatch.groups import BatchAffinity
from backend.dispatch.policies import ROUTING_POLICIES
from backend.dispatch.views import Decision as Decision
from backend.dispatch.views import JobRequest as JobRequest
from backend.dispatch.views import RowState as RowState
from backend.dispatch.views import WorkerView as WorkerView
from backend.dispatch.views import adapter_residency as adapter_residency
from backend.dispatch.views import default_rows_per_request as default_rows_per_request
from backend.dispatch.views import planned_on
from backend.dispatch.views import view_from_heartbeat as view_from_heartbeat
from backend.dispatch.views import waiting_note as waiting_note

POLICIES = tuple(ROUTING_POLICIES)  # names, as the CLI and settings spell them
FALLBACK_POLICY = "fewest_requests"  # for a policy that needs a cost model a device lacks
DEFAULT_DISK_READ_S_PER_BYTE = 1e-9  # 1 GB/s
PLANNERS = ("greedy", "exact")
AFFINITY = "batch_affinity"  # a decision's policy when a batch's item went to its batch's worker


class RoutingCostModel:
    """Per-step batch latency and job completion estimates of one model on one device kind.

    A row is ``(mask_ratio, template, cached)``; ``cached=False`` computes densely and loads
    nothing; a cached row whose template is in the worker's device tier (``on_device``) computes
    masked and loads nothing either.
    """

    def __init__(
        self,
        profile: CostProfile,
        disk_read_s_per_byte: float = DEFAULT_DISK_READ_S_PER_BYTE,
        rows_per_request: int | None = None,
        planner: str = "greedy",
        adapter_copy_s_per_byte: float | None = None,
        adapter_read_s_per_byte: float | None = None,
        adapter_join_by: float = DEFAULT_ADAPTER_JOIN_BY,
    ):
        if planner not in PLANNERS:
            raise ValueError(f"planner must be one of {PLANNERS}, got {planner!r}")
        if not profile.units or not disk_read_s_per_byte >= 0:
            raise ValueError(
                f"{profile.model_id}: a cost model needs units and disk_read_s_per_byte >= 0"
            )
        self.profile, self.planner = profile, planner
        self.model_id, self.device = profile.model_id, device_kind(profile.device)
        self.disk_read_s_per_byte = float(disk_read_s_per_byte)
        self.adapter_loads = AdapterLoads.fitted(
            profile.load.slope,
            self.disk_read_s_per_byte,
            adapter_copy_s_per_byte,
            adapter_read_s_per_byte,
            adapter_join_by,
        )
        self.rows_per_request = rows_per_request or default_rows_per_request(profile.model_id)
        self.monotone = profile.mode == "kv"
        self._cslope, self._cicpt = max(0.0, profile.compute.slope), profile.compute.intercept
        shapes: dict[tuple[int, int, int, float, int], int] = {}
        # per unit shape: (tokens, FLOPs per masked query, text FLOPs, cache load seconds)
        groups: list[tuple[int, float, float, float]] = []
        seq: list[tuple[int, bool]] = []  # per unit: (shape index, same stack as the one before)
        prev: int | None = None
        for unit in profile.units:
            key = (
                unit.num_tokens,
                unit.hidden_dim,
                unit.num_text_tokens,
                unit.ffn_mult,
                unit.cache_bytes,
            )
            if key not in shapes:
                shapes[key] = len(groups)
                text = unit_flops(unit, 0, dense=False)  # the text tokens' K/V projections
                per_query = unit_flops(unit, 1, dense=False) - text
                load = (
                    max(
                        0.0,
                        max(0.0, profile.load.slope) * unit.cache_bytes + profile.load.intercept,
                    )
                    if unit.cache_bytes > 0
                    else 0.0
                )
                groups.append((unit.num_tokens, per_query, text, load))
            seq.append((shapes[key], prev is not None and unit.stack_id == prev))
            prev = unit.stack_id
        self._groups, self._seq = groups, seq
        self._runs: list[list[Any]] = []  # [group, length, same stack as the unit before]
        for g, same in seq:
            if self._runs and same and self._runs[-1][0] == g:
                self._runs[-1][1] += 1
            else:
                self._runs.append([g, 1, same])
        counts, rpr = (
            [sum(1 for g, _ in seq if g == i) for i in range(len(groups))],
            self.rows_per_request,
        )
        self._ntoks = tuple(g[0] for g in groups)
        self._wcoef = tuple((rpr * c * g[1], rpr * c * g[2]) for c, g in zip(counts, groups))
        # one template's loads per step, per shape
        self._gload = tuple(c * g[3] for c, g in zip(counts, groups))
        self.step_cache_bytes = sum(u.cache_bytes for u in profile.units)
        self._rows: dict[tuple[float, bool], tuple[tuple[int, ...], float, float]] = {}

    @classmethod
    def from_profile(cls, profile: CostProfile, **kwargs: Any) -> RoutingCostModel:
        # kwargs: disk_read_s_per_byte, rows_per_request, planner, adapter_* (the constructor's)
        return cls(profile, **kwargs)

    # ----- one batch ----------------------------------------------------------------------------
    def _row(self, ratio: float, cached: bool) -> tuple[tuple[int, ...], float, float]:
        """(masked tokens per unit shape, compute weight per step (FLOPs), its template's cache
        loads per step (s)) of one request, memoised. Tokens as ``tokens_for_ratio`` (inlined:
        this runs for every row of every decision)."""
        hit = self._rows.get((ratio, cached))
        if hit is not None:
            return hit
        if len(self._rows) > 65536:
            self._rows.clear()
        toks = self._ntoks
        if cached:
            r = 1.0 if ratio > 1.0 else (0.0 if ratio < 0.0 else ratio)
            toks = tuple([min(n, max(0, math.ceil(r * n - 1e-9))) for n in toks])
        if len(toks) == 1:  # one unit shape (Flux): skip the generic sums
            weight = toks[0] * self._wcoef[0][0] + self._wcoef[0][1]
            load = self._gload[0] if cached and toks[0] < self._ntoks[0] else 0.0
        else:
            weight = sum([t * a + b for t, (a, b) in zip(toks, self._wcoef)])
            load = (
                sum([ld for t, n, ld in zip(toks, self._ntoks, self._gload) if t < n])
                if cached
                else 0.0
            )
        row = self._rows[(ratio, cached)] = (toks, weight, load)
        return row

    def _latency(
        self,
        toks: Sequence[tuple[int, ...]],
        tmpls: Sequence[str | None],
        on_device: AbstractSet[str] = frozenset(),
    ) -> float:
        """Pipeline latency of prepared rows: tokens per shape, template (None: dense, no copy);
        a template in ``on_device`` is read where it lies (masked compute, no copy)."""
        if not toks:
            return 0.0
        if self.planner == "exact":
            return self._exact(toks, tmpls, on_device)
        rpr, slope, icpt = self.rows_per_request, self._cslope, self._cicpt
        n = len(toks) * rpr
        costs = []
        for g, (num_tokens, per_query, text, load) in enumerate(self._groups):
            masked = sum([t[g] for t in toks])
            templates = (
                len(
                    {
                        m
                        for t, m in zip(toks, tmpls)
                        if m is not None and m not in on_device and t[g] < num_tokens
                    }
                )
                if load
                else 0
            )
            compute_cached = slope * (rpr * masked * per_query + n * text) + icpt
            compute_dense = slope * n * (num_tokens * per_query + text) + icpt
            costs.append((max(0.0, compute_cached), max(0.0, compute_dense), templates * load))
        compute_end = load_end = 0.0  # when the compute stream and the load stream are free
        prev_cached, monotone = False, self.monotone
        for g, k, cont in self._runs:  # runs of identical units in one stack
            compute_cached, compute_dense, unit_load = costs[g]
            forced = monotone and cont and prev_cached
            while k:
                if forced:  # k identical cached units at once: max-plus closed form
                    compute_end = max(
                        compute_end + k * compute_cached,
                        load_end
                        + max(unit_load + k * compute_cached, k * unit_load + compute_cached),
                    )
                    load_end, prev_cached, k = load_end + k * unit_load, True, 0
                    break
                loaded_at = load_end + unit_load
                cached_end = max(loaded_at, compute_end) + compute_cached
                # Algorithm 1: cache when that finishes the unit no later
                if cached_end <= compute_end + compute_dense:
                    compute_end, load_end, prev_cached, forced = (
                        cached_end,
                        loaded_at,
                        True,
                        monotone,
                    )
                else:
                    compute_end, prev_cached = compute_end + compute_dense, False
                k -= 1
        return compute_end

    def _exact(
        self,
        toks: Sequence[tuple[int, ...]],
        tmpls: Sequence[str | None],
        on_device: AbstractSet[str] = frozenset(),
    ) -> float:
        """Reference: ``solve_plan`` over ``batch_unit_costs`` (slopes clamped as above)."""
        p = self.profile
        profile = replace(
            p,
            compute=LinearModel(self._cslope, p.compute.intercept, p.compute.r2),
            load=LinearModel(max(0.0, p.load.slope), p.load.intercept, p.load.r2),
        )
        work = [
            RowWork(
                {u.stack_id: row_tokens[g] for u, (g, _) in zip(p.units, self._seq)},
                template or f"dense{i}",
                needs_load=template is not None and template not in on_device,
            )
            for i, (row_tokens, template) in enumerate(zip(toks, tmpls))
            for _ in range(self.rows_per_request)
        ]
        if len({u.stack_id for u in p.units}) != len({(u.stack_id, u.num_tokens) for u in p.units}):
            raise ValueError("planner='exact' needs one token grid per stack")
        costs = batch_unit_costs(profile, work)
        return solve_plan(costs, p.stack_ids, monotone_within_stack=self.monotone).latency_s

    def step_latency(
        self, rows: Sequence[tuple[float, str, bool]], on_device: AbstractSet[str] = frozenset()
    ) -> float:
        """Seconds of one denoising step of a batch of requests ``(mask_ratio, template,
        cached)``; a cached row whose template is in ``on_device`` (the worker's device tier)
        copies nothing."""
        return self._latency(
            [self._row(m, c)[0] for m, _, c in rows],
            [t if c else None for _, t, c in rows],
            on_device,
        )

    def disk_read_s(self, num_steps: int) -> float:
        """One read of a template's trajectory cache (``num_steps`` steps of unit caches) from
        disk."""
        return self.disk_read_s_per_byte * self.step_cache_bytes * num_steps

    # ----- one job on one worker --------------------------------------------------------------
    def paper_cost(self, job: JobRequest, view: WorkerView) -> float:
        """FlashPS Algorithm 2: T(running batch + J) with every cached template in RAM, times n_J.
        The running batch includes the waiting rows that join it at the next step (dispatched)."""
        rows: tuple[RowState | JobRequest, ...] = (
            *view.running,
            *view.waiting[: max(0, view.max_batch - len(view.running))],
            job,
        )
        return (
            self._latency(
                [self._row(r.mask_ratio, bool(r.template))[0] for r in rows],
                [r.template or None for r in rows],
            )
            * job.num_steps
        )

    def tier(self, template: str, view: WorkerView) -> str:
        """W's fastest tier holding ``template``: 'device' (read where it lies, no copy), 'ram',
        'disk'; 'absent' (the row records densely) or 'none' (no template: dense)."""
        if not template:
            return "none"
        for name, held in (
            ("device", view.resident_device),
            ("ram", view.resident_ram),
            ("disk", view.resident_disk),
        ):
            if template in held:
                return name
        return "absent"

    def estimate(
        self, job: JobRequest, view: WorkerView, memo: dict[Any, Any] | None = None
    ) -> dict[str, float]:
        """Completion-time estimate of ``job`` on ``view`` (module docstring): wait, run, residency,
        total. ``memo``: a dict shared by the estimates of one job on several workers (T(J)
        reuse). The finish and lateness are of J's last step, against its deadline less W's
        finish tail (``planned_on``)."""
        job = planned_on(job, view)
        on_device = view.resident_device  # read where they lie: no loads, in T or in a share
        latency = partial(self._latency, on_device=on_device)
        cached = {
            r.template
            for r in (*view.running, *view.waiting)
            if self.tier(r.template, view) in ("device", "ram", "disk")
        }
        toks, weights, loads, tmpls = [], [], [], []
        for r in (*view.running, *view.waiting):
            reads_cache = r.template in cached
            row_tokens, weight, load = self._row(r.mask_ratio, reads_cache)
            toks.append(row_tokens)
            weights.append(weight)
            loads.append(0.0 if r.template in on_device else load)
            tmpls.append(r.template if reads_cache else None)
        finish = [max(0, r.remaining_steps) for r in view.running]
        tier = self.tier(job.template, view)
        if tier == "disk" and job.template in cached:
            tier = "ram"  # a row already on W brought it there
        # a running row recording t_J (t_J in no tier of W): J waits for that cache, then reads it
        recorder = (
            min(
                (max(0, r.remaining_steps) for r in view.running if r.template == job.template),
                default=None,
            )
            if tier == "absent"
            else None
        )
        job_cached = tier in ("device", "ram", "disk") or recorder is not None
        job_tokens = self._row(job.mask_ratio, job_cached)[0]
        job_template = job.template if job_cached else None
        cap, n = max(1, view.max_batch), max(1, job.num_steps)
        order = list(range(len(finish), len(toks))) + [JOB]  # fifo: J after every waiting row
        by, slack, step_s, unparkable, hold, deadlines = FIFO, None, 0.0, [], 0, None
        if deadlines_matter(job, view):  # W orders its rows by deadline: by T with J in its batch
            step_s = latency(toks[:cap] + [job_tokens], tmpls[:cap] + [job_template])
            (order, slack), by = row_order(job, view, step_s), view.order
            # W parks neither a row recording its template's cache nor one due for the bound
            unparkable = [
                i for i, r in enumerate(view.running) if (r.template and not tmpls[i]) or r.due
            ]
            hold = sizing_hold(job, view, step_s, lambda i: latency([toks[i]], [tmpls[i]]))
            rows = (*view.running, *view.waiting)
            deadlines = {JOB: job.deadline, **{i: r.deadline for i, r in enumerate(rows)}}
        steps = finish + [max(0, r.remaining_steps) for r in view.waiting]
        slots = replay(
            steps, len(finish), order, n, cap, by, slack, step_s, unparkable, hold, deadlines
        )
        admit, wait, t_first, first = slots.admit, 0.0, 0.0, slots.first
        if admit > 0 or recorder is not None:
            t_first = latency([toks[i] for i in first], [tmpls[i] for i in first])
        wait = admit * t_first
        co_runners = list(slots.co_runners)  # (steps overlapping J, row index)
        memo = {} if memo is None else memo
        key = (id(self), job_cached, tier == "device")  # T(J) differs by J's copies only
        t_job = memo.get(key)
        if t_job is None:
            t_job = memo[key] = latency([job_tokens], [job_template])
        run, imposed = n * t_job, 0.0
        if co_runners:
            co_toks = [toks[i] for _, i in co_runners]
            co_tmpls = [tmpls[i] for _, i in co_runners]
            t_full = max(t_job, latency(co_toks + [job_tokens], co_tmpls + [job_template]))
            # a co-runner's share of a step: its compute, plus its template's loads split among
            # the co-runners reading it (dense rows load nothing)
            readers: dict[str | None, int] = {}
            for _, i in co_runners:
                readers[tmpls[i]] = readers.get(tmpls[i], 0) + 1
            compute_slope = self._cslope
            share = [
                (overlap, weights[i] * compute_slope + loads[i] / readers[tmpls[i]])
                for overlap, i in co_runners
            ]
            total_w = sum([w for _, w in share])
            phi = sum([o * w for o, w in share]) / (n * total_w) if total_w > 0 else 1.0
            run = n * (t_job + phi * (t_full - t_job))
            if not job_cached:  # J records: what it costs its co-runners dwarfs its own wait
                slowdown = max(0.0, t_full - latency(co_toks, co_tmpls))
                imposed = slowdown * sum([overlap for overlap, _ in co_runners])
        residency = 0.0
        if tier == "disk":
            # W reads one template at a time: those its waiting rows prefetch come first
            pending, seen = 0.0, set()
            for r in view.waiting:
                t = r.template
                if t not in seen and self.tier(t, view) == "disk":
                    seen.add(t)
                    pending += self.disk_read_s(max(1, r.remaining_steps))
            residency = max(0.0, pending + self.disk_read_s(n) - wait)  # held until it lands
        elif recorder is not None:  # held until W's recording of t_J is committed and read into RAM
            residency = max(0.0, recorder * t_first + self.disk_read_s(n) - wait)
        adapters = 0.0
        if job.adapters:
            where = adapter_residency(view)
            adapters = self.adapter_loads.cost(job.adapters, where, wait + residency, t_job, n)
        terms = {
            "wait": wait,
            "run": run,
            "residency": residency,
            "imposed": imposed,
            "adapters": adapters,
            "total": wait + run + residency + imposed + adapters,
            "admit_step": float(admit),
            "ahead": float(slots.ahead),
            "parked": float(slots.parked),
        }
        return terms | finish_terms(job, terms)


def load_cost_models(
    profiles_dir: Path, mode: str = "kv", **kwargs: Any
) -> dict[tuple[str, str], RoutingCostModel]:
    """A cost model per (model_id, device kind) from every ``*__{mode}.json`` profile in
    ``profiles_dir``."""
    models = {}
    for profile in all_profiles(profiles_dir, mode):
        model = RoutingCostModel.from_profile(profile, **kwargs)
        models[(model.model_id, model.device)] = model
    return models


class Router:
    """Chooses a worker per job (module docstring): picks the candidates and hands them to the
    policy's strategy object; holds state only through it (round-robin positions)."""

    def __init__(
        self,
        policy: str,
        cost_models: Mapping[tuple[str, str], RoutingCostModel] | None = None,
        default_cost_model: RoutingCostModel | None = None,
        allow_queueing: bool = True,
        queue_depth: int = 0,
    ):
        if queue_depth < 0:
            raise ValueError(f"queue_depth must be >= 0, got {queue_depth}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(
                f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}"
            )
        self.policy, self.allow_queueing = policy, allow_queueing
        self.default_cost_model = default_cost_model
        # waiting rows a worker may hold beyond max_batch and still have slack
        self.queue_depth = queue_depth
        self.cost_models = {(m, device_kind(d)): cm for (m, d), cm in (cost_models or {}).items()}
        self._strategy = ROUTING_POLICIES[policy]()
        self._fallback = ROUTING_POLICIES[FALLBACK_POLICY]()
        self.affinity = BatchAffinity()  # a batch's items go to its worker (dispatch.groups)

    def cost_model(self, model_id: str, device: str) -> RoutingCostModel | None:
        return self.cost_models.get((model_id, device_kind(device)), self.default_cost_model)

    def choose(self, job: JobRequest, workers: Sequence[WorkerView]) -> Decision:
        serving = sorted(
            (w for w in workers if w.model_id == job.model_id), key=lambda w: w.worker_id
        )
        if not serving:
            return Decision(None, self.policy, f"no live worker serves {job.model_id}", {})
        candidates, note = [w for w in serving if w.slack + self.queue_depth > 0], ""
        if not candidates:
            if not self.allow_queueing:
                return Decision(
                    None, self.policy, f"every worker serving {job.model_id} is full", {}
                )
            fewest = min(w.load for w in serving)
            candidates = [w for w in serving if w.load == fewest]
            note = f"; all full, queued on the least loaded ({fewest} rows)"
            if job.deadline and self._strategy.needs_cost_model:
                # the fewest rows is not the soonest start: a worker that orders by deadline
                # lets J pass its looser rows (deadline_cost); J's finish decides among all
                candidates, note = serving, "; all full, queued where it finishes in time"
        home = self.affinity.home(job.batch_id, [w.worker_id for w in candidates], job.now)
        if home is not None:  # the batch's earlier items are there: one cache load, one batch
            self.affinity.routed(job.batch_id, home, job.now)
            reason = f"{AFFINITY}: its batch's worker among {len(candidates)} candidate(s){note}"
            return Decision(home, AFFINITY, reason, {home: 0.0})
        policy, strategy = self.policy, self._strategy
        if strategy.needs_cost_model:
            missing = sorted(
                {
                    device_kind(w.device)
                    for w in candidates
                    if self.cost_model(job.model_id, w.device) is None
                }
            )
            if missing:
                policy, strategy = FALLBACK_POLICY, self._fallback
                note += (
                    f"; no cost model for {job.model_id} on {', '.join(missing)}: fell back to "
                    f"{FALLBACK_POLICY}"
                )
        choice = strategy.choose(job, candidates, self.cost_model)
        self.affinity.routed(job.batch_id, choice.worker_id, job.now)
        reason = f"{choice.why} among {len(candidates)} candidate(s){note}"
        return Decision(choice.worker_id, policy, reason, choice.costs, choice.terms)

"""Step-level batch scheduler: a pure state machine (no torch, no I/O), after vLLM v1's scheduler.

Each worker iteration calls ``schedule(now)``, which retires cancelled rows, admits waiting rows and
returns the forward passes to run this step; after running them the worker calls
``update_from_output(stepped)``, which advances every stepped row by one step and retires finished
ones. Modes:

* ``continuous`` (default): waiting rows join the running batch at every step while slots are free;
* ``static``: a batch is formed only when the previous one has completely finished;
* ``inline``: admission as ``continuous``; the worker also runs pre/post-processing in its own loop;
* ``baseline``: as ``static``, and a batch holds only rows of one group key, the oldest waiting
  row's (the baseline worker runs the whole batch in one ordinary pipeline call, which shares size,
  steps, strength and guidance); rows of other keys keep their places for a later batch.

Joining when it pays: with a ``join_rule`` (the worker's ``StepClock.joining_pays``), in
``continuous`` and ``inline`` modes a waiting row takes a free slot beside running rows only when
the rule says that lowers the rows' mean latency (``costmodel.batch_gain``); otherwise the slot
counts as taken (``SchedulerOutput.not_paying``): FIFO stops there, the deadline schedulers treat
the batch as full (the row may still park a running row by the rules below) and a due row joins
anyway. An empty batch always takes the next row.

Prefetch-gated admission: ``schedule(now, ready)`` admits a waiting row only when ``ready(row)``
says so (the engine worker and the route simulation's workers both answer with
``backend.worker.admission.AdmissionRules``). A row that is not ready keeps its place at the head
of the queue while rows behind it take the free slots (``SchedulerOutput.held``); it joins at the
first step after it becomes ready. No read ever stalls the running batch (FlashPS's bubble-free
serving).

Deadlines (``backend.worker.deadlines.DeadlinePlan``; none, or ``fifo``, is arrival order as above).
In ``continuous`` and ``inline`` modes (``static`` and ``baseline`` stay FIFO: they are the
baselines compared against):

* ``edf``: waiting rows take free slots in ``precedence`` order (starved first, then priority,
  then least slack, then arrival: ``backend.costmodel.slack``); a running row keeps its slot;
* ``slack`` (after TetriServe): as ``edf`` at every step, and with ``size_batches`` a waiting row
  is kept out of a free slot (``SchedulerOutput.deferred``) while joining would lengthen the
  batch's steps so much that a running row which goes before it misses its deadline
  (``deadlines.delays_a_tighter_row``); and every ``round_steps`` steps a
  planning round ranks running and waiting rows together, slack priced at the step time of the
  batch as it would be, and parks running rows that fall out of the first ``max_batch`` so that
  tighter waiting rows get their slots. A parked row leaves the batch at a step boundary
  (``SchedulerOutput.parked``: the worker keeps its latents, scheduler state and cache pins),
  keeps its ``step`` and waits in the queue; it resumes like any waiting row
  (``ready`` is asked again; ``SchedulerOutput.resumed``) and runs its remaining steps only.
  With ``shrink_batches``, at any step, a running row that is late at the batch's step time and
  would be on time in a smaller batch has rows with slack to spare parked for it, the loosest
  first (``deadlines.rows_to_park_for``: only rows it precedes, that may be parked by the rules
  below, and that keep two rounds of slack after sitting out its remaining steps); they wait
  as kept-out rows until ``size_batches`` lets them back.

With ``keep_slot_while_reading`` (``edf`` and ``slack``), a waiting row passed over for a free
slot because ``ready`` says its template's cache is still being read keeps that slot, in this
schedule, from the rows after it that are due after it (``deadlines.slots_kept_from``; with
``park_by_deadline`` off, from every row after it), when no running row ends in time for it
(``_frees_in_time``); a row due for the starvation bound is never kept out. A slot may so stay
empty for the steps a read takes, rather than go to a looser row for all of its steps.

With ``urgent_parks``, a waiting row W that finds no free slot between rounds and would be late
if it waited for the next round (its slack under the steps left to it, at the step time of the
batch as it would be) may park a running row at once, by the rules a round parks by (below).

A round parks a running row R for a waiting row W only when all of these hold: fewer than
``max_parks_per_round`` rows were parked in this round, or W is due and the plan parks at all
(``max_parks_per_round`` > 0); W is ready (``ready(W)`` is asked only
once a row to park was found, and W then takes R's slot in the same schedule, so a row that is not
ready never displaces anyone); R is not due, was not resumed since the last round and did not join
in this schedule; and W is due, or W precedes R, W's slack is strictly less than R's, W needs the
slot now (under ``URGENT_ROUNDS`` rounds of slack left, and no slot frees by itself in time), R
stays on time after sitting out one round (its slack minus one round's time is >= 0) and, with
``park_by_deadline``, R is due after W (``deadlines.gives_way``). A row
without a deadline has infinite slack: it never displaces anyone until it is due, and rows without
deadlines keep FIFO among themselves.

The starvation bound: a row is due when it would have waited (queued and parked, summed) past
``max_wait_s`` by the time a slot frees for it behind the due rows before it
(``deadlines.mark_due``) and the next planning round (``edf``: the next step), with
``DUE_MARGIN_STEPS`` predicted steps to spare, or when a row that waited less is due. Due rows
go first, longest wait first, take free slots first and may have a row parked for them at any
step, whatever its slack and however many parks the round made (the bound goes before deadlines
and before the churn bound); a due row is never parked.

Batch caps (``backend.worker.out_of_memory.BatchCaps``): a shape (group key) whose forward ran
out of device memory has a cap below ``max_batch``; a waiting row of a shape with as many rows
running as its cap is passed over (``SchedulerOutput.capped``), keeps its place, and rows of other
shapes behind it may take the free slots. It cannot park a running row. Forecasts do not model
caps.

Invariants: at most ``max_batch`` rows run, and no row joins a shape already at its cap; a row is in
exactly one of waiting (queued or parked) / running / done; every running row is stepped exactly
once per ``schedule`` -> ``update_from_output`` round (rows that cannot share a forward pass, e.g.
other resolutions, go into separate groups of the same step; the baseline worker runs its one
group's steps inside one pipeline call, reporting each step with ``update_from_output``); a
cancelled row never runs another step after the ``schedule`` that follows the cancel; a parked row
keeps its ``step`` and ends after exactly ``num_steps`` steps in all; at most
``max_parks_per_round`` rows are parked from one planning round to the next (the round's own parks
and those that shrink the batch; as many before the first round), besides those parked for due rows;
a ready row waits no longer than ``max_wait_s`` in all unless, when it comes due, no running row may
leave, steps run longer than predicted, or the backlog is more than the batch can run inside the
bound (slack; ``edf``, which never parks: unless no slot frees in time).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from backend.costmodel.slack import DUE_MARGIN_STEPS, URGENT_ROUNDS
from backend.worker import deadlines as dl
from backend.worker.batch_rows import Row, SchedulerOutput
from backend.worker.deadlines import DeadlinePlan, RowForecast, StepTime
from backend.worker.forecast_run import simulate
from backend.worker.live_rows import running_row, waiting_row
from backend.worker.out_of_memory import BatchCaps
from backend.worker.step_clock import JoinRule

MODES = ("continuous", "static", "inline", "baseline")


class BatchScheduler:
    def __init__(
        self,
        max_batch: int,
        mode: str = "continuous",
        plan: DeadlinePlan | None = None,
        join_rule: JoinRule | None = None,
        caps: BatchCaps | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"batching mode must be one of {', '.join(MODES)}, got {mode!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch, self.mode, self.plan = max_batch, mode, plan
        # the step scheduler in force: static and baseline batches stay FIFO (module docstring)
        self.policy = plan.scheduler if plan and mode in ("continuous", "inline") else "fifo"
        # rows join a running batch only when it pays (continuous and inline; None: while slots
        # are free)
        self.join_rule = join_rule if mode in ("continuous", "inline") else None
        # shapes whose batches ran out of device memory take fewer rows (None: max_batch each)
        self.caps = caps
        self.waiting: OrderedDict[str, Row] = OrderedDict()
        self.running: OrderedDict[str, Row] = OrderedDict()
        self._cancel_requests: set[str] = set()
        # planning rounds (slack): steps run since the last round; rows resumed since it (not
        # parked at the next one, so a resumed row runs at least until the round after)
        self._steps_since_round = 0
        self._resumed_since_round: set[str] = set()
        self._order: list[str] = []  # waiting rows in admission order at the last schedule
        # parks left in this round (slack): planning rounds and shrinking share the churn bound
        self._parks_left = plan.max_parks_per_round if plan else 0
        # set by each schedule (edf, slack): a row that would pass the starvation bound within
        # this many seconds is due (``_due``)
        self._due_within_s = 0.0
        self.parks = self.resumes = self.rounds = 0  # totals, for the worker's metrics

    # ----- inputs -----------------------------------------------------------------------------
    def add(self, row: Row) -> bool:
        """Queue ``row``; False (and nothing changes) when its job is already scheduled here: a
        duplicate delivery is dropped, never run twice."""
        if row.num_steps < 1:
            raise ValueError(f"job {row.job_id} has no steps to run")
        if row.job_id in self.waiting or row.job_id in self.running:
            return False
        if row.waiting_since is None:
            row.waiting_since = row.enqueued_at
        self.waiting[row.job_id] = row
        return True

    def cancel(self, job_id: str) -> bool:
        """Ask to drop ``job_id`` (waiting, parked or running); it leaves at the next ``schedule``.
        False if the job is unknown here."""
        if job_id in self.waiting or job_id in self.running:
            self._cancel_requests.add(job_id)
            return True
        return False

    # ----- one step ---------------------------------------------------------------------------
    def schedule(self, now: float, ready: Callable[[Row], bool] | None = None) -> SchedulerOutput:
        """Retire cancelled rows, park rows at a planning round (slack), admit waiting rows (in
        the policy's order, skipping those ``ready`` rejects), and group the running rows into
        this step's forward passes. The worker handles ``cancelled``, then ``parked`` (state and
        pins kept), then ``admitted`` (``resumed`` among them). A parked row keeps its pins while
        it waits: under RAM pressure the row that takes its slot may find ``ready`` false and
        wait for a later round."""
        out = SchedulerOutput()
        for job_id in sorted(self._cancel_requests):
            if self.waiting.pop(job_id, None) or self.running.pop(job_id, None):
                out.cancelled.append(job_id)
            self._resumed_since_round.discard(job_id)
        self._cancel_requests.clear()
        if self._may_admit():
            if self.policy == "fifo":
                self._admit_fifo(now, ready, out)
            else:
                self._admit_by_precedence(now, ready, out)
        groups: dict[str, list[str]] = {}
        for job_id, row in self.running.items():
            groups.setdefault(row.group_key, []).append(job_id)
        out.groups = list(groups.values())
        if out.groups:
            self._steps_since_round += 1
        return out

    def _admit_fifo(
        self, now: float, ready: Callable[[Row], bool] | None, out: SchedulerOutput
    ) -> None:
        batch_key = None  # baseline: the group key of the first row admitted
        for job_id, row in list(self.waiting.items()):
            if len(self.running) >= self.max_batch:
                break
            if batch_key is not None and row.group_key != batch_key:
                continue  # not held: it waits for a batch of its own key
            if self._at_cap(row):
                out.capped.append(job_id)
                continue
            if not self._pays(row):
                out.not_paying.append(job_id)
                break  # arrival order: no row overtakes it
            if ready is not None and not ready(row):
                out.held.append(job_id)
                continue
            if self.mode == "baseline":
                batch_key = row.group_key
            self._admit(row, now, out)

    def _admit_by_precedence(
        self, now: float, ready: Callable[[Row], bool] | None, out: SchedulerOutput
    ) -> None:
        """``edf`` and ``slack``: free slots go to waiting rows in precedence order; at a planning
        round (``slack``) a row that finds no free slot may take a parked row's (``_victim``)."""
        plan = self.plan
        assert plan is not None  # a policy other than fifo comes from a plan
        step_s = dl.planned_step_s(
            plan, list(self.running.values()), list(self.waiting.values()), self.max_batch, now
        )
        # a planning round every round_steps steps run (idle schedules do not count)
        planning = self.policy == "slack" and self._steps_since_round >= plan.round_steps
        protected = set(self._resumed_since_round)  # not parked before the next round
        if planning:
            self.rounds += 1
            self._steps_since_round = 0
            self._resumed_since_round = set()
            self._parks_left = plan.max_parks_per_round
        self._due_within_s = (self._steps_to_round() + DUE_MARGIN_STEPS) * step_s
        dl.mark_due(
            self.running.values(),
            self.waiting.values(),
            self.max_batch,
            now,
            step_s,
            plan,
            self._due_within_s,
        )
        queued_ahead = 0  # rows before this one left waiting for a slot to free by itself
        reading: list[Row] = []  # rows passed over for a free slot while their cache is read
        sizing = self.policy == "slack" and plan.size_batches
        shrinking = self.policy == "slack" and plan.shrink_batches
        # the running rows, kept in step with admissions and parks below, and their step time
        batch, batch_step_s = self._priced_batch(sizing or shrinking)
        for row in self._queue(now, step_s):
            if self._at_cap(row):  # it waits for a row of its shape to leave, due or not
                out.capped.append(row.job_id)
                queued_ahead += 1
                continue
            # a row due for the starvation bound is not kept out of a slot kept for a read
            kept = (
                dl.slots_kept_from(plan, row, reading) if reading and not self._due(row, now) else 0
            )
            free = self.max_batch - len(self.running) - kept
            if free > 0 and (self._pays(row) or self._due(row, now)):
                if (
                    sizing
                    and not self._due(row, now)
                    and dl.delays_a_tighter_row(plan, batch, row, now, batch_step_s)
                ):
                    out.deferred.append(row.job_id)
                    queued_ahead += 1
                    continue  # a later, cheaper row may still fit
                if ready is not None and not ready(row):
                    out.held.append(row.job_id)
                    if plan.keep_slot_while_reading and not self._frees_in_time(
                        queued_ahead, dl.row_slack(row, now, step_s), step_s
                    ):
                        reading.append(row)  # no other slot frees in time for it: it keeps this one
                    queued_ahead += 1
                    continue
                self._admit(row, now, out)
                batch, batch_step_s = self._priced_batch(sizing or shrinking)
                # before the next row is weighed against the batch
                if shrinking and self._shrink(now, out, protected, batch, batch_step_s):
                    batch, batch_step_s = self._priced_batch(True)
                continue
            if free > 0:
                out.not_paying.append(row.job_id)  # a free slot it does not take: as if full
            if not self._may_make_a_slot(row, now, step_s, planning):
                break  # no slot, and none may be made by parking
            victim = self._victim(row, now, step_s, queued_ahead, protected, out)
            if victim is None:
                queued_ahead += 1
                continue
            if ready is not None and not ready(row):
                out.held.append(row.job_id)  # a park would have made it a slot
                queued_ahead += 1
                continue
            self._park(victim, now, out)
            self._admit(row, now, out)
            batch, batch_step_s = self._priced_batch(sizing or shrinking)
        if shrinking:  # also when nothing joined: step times drift
            self._shrink(now, out, protected, batch, batch_step_s)
        self._order = [r.job_id for r in self._queue(now, step_s)]

    def _queue(self, now: float, step_s: float) -> list[Row]:
        """The waiting rows in the order they take slots (``deadlines.slot_order``; the schedule
        marked the due ones, ``deadlines.mark_due``)."""
        assert self.plan is not None
        return dl.slot_order(self.waiting.values(), now, step_s, self.plan)

    def _may_make_a_slot(self, row: Row, now: float, step_s: float, planning: bool) -> bool:
        """Whether a running row may be parked now for waiting ``row`` (slack; a plan with
        ``max_parks_per_round`` 0 never parks). A row due for the starvation bound may always:
        the bound goes before the churn bound, which would otherwise let a burst of rows that
        come due together in at ``max_parks_per_round`` a round, past the bound
        (``deadlines.mark_due`` counts the slots of rows that are not due as free now). Any other
        row within the round's parks left: at a round, or between rounds when
        (``urgent_parks``) it would be late if it waited for the next one."""
        plan = self.plan
        assert plan is not None
        if self.policy != "slack" or plan.max_parks_per_round == 0:
            return False
        if self._due(row, now):
            return True
        return self._parks_left > 0 and (
            planning
            or (
                plan.urgent_parks
                and dl.row_slack(row, now, step_s) < self._steps_to_round() * step_s
            )
        )

    def _steps_to_round(self) -> int:
        """Steps until the next planning round (slack; at a round, a whole round); 1 for edf."""
        assert self.plan is not None
        if self.policy != "slack":
            return 1
        return max(1, self.plan.round_steps - self._steps_since_round)

    def _due(self, row: Row, now: float) -> bool:
        """Whether ``row`` would pass the starvation bound before the next round (``edf``: the
        next step), with ``DUE_MARGIN_STEPS`` to spare: it goes first, takes a slot now and is not
        parked. Once due, always due (``Row.due``): a row let in to keep the bound runs to its
        end."""
        assert self.plan is not None
        row.due = row.due or dl.due(row, now, self.plan, self._due_within_s)
        return row.due

    def _priced_batch(self, priced: bool) -> tuple[list[Row], float]:
        """The running rows, and their predicted step time when ``priced`` (else 0.0)."""
        batch = list(self.running.values())
        assert self.plan is not None
        return batch, (self.plan.step_s(batch) if priced else 0.0)

    def _shrink(
        self,
        now: float,
        out: SchedulerOutput,
        protected: set[str],
        batch: list[Row],
        step_s: float,
    ) -> bool:
        """Park rows with slack to spare, within this round's parks left, while a tighter running
        row is late at the batch's step time and a smaller batch puts it on time
        (``deadlines.rows_to_park_for``), the tightest row first; True when a row was parked.
        ``batch`` is the running rows and ``step_s`` their predicted step time. Only rows
        ``_may_park`` allows leave."""
        plan = self.plan
        assert plan is not None
        if self._parks_left < 1 or all(dl.row_slack(r, now, step_s) >= 0 for r in batch):
            return False  # the common case, one comparison per row: nobody is late
        parked = False
        for tight in dl.ordered(batch, now, step_s, plan):
            if self._parks_left < 1:
                break
            if tight.job_id not in self.running or dl.row_slack(tight, now, step_s) >= 0:
                continue  # parked for a tighter row already, or on time in this batch
            victims = dl.rows_to_park_for(
                plan,
                list(self.running.values()),
                tight,
                now,
                lambda row: self._may_park(row, now, protected, out),
                self._parks_left,
            )
            for victim in victims:
                self._park(victim, now, out)
            if victims:
                parked = True
                step_s = plan.step_s(list(self.running.values()))
        return parked

    def _may_park(self, row: Row, now: float, protected: set[str], out: SchedulerOutput) -> bool:
        """The churn rules: a running row may leave the batch unless the worker marks it
        unparkable (recording), it resumed since the last round (``protected``), it joined in
        this schedule, or it is due (``_due``: parked, it would pass the starvation bound before
        the next round; a starved row is never parked again)."""
        return (
            row.parkable
            and row.job_id not in protected
            and row.job_id not in out.admitted
            and not self._due(row, now)
        )

    def _victim(
        self,
        row: Row,
        now: float,
        step_s: float,
        queued_ahead: int,
        protected: set[str],
        out: SchedulerOutput,
    ) -> Row | None:
        """The running row to park so that waiting ``row`` gets its slot this round, or None
        (rules in the module docstring); of the rows that may be parked, the last in precedence."""
        plan = self.plan
        assert plan is not None
        round_s = plan.round_steps * step_s
        slack = dl.row_slack(row, now, step_s)
        row_due = self._due(row, now)
        if not row_due:
            if not slack < URGENT_ROUNDS * round_s:
                return None  # it can wait for a later round and still be on time
            if self._frees_in_time(queued_ahead, slack, step_s):
                return None  # a slot frees in time without parking anyone
        key = dl.row_key(row, now, step_s, plan)
        best: Row | None = None
        best_key = key
        for candidate in self.running.values():
            if not self._may_park(candidate, now, protected, out):
                continue  # rows that may be parked are not due: a due row precedes them all
            their_key = dl.row_key(candidate, now, step_s, plan)
            if not row_due:  # the starvation bound goes before deadlines, not the other way
                their_slack = dl.row_slack(candidate, now, step_s)
                if their_slack - round_s < 0:
                    continue  # sitting out a round would make it late
                if not slack < their_slack or not their_key > key:
                    continue  # parks only a looser row it precedes
                if not dl.gives_way(plan, candidate, row):
                    continue  # due no later than the waiting row: it keeps its slot
            if best is None or their_key > best_key:  # the last in precedence so far
                best, best_key = candidate, their_key
        return best

    def _frees_in_time(self, queued_ahead: int, slack: float, step_s: float) -> bool:
        """Whether a running row ends within ``slack`` seconds (at ``step_s`` a step) for a waiting
        row behind ``queued_ahead`` rows left waiting before it, which take the first slots that
        free by themselves (rows ending), the earliest first."""
        ends = sorted(r.remaining_steps for r in self.running.values())
        return queued_ahead < len(ends) and ends[queued_ahead] * step_s <= slack

    def _admit(self, row: Row, now: float, out: SchedulerOutput) -> None:
        del self.waiting[row.job_id]
        if row.waiting_since is not None:  # the wait ends: it counts toward the starvation bound
            row.wait_s += max(0.0, now - row.waiting_since)
            row.waiting_since = None
        if row.admitted_at is None:
            row.admitted_at = now
        self.running[row.job_id] = row
        out.admitted.append(row.job_id)
        if row.parked:
            row.parked = False
            out.resumed.append(row.job_id)
            self._resumed_since_round.add(row.job_id)
            self.resumes += 1

    def _park(self, row: Row, now: float, out: SchedulerOutput) -> None:
        """``row`` leaves the batch at this step boundary and waits again, keeping its step."""
        del self.running[row.job_id]
        row.parked, row.parks, row.waiting_since = True, row.parks + 1, now
        self.waiting[row.job_id] = row
        out.parked.append(row.job_id)
        self.parks += 1
        self._parks_left = max(0, self._parks_left - 1)  # a due row's park may find none left

    def _pays(self, row: Row) -> bool:
        """Whether waiting ``row`` should join the running batch: always without a join rule or
        into an empty batch, else when the rule says batching it lowers the rows' mean latency."""
        if self.join_rule is None or not self.running:
            return True
        return self.join_rule(list(self.running.values()), row)

    def _at_cap(self, row: Row) -> bool:
        """Whether as many rows of ``row``'s shape run as the shape's cap (``caps``) allows."""
        if self.caps is None or row.group_key not in self.caps.caps:
            return False
        running = sum(1 for r in self.running.values() if r.group_key == row.group_key)
        return running >= self.caps.limit(row.group_key)

    def _may_admit(self) -> bool:
        return self.mode not in ("static", "baseline") or not self.running

    def update_from_output(self, stepped: list[str]) -> list[Row]:
        """Advance the rows that ran one step; return (and drop) those that finished."""
        finished = []
        for job_id in stepped:
            row = self.running.get(job_id)
            if row is None:
                continue  # cancelled while its step ran
            row.step += 1
            if row.remaining_steps <= 0:
                finished.append(self.running.pop(job_id))
                self._resumed_since_round.discard(job_id)
        return finished

    def restart(self, job_id: str) -> None:
        """A running row starts over at step 0 in its slot (its cache broke mid-edit and it now
        computes densely); it keeps its place in the running batch."""
        row = self.running.get(job_id)
        if row is None:
            raise KeyError(f"job {job_id} is not running: only a running row can restart")
        row.step = 0

    def drop(self, job_id: str) -> Row | None:
        """Remove a row at once (its admission failed); the worker reports why."""
        self._resumed_since_round.discard(job_id)
        return self.waiting.pop(job_id, None) or self.running.pop(job_id, None)

    # ----- views (heartbeats, routing, events) -------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def counters(self) -> dict[str, int]:
        """Totals since start, for metrics: rows parked, rows resumed, planning rounds."""
        return {"parks": self.parks, "resumes": self.resumes, "rounds": self.rounds}

    def queue_order(self) -> list[Row]:
        """Waiting rows in the order they would join, as of the last ``schedule`` (rows queued
        since then last, in arrival order). Costs no step-time prediction."""
        waiting = dict(self.waiting)
        first = [waiting.pop(job_id) for job_id in self._order if job_id in waiting]
        return first + list(waiting.values())

    def forecast(self, now: float, step_time: StepTime | None = None) -> dict[str, RowForecast]:
        """Every row's ``RowForecast``: the running batch and the queue run forward on predicted
        step times (``step_time``, else the plan's), the queue joining in this scheduler's order
        as slots free, rows that batch sizing or the join rule keeps out of a free slot held back
        (``forecast_run.simulate``). Pure; O(rows) step-time predictions."""
        step_time = step_time or (self.plan.step_time if self.plan else None)
        if step_time is None:
            raise ValueError("forecast needs a step time: pass step_time or a DeadlinePlan")
        running = [r for r in self.running.values() if r.job_id not in self._cancel_requests]
        waiting = [r for r in self.waiting.values() if r.job_id not in self._cancel_requests]
        if self.policy != "fifo" and self.plan is not None:
            step_s = dl.planned_step_s(self.plan, running, waiting, self.max_batch, now)
            waiting = dl.slot_order(waiting, now, step_s, self.plan)
        time_of = step_time  # bound for the closure (mypy: not None)
        plan = self.plan
        sizing = plan if self.policy == "slack" and plan is not None and plan.size_batches else None
        return simulate(
            now,
            running,
            waiting,
            self.max_batch,
            lambda rows: max(0.0, float(time_of(rows))) if rows else 0.0,
            join_when_empty=self.mode not in ("continuous", "inline"),
            sizing=sizing,
            joins=self.join_rule,
        )

    def live_state(self, now: float) -> dict[str, Any]:
        """Running batch and queue (in admission order), as the worker's heartbeat at ``now``
        reports them: with each waiting row's wait so far and the rows due for the starvation
        bound."""
        return {
            "running": [running_row(r) for r in list(self.running.values())],
            "waiting": [waiting_row(r, now) for r in self.queue_order()],
            "max_batch": self.max_batch,
            "mode": self.mode,
            "scheduler": self.policy,
        }

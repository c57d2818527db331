"""Joining when it pays (``worker.join_when_it_pays``): a waiting row joins a running batch only
when that lowers the rows' mean latency on the step costs (``costmodel.batch_gain``), in the
scheduler's FIFO and deadline admissions, its forecast and the worker's step clock (pure: no
torch, no clock)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from backend.config import load_settings
from backend.costmodel.batch_gain import joining_pays
from backend.worker.batch_rows import Row
from backend.worker.batching import BatchScheduler
from backend.worker.step_clock import JOIN_SAMPLES, StepClock
from tests.deadline_factory import by_size, make_plan, make_row

StepCost = Callable[[Sequence[Row]], float]
ADDITIVE = by_size(0.0, 1.0)  # a CPU: a step of n rows costs n steps of one
FLAT = by_size(1.0, 0.05)  # a launch-bound GPU: rows cost almost nothing more


def rule_of(cost: StepCost) -> Callable[[Sequence[Row], Row], bool]:
    """The join rule on exact step costs (what a calibrated ``StepClock`` predicts)."""
    return lambda batch, row: joining_pays(
        cost(batch), cost([*batch, row]), cost([row]), len(batch)
    )


def run(
    cost: StepCost,
    arrivals: Sequence[tuple[str, float, int]],
    max_batch: int = 4,
    join: bool = True,
    plan=None,
) -> dict[str, float]:
    """Every row's finish time: ``arrivals`` (job, time, steps) served by a ``BatchScheduler``
    whose steps take ``cost(rows)`` seconds."""
    s = BatchScheduler(max_batch, plan=plan, join_rule=rule_of(cost) if join else None)
    pending = sorted(arrivals, key=lambda a: a[1])
    now, finish = 0.0, {}
    while pending or not s.idle:
        while pending and pending[0][1] <= now:
            job, at, steps = pending.pop(0)
            s.add(Row(job, steps, "k", 0.2, at))
        out = s.schedule(now)
        rows = [s.running[j] for group in out.groups for j in group]
        if not rows:
            now = pending[0][1]
            continue
        now += cost(rows)
        for done in s.update_from_output([r.job_id for r in rows]):
            finish[done.job_id] = now
    return finish


def mean_latency(finish: dict[str, float], arrivals) -> float:
    return sum(finish[job] - at for job, at, _ in arrivals) / len(arrivals)


# ----- the rule --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "batch_s, joined_s, alone_s, rows, pays",
    [
        (0.0, 1.0, 1.0, 0, True),  # an empty batch always takes the row
        (1.0, 1.05, 1.0, 1, True),  # a launch-bound step: almost free
        (1.0, 2.0, 1.0, 1, False),  # additive: two rows cost two steps
        (1.0, 1.49, 1.0, 1, True),  # c(2) < 1.5 c(1)
        (1.0, 1.5, 1.0, 1, False),
        (2.0, 2.3, 1.0, 3, False),  # 4 rows x 0.3 s added > 1 s alone
        (2.0, 2.2, 1.0, 3, True),  # 4 x 0.2 < 1
        (1.0, 0.9, 1.0, 2, True),  # a step that does not grow
    ],
)
def test_a_row_joins_when_the_time_it_adds_to_every_row_is_under_its_own_step(
    batch_s, joined_s, alone_s, rows, pays
):
    assert joining_pays(batch_s, joined_s, alone_s, rows) is pays


def test_the_rule_rejects_a_negative_batch():
    with pytest.raises(ValueError, match="batch_rows"):
        joining_pays(1.0, 1.0, 1.0, -1)


@pytest.mark.parametrize("seed", range(20))
def test_the_rule_picks_the_lower_summed_finish_of_equal_rows(seed):
    """n running rows and one more, all with R steps: the rule says join exactly when joining gives
    the lower sum of finish times (the batch served together, or the newcomer after it)."""
    rng = random.Random(seed)
    n, steps = rng.randint(1, 6), rng.randint(1, 30)
    alone = rng.uniform(0.1, 1.0)
    batch = alone * rng.uniform(1.0, n)  # a step of n rows: between flat and additive
    joined = batch + alone * rng.uniform(0.0, 1.2)
    together = (n + 1) * steps * joined
    after = (n + 1) * steps * batch + steps * alone
    assert joining_pays(batch, joined, alone, n) is (together < after)


# ----- FIFO admission --------------------------------------------------------------------------
BURST = [("a", 0.0, 5), ("b", 0.0, 5), ("c", 0.0, 5), ("d", 0.0, 5)]


def test_on_additive_steps_rows_run_one_after_another_in_arrival_order():
    finish = run(ADDITIVE, BURST)
    assert finish == {"a": 5.0, "b": 10.0, "c": 15.0, "d": 20.0}
    # batched, every row ends with the last: the same work, a higher mean
    batched = run(ADDITIVE, BURST, join=False)
    assert set(batched.values()) == {20.0}
    assert mean_latency(finish, BURST) == 12.5 < mean_latency(batched, BURST) == 20.0


def test_on_flat_steps_rows_batch_as_before():
    assert run(FLAT, BURST) == run(FLAT, BURST, join=False)
    assert list(run(FLAT, BURST).values()) == pytest.approx([5 * 1.2] * 4)  # all four together


@pytest.mark.parametrize("seed", range(5))
def test_the_rule_never_raises_the_mean_on_additive_steps(seed):
    rng = random.Random(seed)
    arrivals = [(f"r{i}", rng.uniform(0, 20), rng.randint(3, 12)) for i in range(12)]
    assert mean_latency(run(ADDITIVE, arrivals), arrivals) <= mean_latency(
        run(ADDITIVE, arrivals, join=False), arrivals
    )


def test_a_row_kept_out_is_reported_and_later_rows_do_not_overtake_it():
    s = BatchScheduler(4, join_rule=rule_of(ADDITIVE))
    for job in "abc":
        s.add(make_row(job, steps=2))
    out = s.schedule(0.0)
    assert out.admitted == ["a"] and out.not_paying == ["b"]
    s.update_from_output(["a"])
    s.schedule(1.0)
    assert s.update_from_output(["a"])[0].job_id == "a"
    assert s.schedule(2.0).admitted == ["b"]


@pytest.mark.parametrize("mode", ["static", "baseline"])
def test_static_and_baseline_batches_ignore_the_rule(mode):
    s = BatchScheduler(4, mode=mode, join_rule=rule_of(ADDITIVE))
    for job in "ab":
        s.add(make_row(job))
    assert s.schedule(0.0).admitted == ["a", "b"]


# ----- deadline admission ----------------------------------------------------------------------
@pytest.mark.parametrize("join", [True, False])
def test_a_tight_row_parks_a_loose_one_instead_of_sharing_its_steps(join):
    """One row with 10 steps and a loose deadline runs; a tight row (due at 13, 10 steps) arrives
    at t=1. On additive steps sharing makes every step 2 s (ending at 21, late). With the rule it
    finds no slot worth taking, parks the loose row and runs alone, on time; without it (and
    without shrinking) it takes the free slot."""
    plan = make_plan(step_time=ADDITIVE, round_steps=3, shrink_batches=False)
    s = BatchScheduler(4, plan=plan, join_rule=rule_of(ADDITIVE) if join else None)
    s.add(make_row("loose", steps=10, deadline=100.0))
    s.schedule(0.0)
    s.update_from_output(["loose"])
    s.add(make_row("tight", steps=10, deadline=13.0, at=1.0))
    out = s.schedule(1.0)
    assert out.admitted == ["tight"]
    assert (out.parked, list(s.running)) == (
        (["loose"], ["tight"]) if join else ([], ["loose", "tight"])
    )


def test_a_loose_row_waits_beside_a_free_slot_until_the_batch_ends():
    plan = make_plan(step_time=ADDITIVE)
    finish = run(ADDITIVE, [("a", 0.0, 4), ("b", 0.5, 4)], plan=plan)
    assert finish == {"a": 4.0, "b": 8.0}


def test_a_row_due_for_the_starvation_bound_joins_although_it_does_not_pay():
    plan = make_plan(step_time=ADDITIVE, max_wait_s=3.0)
    s = BatchScheduler(4, plan=plan, join_rule=rule_of(ADDITIVE))
    s.add(make_row("long", steps=20))
    s.schedule(0.0)
    s.update_from_output(["long"])
    s.add(make_row("starving", steps=2, at=0.0))
    out = s.schedule(1.0)
    assert out.admitted == ["starving"] and out.not_paying == []
    assert set(s.running) == {"long", "starving"}


# ----- forecast --------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["fifo", "slack"])
@pytest.mark.parametrize("cost", [ADDITIVE, FLAT], ids=["additive", "flat"])
def test_the_forecast_follows_the_rule(scheduler, cost):
    """A running row and three queued: forecast finishes equal those the scheduler then makes."""
    plan = make_plan(scheduler, step_time=cost)
    s = BatchScheduler(4, plan=plan, join_rule=rule_of(cost))
    s.add(make_row("a", steps=4))
    s.schedule(0.0)
    for job in "bcd":
        s.add(make_row(job, steps=3))
    forecast = s.forecast(0.0)
    now, finish = 0.0, {}
    while not s.idle:
        out = s.schedule(now)
        rows = [s.running[j] for group in out.groups for j in group]
        now += cost(rows)
        for done in s.update_from_output([r.job_id for r in rows]):
            finish[done.job_id] = now
    assert {job: f.finish for job, f in forecast.items()} == pytest.approx(finish)


# ----- the worker's step clock -----------------------------------------------------------------
def rows(n: int) -> list[Row]:
    return [make_row(f"r{i}") for i in range(n)]


def model_of(per_row: float, fixed: float) -> Callable[[Sequence[tuple]], float]:
    return lambda rows: fixed + per_row * len(rows)


def test_the_clock_says_rows_join_on_a_profile_where_batching_pays():
    clock = StepClock(model_of(per_row=0.1, fixed=1.0))
    a, b = rows(2)
    assert clock.joining_pays([a], b) and clock.joining_pays([], a)


def test_the_clock_stops_rows_joining_once_it_measured_that_steps_add_up():
    """A profile fitted where batching paid (a step of two rows 1.4x one); this machine's steps
    of two rows take twice one. The profile is trusted until ``JOIN_SAMPLES`` steps of two rows
    were measured, then their speed: rows stop joining."""
    clock = StepClock(model_of(per_row=0.4, fixed=0.6))
    one, two = rows(1), rows(2)
    for _ in range(JOIN_SAMPLES):
        clock.observe(one, 1.0)
    for _ in range(JOIN_SAMPLES - 1):
        clock.observe(two, 2.0)
        assert clock.joining_pays(two[:1], two[1])
    clock.observe(two, 2.0)
    assert not clock.joining_pays(two[:1], two[1])
    # a third row is priced at the speed of two (nothing measured at three): it does not join
    assert not clock.joining_pays(rows(3)[:2], rows(3)[2])


def test_the_clock_keeps_rows_joining_where_steps_barely_grow():
    clock = StepClock(model_of(per_row=0.5, fixed=0.5))  # a profile that says steps add up...
    one, two = rows(1), rows(2)
    for _ in range(10):
        clock.observe(one, 1.0)
        clock.observe(two, 1.05)  # ...on a device where they do not
    assert clock.joining_pays(two[:1], two[1])
    assert clock.join_speed(2) == pytest.approx(1.05 / 1.5)


# ----- settings --------------------------------------------------------------------------------
def test_the_setting_defaults_off_and_reads_its_environment_variable(monkeypatch):
    assert load_settings().worker.join_when_it_pays is False
    monkeypatch.setenv("MASKSERVE_JOIN_WHEN_IT_PAYS", "true")
    assert load_settings().worker.join_when_it_pays is True


def test_the_worker_joins_when_it_pays_only_with_a_profile_and_the_setting():
    on = load_settings(env={"MASKSERVE_JOIN_WHEN_IT_PAYS": "true"}).worker.join_when_it_pays
    with_profile = StepClock(model_of(per_row=0.1, fixed=1.0))
    assert with_profile.join_rule(on) == with_profile.joining_pays
    assert StepClock().join_rule(on) is None  # no profile: no shape until rows batch
    default = load_settings(env={}).worker.join_when_it_pays
    assert with_profile.join_rule(default) is None  # the default: off

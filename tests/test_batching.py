"""The pure step-level batch scheduler: admission per mode, grouping, retirement, cancel."""

from __future__ import annotations

import random

import pytest

from backend.worker.batch_rows import Row
from backend.worker.batching import BatchScheduler


def make_row(job_id: str, steps: int = 3, key: str = "kv:128x128", ratio: float = 0.2) -> Row:
    return Row(job_id=job_id, num_steps=steps, group_key=key, mask_ratio=ratio)


def run_step(scheduler: BatchScheduler, now: float = 0.0):
    out = scheduler.schedule(now)
    stepped = [j for g in out.groups for j in g]
    return out, scheduler.update_from_output(stepped)


def test_continuous_admits_a_new_row_at_the_next_step():
    scheduler = BatchScheduler(max_batch=4, mode="continuous")
    scheduler.add(make_row("a", steps=5))
    run_step(scheduler)
    scheduler.add(make_row("b", steps=5))
    out, _ = run_step(scheduler)
    assert out.admitted == ["b"] and sorted(out.groups[0]) == ["a", "b"]
    assert scheduler.running["a"].step == 2 and scheduler.running["b"].step == 1


def test_static_waits_for_the_whole_batch_to_finish():
    scheduler = BatchScheduler(max_batch=4, mode="static")
    scheduler.add(make_row("a", steps=3))
    run_step(scheduler)
    scheduler.add(make_row("b", steps=3))
    admitted = []
    for _ in range(2):
        out, finished = run_step(scheduler)
        admitted += out.admitted
    assert admitted == [] and [r.job_id for r in finished] == ["a"]
    out, _ = run_step(scheduler)
    assert out.admitted == ["b"]


def test_inline_admits_like_continuous():
    scheduler = BatchScheduler(max_batch=2, mode="inline")
    scheduler.add(make_row("a"))
    run_step(scheduler)
    scheduler.add(make_row("b"))
    out, _ = run_step(scheduler)
    assert out.admitted == ["b"]


def test_baseline_batches_the_oldest_rows_key_only_and_admits_when_nothing_runs():
    scheduler = BatchScheduler(max_batch=2, mode="baseline")
    for name, key in (("a", "x"), ("b", "y"), ("c", "x"), ("d", "x")):
        scheduler.add(make_row(name, steps=2, key=key))
    out, _ = run_step(scheduler)
    assert out.admitted == ["a", "c"] and out.groups == [["a", "c"]] and out.held == []
    assert list(scheduler.waiting) == ["b", "d"]  # b keeps its place at the head
    scheduler.add(make_row("e", steps=2, key="y"))
    out, finished = run_step(scheduler)
    assert out.admitted == [] and [r.job_id for r in finished] == ["a", "c"]
    out, _ = run_step(scheduler)
    assert out.admitted == ["b", "e"] and out.groups == [["b", "e"]]
    run_step(scheduler)
    out, _ = run_step(scheduler)
    assert out.admitted == ["d"]


def test_max_batch_is_respected_and_fifo():
    scheduler = BatchScheduler(max_batch=2)
    for name in "abcd":
        scheduler.add(make_row(name, steps=2))
    out, _ = run_step(scheduler)
    assert out.admitted == ["a", "b"] and out.num_rows == 2
    _, finished = run_step(scheduler)
    assert [r.job_id for r in finished] == ["a", "b"]
    out, _ = run_step(scheduler)
    assert out.admitted == ["c", "d"]


def test_rows_of_other_resolutions_run_in_separate_groups_of_one_step():
    scheduler = BatchScheduler(max_batch=4)
    scheduler.add(make_row("a", key="kv:128x128"))
    scheduler.add(make_row("b", key="kv:256x256"))
    scheduler.add(make_row("c", key="kv:128x128"))
    out, _ = run_step(scheduler)
    assert sorted(map(sorted, out.groups)) == [["a", "c"], ["b"]]


def test_cancel_running_and_waiting_rows():
    scheduler = BatchScheduler(max_batch=1)
    scheduler.add(make_row("a", steps=5))
    scheduler.add(make_row("b", steps=5))
    run_step(scheduler)
    assert scheduler.cancel("a") and scheduler.cancel("b") and not scheduler.cancel("zzz")
    out, finished = run_step(scheduler)
    assert sorted(out.cancelled) == ["a", "b"] and out.groups == [] and finished == []
    assert scheduler.idle


def test_a_row_cancelled_during_its_step_is_not_advanced():
    scheduler = BatchScheduler(max_batch=2)
    scheduler.add(make_row("a", steps=2))
    out = scheduler.schedule(0.0)
    scheduler.drop("a")
    assert scheduler.update_from_output(out.groups[0]) == []


def test_a_restarted_row_runs_all_its_steps_again_in_its_slot():
    scheduler = BatchScheduler(max_batch=1, mode="continuous")
    scheduler.add(make_row("a", steps=3))
    scheduler.add(make_row("b", steps=3))
    run_step(scheduler)
    run_step(scheduler)
    scheduler.restart("a")
    assert scheduler.running["a"].step == 0 and scheduler.running["a"].remaining_steps == 3
    finished = [row.job_id for _ in range(3) for row in run_step(scheduler)[1]]
    assert finished == ["a"] and list(scheduler.waiting) == ["b"]  # b waited: a kept its slot
    with pytest.raises(KeyError, match="not running"):
        scheduler.restart("b")


def test_a_row_delivered_twice_is_scheduled_once():
    scheduler = BatchScheduler(max_batch=2)
    assert scheduler.add(make_row("a", steps=2))
    run_step(scheduler)
    assert not scheduler.add(make_row("a", steps=2))  # running: the duplicate is dropped
    assert not scheduler.waiting and scheduler.running["a"].step == 1
    assert [row.job_id for row in run_step(scheduler)[1]] == ["a"]
    assert scheduler.idle


def test_bad_rows_are_rejected():
    scheduler = BatchScheduler(max_batch=2)
    scheduler.add(make_row("a"))
    with pytest.raises(ValueError, match="no steps"):
        scheduler.add(make_row("z", steps=0))
    with pytest.raises(ValueError, match="batching mode"):
        BatchScheduler(2, mode="eager")
    with pytest.raises(ValueError, match="max_batch"):
        BatchScheduler(0)


@pytest.mark.parametrize("mode", ["continuous", "static", "inline", "baseline"])
def test_random_walk_keeps_invariants(mode):
    rng = random.Random(7)
    scheduler = BatchScheduler(max_batch=3, mode=mode)
    added, finished, cancelled, steps_run = 0, set(), set(), {}
    for tick in range(400):
        if rng.random() < 0.4:
            scheduler.add(
                make_row(f"j{added}", steps=rng.randint(1, 6), key=rng.choice(["x", "y"]))
            )
            added += 1
        if rng.random() < 0.05 and scheduler.running:
            scheduler.cancel(rng.choice(list(scheduler.running)))
        out = scheduler.schedule(float(tick))
        cancelled.update(out.cancelled)
        stepped = [j for g in out.groups for j in g]
        # each running row once, never above max_batch
        assert len(stepped) == len(set(stepped)) <= 3
        assert set(stepped) == set(scheduler.running)
        if mode == "baseline":  # one pipeline call: every running row of one key
            assert len(out.groups) <= 1
        for job_id in stepped:
            steps_run[job_id] = steps_run.get(job_id, 0) + 1
        for row in scheduler.update_from_output(stepped):
            assert steps_run[row.job_id] == row.num_steps  # finished after exactly its steps
            finished.add(row.job_id)
    assert not finished & cancelled
    in_flight = set(scheduler.running) | set(scheduler.waiting)
    assert len(finished) + len(cancelled) + len(in_flight) == added


def test_a_row_that_is_not_ready_keeps_its_place_while_later_rows_take_the_slots():
    scheduler = BatchScheduler(max_batch=2)
    for name in "abc":
        scheduler.add(make_row(name, steps=2))
    reading = {"a"}  # a's cache is still being read
    out = scheduler.schedule(0.0, lambda row: row.job_id not in reading)
    assert out.admitted == ["b", "c"] and out.held == ["a"] and list(scheduler.waiting) == ["a"]
    scheduler.update_from_output(["b", "c"])
    out = scheduler.schedule(1.0, lambda row: row.job_id not in reading)
    assert out.admitted == [] and out.held == []  # no free slot: nothing is held back
    scheduler.update_from_output(["b", "c"])
    scheduler.add(make_row("d"))
    reading.clear()  # a's read landed: it goes first, ahead of d
    out = scheduler.schedule(2.0, lambda row: row.job_id not in reading)
    assert out.admitted == ["a", "d"] and out.held == []

"""Running out of device memory, the pure rules: retry in halves, fail a lone row, the batch cap
that falls to the largest forward that succeeded and rises slowly, the scheduler holding rows of a
capped shape, the releasers asked in order, and the worker's metrics. Milliseconds, no torch."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from backend.metrics import make_registry
from backend.worker.batch_rows import Row
from backend.worker.batching import BatchScheduler
from backend.worker.out_of_memory import (
    EVERY_BYTE,
    BatchCaps,
    MemoryReleasers,
    StepOutcome,
    after_oom,
    bytes_wanted,
    halves,
    oom_reason,
)
from backend.worker.stats import WorkerStats
from tests.deadline_factory import make_plan

BIG, SMALL = "kv:128x128", "kv:64x64"


def ran_out(largest_ok: int) -> StepOutcome:
    return StepOutcome(largest_ok=largest_ok, ran_out=True)


def row(job_id: str, shape: str = BIG, steps: int = 5) -> Row:
    return Row(job_id, steps, shape, 0.2)


@pytest.mark.parametrize(
    "rows, first, second",
    [(["a"], ["a"], []), (list("abc"), ["a", "b"], ["c"]), (list("abcd"), ["a", "b"], ["c", "d"])],
)
def test_halves_put_the_extra_row_first(rows, first, second):
    assert halves(rows) == (first, second)


def test_several_rows_split_and_a_lone_row_runs_again_once_only_when_memory_was_freed():
    assert after_oom(2, 0, False) == "split"
    assert after_oom(1, 1, False) == "retry"
    assert after_oom(1, 0, False) == "fail"
    assert after_oom(1, 1, True) == "fail"


def test_the_bytes_wanted_are_those_the_allocator_tried_to_get_else_all():
    message = "CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79 GiB"
    assert bytes_wanted(message) == int(2.5 * (1 << 30))
    assert bytes_wanted("Tried to allocate 512 B") == 512
    assert bytes_wanted("out of memory") == EVERY_BYTE


def test_the_reason_names_the_edit_and_what_to_try():
    reason = oom_reason(height=512, width=768, num_steps=30)
    assert "ran out of memory" in reason and "768x512 px" in reason and "30 steps" in reason
    assert "smaller image" in reason and "fewer variations" in reason


def test_releasers_are_asked_in_order_for_what_is_still_wanted_and_a_failing_one_is_skipped():
    asked: list[tuple[str, int]] = []

    def gives(name: str, freed: int):
        def release(nbytes: int) -> int:
            asked.append((name, nbytes))
            return freed

        return release

    def broken(nbytes: int) -> int:
        asked.append(("broken", nbytes))
        raise RuntimeError("device tier busy")

    releasers = MemoryReleasers()
    for releaser in (gives("graphs", 30), broken, gives("cache", 100), gives("never", 1)):
        releasers.register(releaser)
    assert releasers.release(100) == 130
    assert asked == [("graphs", 100), ("broken", 70), ("cache", 70)]
    assert MemoryReleasers().release(100) == 0


def test_the_cap_falls_to_the_largest_forward_that_succeeded_and_never_below_one():
    caps = BatchCaps(max_batch=8)
    assert caps.limit(BIG) == 8 and caps.split(BIG, list("abcde")) == [list("abcde")]
    caps.after_step(BIG, ran_out(largest_ok=3))
    assert caps.limit(BIG) == 3 and caps.limit(SMALL) == 8
    assert caps.split(BIG, list("abcdefg")) == [list("abc"), list("def"), ["g"]]
    caps.after_step(BIG, ran_out(largest_ok=0))  # nothing fitted, not even one row alone
    assert caps.limit(BIG) == 1 and caps.in_force() == {BIG: 1} and caps.lowest() == 1


def test_the_cap_rises_by_one_after_clean_steps_and_is_lifted_at_max_batch():
    caps = BatchCaps(max_batch=4, recover_steps=3)
    caps.after_step(BIG, ran_out(largest_ok=2))
    limits = []
    for _ in range(6):
        caps.after_step(BIG, StepOutcome(largest_ok=2))
        limits.append(caps.limit(BIG))
    assert limits == [2, 2, 3, 3, 3, 4] and caps.in_force() == {}
    caps.after_step(SMALL, StepOutcome(largest_ok=4))  # an uncapped shape stays so
    assert caps.in_force() == {} and caps.lowest() == 4


def test_running_out_again_restarts_the_count_of_clean_steps():
    caps = BatchCaps(max_batch=8, recover_steps=2)
    caps.after_step(BIG, ran_out(largest_ok=4))
    caps.after_step(BIG, StepOutcome(largest_ok=4))
    caps.after_step(BIG, ran_out(largest_ok=4))
    caps.after_step(BIG, StepOutcome(largest_ok=4))
    assert caps.limit(BIG) == 4
    caps.after_step(BIG, StepOutcome(largest_ok=4))
    assert caps.limit(BIG) == 5


@pytest.mark.parametrize("plan", [None, make_plan("edf")], ids=["fifo", "edf"])
def test_a_capped_shape_takes_no_more_rows_while_other_shapes_fill_the_slots(plan):
    caps = BatchCaps(max_batch=4)
    scheduler = BatchScheduler(4, plan=plan, caps=caps)
    for job_id in ("a", "b"):
        scheduler.add(row(job_id))
    assert scheduler.schedule(0.0).admitted == ["a", "b"]
    caps.after_step(BIG, ran_out(largest_ok=1))
    scheduler.add(row("c"))
    scheduler.add(row("d", shape=SMALL))
    out = scheduler.schedule(1.0)
    # the running rows stay; c keeps its place, the other shape's row takes a slot
    assert out.capped == ["c"] and out.admitted == ["d"]
    assert list(scheduler.running) == ["a", "b", "d"] and list(scheduler.waiting) == ["c"]
    scheduler.drop("a")
    assert scheduler.schedule(2.0).capped == ["c"]  # still one row of its shape running
    scheduler.drop("b")
    assert scheduler.schedule(3.0).admitted == ["c"]


def test_the_worker_stats_export_the_out_of_memory_counters_and_the_caps():
    caps = BatchCaps(max_batch=8)
    stats = WorkerStats(caps=caps)
    stats.oom_errors, stats.oom_retried_rows, stats.oom_failed_rows = 2, 6, 1
    caps.after_step(BIG, ran_out(largest_ok=3))
    text = generate_latest(
        make_registry({"maskserve_worker": stats.snapshot}, {"maskserve_worker": stats.COUNTERS})
    ).decode()
    for line in (
        "# TYPE maskserve_worker_oom_errors_total counter",
        "maskserve_worker_oom_errors_total 2.0",
        "maskserve_worker_oom_retried_rows_total 6.0",
        "maskserve_worker_oom_failed_rows_total 1.0",
        "# TYPE maskserve_worker_batch_cap gauge",
        "maskserve_worker_batch_cap 3.0",
        'maskserve_worker_batch_caps{key="kv:128x128"} 3.0',
    ):
        assert line in text

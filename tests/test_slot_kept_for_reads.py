"""A waiting row passed over for a free slot while its template's cache is read keeps the slot
from the rows due after it (``DeadlinePlan.keep_slot_while_reading``): pure scenarios, no torch, no
clock."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from backend.worker.batch_rows import Row
from backend.worker.batching import BatchScheduler
from tests.deadline_factory import Harness, make_plan, make_row


def reading_until(job_id: str, lands: float) -> Callable[[float], Callable[[Row], bool]]:
    """``ready`` at each time: ``job_id``'s cache read lands at ``lands``; every other row is
    ready."""
    return lambda now: lambda row: row.job_id != job_id or now >= lands


@pytest.mark.parametrize("scheduler", ["edf", "slack"])
@pytest.mark.parametrize("keep", [True, False])
def test_a_row_whose_cache_is_being_read_keeps_its_free_slot_from_a_looser_row(scheduler, keep):
    plan = make_plan(scheduler, size_batches=False, keep_slot_while_reading=keep)
    h = Harness(BatchScheduler(2, plan=plan))
    h.s.add(make_row("long", steps=30, deadline=1000.0))
    h.tick(0.0)
    h.s.add(make_row("tight", steps=5, deadline=8.0, at=1.0))
    h.s.add(make_row("loose", steps=20, deadline=500.0, at=1.0))
    ready = reading_until("tight", lands=2.0)
    out = h.tick(1.0, ready(1.0))
    assert out.held == ["tight"]
    if keep:  # the slot waits for tight's read; loose waits for a slot
        assert out.admitted == [] and len(h.s.running) == 1
        assert h.tick(2.0, ready(2.0)).admitted == ["tight"]
        for t in range(3, 7):
            h.tick(float(t), ready(float(t)))
        assert h.finished_at["tight"] == 7.0 and h.s.parks == 0  # on time (due at 8)
    else:  # loose takes it for its 20 steps: tight waits for a slot to free (edf, late), or
        # parks loose once it cannot wait any longer (slack: a park, and just on time)
        assert out.admitted == ["loose"]
        for t in range(2, 12):
            h.tick(float(t), ready(float(t)))
        if scheduler == "edf":
            assert h.finished_at.get("tight", math.inf) > 8.0
        else:
            assert h.s.parks == 1 and h.finished_at["tight"] == 8.0


def test_a_row_due_before_the_reading_row_still_takes_the_slot():
    """By deadline, not by the order: ``first`` goes first by priority, ``early`` is due
    before it; no running row ends in time for ``first``."""
    for park_by_deadline, admitted in ((True, ["early"]), (False, [])):
        plan = make_plan(size_batches=False, park_by_deadline=park_by_deadline)
        h = Harness(BatchScheduler(2, plan=plan))
        h.s.add(make_row("long", steps=60, deadline=1000.0))
        h.tick(0.0)
        h.s.add(make_row("first", steps=5, deadline=20.0, priority=5, at=1.0))
        h.s.add(make_row("early", steps=5, deadline=15.0, at=1.0))
        out = h.tick(1.0, reading_until("first", lands=3.0)(1.0))
        # by precedence alone the slot is kept from every row after the reading row
        assert out.held == ["first"] and out.admitted == admitted


def test_a_slot_is_not_kept_for_a_row_that_another_slot_reaches_in_time():
    h = Harness(BatchScheduler(2, plan=make_plan(size_batches=False)))
    h.s.add(make_row("ending", steps=3, deadline=1000.0))
    h.tick(0.0)
    h.s.add(make_row("tight", steps=5, deadline=20.0, at=1.0))
    h.s.add(make_row("loose", steps=20, deadline=500.0, at=1.0))
    out = h.tick(1.0, reading_until("tight", lands=3.0)(1.0))
    assert out.held == ["tight"] and out.admitted == ["loose"]  # "ending" frees its slot at 3


def test_a_row_due_for_the_starvation_bound_is_not_kept_out_by_a_read():
    """``older`` (tight) and ``younger`` (loose) wait behind ``tight``'s 5 steps; ``older``'s
    read never lands."""
    h = Harness(BatchScheduler(2, plan=make_plan("edf", max_wait_s=10.0, size_batches=False)))
    h.s.add(make_row("long", steps=40, deadline=1000.0))
    h.tick(0.0)
    h.s.add(make_row("older", steps=5, deadline=20.0, at=0.5))
    h.s.add(make_row("younger", steps=5, deadline=950.0, at=1.0))
    h.s.add(make_row("tight", steps=5, deadline=10.0, at=1.0))
    ready = reading_until("older", lands=math.inf)
    assert h.tick(1.0, ready(1.0)).admitted == ["tight"]
    admitted_at = {}
    for t in range(2, 14):
        for job_id in h.tick(float(t), ready(float(t))).admitted:
            admitted_at[job_id] = float(t)
    # the slot tight left at 6 is kept for older until younger is due: let in by its bound
    assert h.s.running["younger"].due and 6.0 < admitted_at["younger"] <= 1.0 + 10.0

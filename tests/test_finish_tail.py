"""The finish tail a worker measures from its jobs' records (pure): the quantile of the recent
tails, what is forgotten, and what is refused."""

from __future__ import annotations

import pytest

from backend.worker.finish_tail import FinishTail


def handed_and_done(tail: FinishTail, tails_s: list[float], at: float = 100.0) -> None:
    for i, seconds in enumerate(tails_s):
        tail.handed_on(f"j{i}", at)
        tail.resolve(f"j{i}", at + seconds, ended=True)


def test_nothing_is_reserved_before_a_tail_was_measured():
    tail = FinishTail()
    tail.handed_on("a", 10.0)
    assert tail.reserve_s() == 0.0 and tail.measured == 0
    assert tail.unresolved(10.5) == ["a"]


def test_the_reserve_is_the_quantile_of_the_last_window_of_tails():
    tail = FinishTail(window=10, quantile=0.9)
    handed_and_done(tail, [0.01 * (i + 1) for i in range(10)])  # 0.01 .. 0.10
    assert tail.reserve_s() == pytest.approx(0.09)  # nearest rank: the 9th of 10
    assert tail.measured == 10
    handed_and_done(tail, [0.5] * 10)  # the window moves on: only the recent tails count
    assert tail.reserve_s() == pytest.approx(0.5) and tail.measured == 10


def test_a_job_still_on_its_way_is_asked_again_and_one_that_failed_is_forgotten():
    tail = FinishTail()
    tail.handed_on("slow", 0.0)
    tail.handed_on("failed", 0.0)
    tail.resolve("slow", None, ended=False)  # post-processing not done yet
    tail.resolve("failed", None, ended=True)  # failed, cancelled or gone: no tail
    assert tail.unresolved(1.0) == ["slow"] and tail.reserve_s() == 0.0
    tail.resolve("slow", 0.2, ended=True)
    assert tail.unresolved(1.0) == [] and tail.reserve_s() == pytest.approx(0.2)


def test_a_record_read_twice_or_of_an_unknown_job_counts_once():
    tail = FinishTail()
    handed_and_done(tail, [0.3])
    tail.resolve("j0", 200.0, ended=True)
    tail.resolve("never-handed-on", 5.0, ended=True)
    assert tail.measured == 1 and tail.reserve_s() == pytest.approx(0.3)


def test_a_clock_step_never_makes_a_negative_tail():
    tail = FinishTail()
    tail.handed_on("a", 50.0)
    tail.resolve("a", 49.0, ended=True)
    assert tail.reserve_s() == 0.0 and tail.measured == 1


def test_old_and_excess_pending_jobs_are_forgotten_oldest_first():
    tail = FinishTail(max_age_s=60.0, max_pending=3)
    for i in range(5):
        tail.handed_on(f"j{i}", float(i))
    assert tail.unresolved(10.0) == ["j2", "j3", "j4"]  # bounded: the two oldest went
    assert tail.unresolved(62.5) == ["j3", "j4"]  # j2 was handed on 60 s before
    tail.handed_on("j3", 62.5)  # handed on again (redelivered): the newest now
    assert tail.unresolved(63.0) == ["j4", "j3"]


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 0}, {"quantile": 0.0}, {"quantile": 1.5}, {"max_age_s": 0}, {"max_pending": 0}],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        FinishTail(**kwargs)

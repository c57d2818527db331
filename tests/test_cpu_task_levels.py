"""The CPU queues' levels: an edit job's pre- and post-processing tasks are taken in the engine
workers' order of precedence (priority, then the interactive class), coarsened to ten levels."""

from __future__ import annotations

import pytest

from backend.protocol.keys import CPU_TASK_LEVELS, cpu_queue_lists, cpu_task_level

PRIORITIES = range(10)


@pytest.mark.parametrize("priority", PRIORITIES)
def test_an_interactive_job_goes_before_a_batch_job_of_the_same_priority(priority):
    assert cpu_task_level("interactive", priority) < cpu_task_level("batch", priority)


def test_a_higher_pair_of_priorities_goes_first_whatever_the_class():
    for high in PRIORITIES:
        for low in PRIORITIES:
            if (9 - high) // 2 < (9 - low) // 2:  # pairs: (9, 8), (7, 6), ..., (1, 0)
                for a in ("interactive", "batch"):
                    for b in ("interactive", "batch"):
                        assert cpu_task_level(a, high) < cpu_task_level(b, low), (a, high, b, low)
    levels = {cpu_task_level(c, p) for c in ("interactive", "batch") for p in PRIORITIES}
    assert levels == set(CPU_TASK_LEVELS)  # every level is used
    # the default levels: the studio's jobs (interactive, priority 0) one ahead of REST's
    assert (cpu_task_level("interactive", 0), cpu_task_level("batch", 0)) == (8, 9)


def test_two_priorities_share_a_pair_of_levels_and_out_of_range_ones_are_clamped():
    assert cpu_task_level("batch", 9) == cpu_task_level("batch", 8) == 1
    assert cpu_task_level("interactive", 7) == cpu_task_level("interactive", 6) == 2
    assert cpu_task_level("batch", 12) == cpu_task_level("batch", 9)
    assert cpu_task_level("batch", -3) == cpu_task_level("batch", 0)


def test_a_queue_keeps_one_list_per_level_the_first_under_its_own_name():
    lists = cpu_queue_lists("maskserve.pre")
    assert len(lists) == len(CPU_TASK_LEVELS) == len(set(lists))
    assert lists[0] == "maskserve.pre" and lists[8] == "maskserve.pre\x06\x168"

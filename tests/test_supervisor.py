"""The restart policy of `maskserve up` and the reconnection backoff (pure, milliseconds)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.config import SettingsError, load_settings
from backend.services.supervisor import Backoff, Reconnect, RestartPolicy, RoleRecord

POLICY = RestartPolicy(Backoff(initial_s=1.0, cap_s=30.0), stable_s=60.0)


def test_the_delay_doubles_from_the_initial_one_up_to_the_cap():
    backoff = Backoff(initial_s=1.0, cap_s=30.0)
    assert [backoff.delay(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


@given(st.integers(min_value=1, max_value=10**6))
def test_a_role_that_keeps_crashing_is_retried_at_the_cap_forever(failures):
    delay = Backoff(initial_s=0.5, cap_s=30.0).delay(failures)
    assert 0.5 <= delay <= 30.0


def test_bad_backoff_values_are_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="initial_s <= cap_s"):
        Backoff(initial_s=5.0, cap_s=1.0)
    with pytest.raises(ValueError, match="counts from 1"):
        Backoff(1.0, 2.0).delay(0)


def test_quick_exits_back_off_and_a_stable_run_resets_the_delay():
    record = RoleRecord("worker-0", started_at=0.0)
    now, delays = 0.0, []
    for _ in range(4):  # crashes 2 s after each start
        now += 2.0
        delays.append(record.exited(now, 1, POLICY))
        assert not record.running and not record.due(now)
        now = record.restart_at
        assert record.due(now)
        record.restarted(now)
    assert delays == [1.0, 2.0, 4.0, 8.0] and record.restarts == 4
    now += 120.0  # then it served two minutes before exiting: healthy, back to the first delay
    assert record.exited(now, 137, POLICY) == 1.0
    assert record.last_exit == 137 and record.failures == 1
    assert record.restarts == 4  # counted when the restart happens, never lowered


def test_the_record_refuses_impossible_transitions():
    record = RoleRecord("api", started_at=0.0)
    with pytest.raises(ValueError, match="while it was running"):
        record.restarted(1.0)
    record.exited(1.0, 1, POLICY)
    with pytest.raises(ValueError, match="while it was not running"):
        record.exited(2.0, 1, POLICY)


def test_reconnect_backs_off_and_says_when_an_outage_ends():
    reconnect = Reconnect(Backoff(initial_s=0.2, cap_s=1.0))
    assert reconnect.connected and not reconnect.succeeded()  # no outage: nothing to redo
    assert [reconnect.failed() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert not reconnect.connected
    assert reconnect.succeeded() and reconnect.connected


def test_supervisor_settings_come_from_the_environment_and_are_checked():
    settings = load_settings(
        env={"MASKSERVE_RESTART_INITIAL_S": "0.5", "MASKSERVE_RESTART_MAX_S": "10"}
    )
    assert (settings.supervisor.restart_initial_s, settings.supervisor.restart_max_s) == (0.5, 10)
    with pytest.raises(SettingsError, match="restart_max_s"):
        load_settings(env={"MASKSERVE_RESTART_INITIAL_S": "5", "MASKSERVE_RESTART_MAX_S": "1"})
    with pytest.raises(SettingsError, match="reconnect_max_s"):
        load_settings(env={"MASKSERVE_RECONNECT_INITIAL_S": "5", "MASKSERVE_RECONNECT_MAX_S": "1"})

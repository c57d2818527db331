"""`maskserve up`'s plan of processes (pure): one engine worker per device, CPU roles share the
cores."""

from __future__ import annotations

import socket

from backend.config import load_settings
from backend.services.stack import UP_METRICS, assign_metrics_ports, plan_roles, port_is_free


def test_one_engine_worker_per_gpu_and_cpu_threads_shared(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    roles = {
        r.name: r for r in plan_roles(load_settings(env={}), ["cuda:0", "cuda:1"], cpu_workers=2)
    }
    assert set(roles) == {
        "cpu-worker-0",
        "cpu-worker-1",
        "dispatcher",
        "worker-0",
        "worker-1",
        "api",
    }
    assert roles["worker-1"].args == ["worker", "--device", "cuda:1", "--worker-id", "worker-0-1"]
    assert roles["cpu-worker-0"].env == {"OMP_NUM_THREADS": "8"} and roles["worker-0"].env == {}


def test_a_cpu_only_machine_runs_one_cpu_worker_and_the_operator_can_pin_threads(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    roles = {r.name: r for r in plan_roles(load_settings(env={}), ["cpu"], cpu_workers=1)}
    assert roles["worker-0"].args[:3] == ["worker", "--device", "cpu"]
    assert roles["worker-0"].env == roles["cpu-worker-0"].env == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert all(not r.env for r in plan_roles(load_settings(env={}), ["cpu"], cpu_workers=1))


def test_every_role_but_the_api_gets_its_own_metrics_port(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    roles = plan_roles(load_settings(env={}), ["cuda:0", "cuda:1"], cpu_workers=2)
    ports = assign_metrics_ports(roles, load_settings(env={}), lambda port: True)
    assert sorted(ports) == [
        "cpu-worker-0",
        "cpu-worker-1",
        "dispatcher",
        UP_METRICS,
        "worker-0",
        "worker-1",
    ]
    assert len(set(ports.values())) == 6
    by_name = {r.name: r for r in roles}
    assert by_name["worker-1"].env["MASKSERVE_WORKER_METRICS_PORT"] == str(ports["worker-1"])
    assert by_name["cpu-worker-0"].env["MASKSERVE_CPU_METRICS_PORT"] == str(ports["cpu-worker-0"])
    assert not any("METRICS" in key for key in by_name["api"].env)
    # a configured port is the first of its kind's: two engine workers cannot both bind it
    roles = plan_roles(load_settings(env={}), ["cuda:0", "cuda:1"])
    configured = assign_metrics_ports(
        roles, load_settings(env={"MASKSERVE_WORKER_METRICS_PORT": "9300"}), lambda port: True
    )
    assert (configured["worker-0"], configured["worker-1"]) == (9300, 9301)


def _assign(settings, devices=("cpu",), **kwargs) -> dict[str, int]:
    roles = plan_roles(settings, list(devices), cpu_workers=2)
    return assign_metrics_ports(roles, settings, **kwargs)


def test_metrics_ports_are_the_documented_fixed_ones_at_every_start_while_free():
    """The real check of a port (a bind on ``metrics_host``) on a base nothing listens on."""
    settings = load_settings(env={"MASKSERVE_METRICS_BASE_PORT": str(_quiet_base())})
    base = settings.supervisor.metrics_base_port
    first, second = _assign(settings), _assign(settings)
    assert (
        first
        == second
        == {
            UP_METRICS: base,
            "dispatcher": base + 1,
            "cpu-worker-0": base + 10,
            "cpu-worker-1": base + 11,
            "worker-0": base + 20,
        }
    )
    assert load_settings(env={}).supervisor.metrics_base_port == 9101  # the documented default


def test_a_taken_fixed_port_falls_back_to_a_free_one_and_the_others_keep_theirs():
    settings = load_settings(env={"MASKSERVE_METRICS_BASE_PORT": str(_quiet_base())})
    base = settings.supervisor.metrics_base_port
    with socket.socket() as listener:  # something else serves the dispatcher's fixed port
        listener.bind((settings.metrics_host, base + 1))
        listener.listen()
        ports = _assign(settings)
    assert ports["dispatcher"] != base + 1 and ports["dispatcher"] not in (
        base,
        base + 10,
        base + 11,
        base + 20,
    )
    assert (ports[UP_METRICS], ports["cpu-worker-0"], ports["worker-0"]) == (
        base,
        base + 10,
        base + 20,
    )
    assert _assign(settings)["dispatcher"] == base + 1  # free again: the fixed one again


def test_a_fallback_never_takes_another_roles_fixed_port_and_base_zero_means_free_ports():
    settings = load_settings(env={"MASKSERVE_METRICS_BASE_PORT": "9101"})
    picks = iter([9111, 9121, 40001])  # the first free ports offered are fixed ones of others
    ports = _assign(settings, port_free=lambda port: port != 9102, pick_port=lambda: next(picks))
    assert ports["dispatcher"] == 40001 and ports["cpu-worker-0"] == 9111
    free = iter(range(50000, 50100))
    ports = _assign(
        load_settings(env={"MASKSERVE_METRICS_BASE_PORT": "0"}),
        port_free=lambda port: True,
        pick_port=lambda: next(free),
    )
    assert sorted(ports.values()) == list(range(50000, 50005))


def _quiet_base() -> int:
    """A base whose 21 ports nothing listens on now (this machine runs other tests)."""
    for base in range(42101, 60000, 97):
        if all(port_is_free(port) for port in range(base, base + 21)):
            return base
    raise AssertionError("no quiet range of ports")

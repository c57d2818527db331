"""`maskserve up`'s plan of processes (pure): one engine worker per device, CPU roles share the
cores."""

from __future__ import annotations

from backend.config import load_settings
from backend.services.stack import assign_metrics_ports, plan_roles


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
    free = iter(range(9100, 9200))
    ports = assign_metrics_ports(roles, load_settings(env={}), lambda: next(free))
    assert sorted(ports) == ["cpu-worker-0", "cpu-worker-1", "dispatcher", "worker-0", "worker-1"]
    assert len(set(ports.values())) == 5
    by_name = {r.name: r for r in roles}
    assert by_name["worker-1"].env["MASKSERVE_WORKER_METRICS_PORT"] == str(ports["worker-1"])
    assert by_name["cpu-worker-0"].env["MASKSERVE_CPU_METRICS_PORT"] == str(ports["cpu-worker-0"])
    assert not any("METRICS" in key for key in by_name["api"].env)
    # a configured port is the first of its kind's: two engine workers cannot both bind it
    roles = plan_roles(load_settings(env={}), ["cuda:0", "cuda:1"])
    configured = assign_metrics_ports(
        roles, load_settings(env={"MASKSERVE_WORKER_METRICS_PORT": "9300"}), lambda: next(free)
    )
    assert (configured["worker-0"], configured["worker-1"]) == (9300, 9301)

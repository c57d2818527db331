"""Each role loads only what it runs: imports are checked in a fresh interpreter per module.

The dispatcher, the API and the studio never import a model library; the pure cores import neither
a model library nor Redis. A module that starts importing one fails here, naming what it pulled in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_LIBRARIES = ("torch", "diffusers", "transformers")

ROLE_MODULES = (
    "backend.dispatch.service",  # the dispatcher
    "backend.api.app",  # the API
    "backend.api.server",
    "backend.adapters.store",  # the API's adapter registry
    "backend.adapters.service",
    "studio.mount",  # the studio
    "studio.app",
    "studio.gallery_tab",
    "studio.history_tab",
    "backend.cachestatus",
    "backend.janitor",
    "backend.config_reference",
)
PURE_CORES = (
    "backend.protocol",
    "backend.protocol.adapters",
    "backend.costmodel.costs",
    "backend.costmodel.plan",
    "backend.costmodel.profiles",
    "backend.models.catalog",
    "backend.models",
    "backend.engine.buckets",
    "backend.worker.batching",
    "backend.worker.admission",
    "backend.dispatch.router",
    "backend.dispatch.policies",
    "backend.dispatch.views",
    "backend.dispatch.adapter_cost",
    "backend.worker.adapter_book",
    "backend.worker.deadlines",
    "backend.worker.step_clock",
    "backend.worker.forecasts",
    "backend.costmodel.slack",
    "backend.dispatch.deadline_cost",
    "backend.api.admission_control",
    "backend.cache.manager",
    "backend.cache.policies",
    "backend.retention",
)


def _probe(module: str, watched: tuple[str, ...]) -> subprocess.Popen[str]:
    """A fresh interpreter that imports ``module`` alone and prints which of ``watched`` (top-level
    packages) ended up in ``sys.modules``."""
    code = (
        f"import json, sys, {module}; "
        f"print(json.dumps([m for m in {list(watched)!r} if m in sys.modules]))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(probe: subprocess.Popen[str]) -> list[str]:
    out, err = probe.communicate(timeout=180)
    assert probe.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def loaded_after_import(module: str, watched: tuple[str, ...]) -> list[str]:
    return _result(_probe(module, watched))


WATCHED_ROLE = (*MODEL_LIBRARIES, "celery")
WATCHED_CORE = (*MODEL_LIBRARIES, "redis")


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    """Module -> what importing it loaded, every probe run at once (each in its own process)."""
    probes = {m: _probe(m, WATCHED_ROLE) for m in ROLE_MODULES}
    probes |= {m: _probe(m, WATCHED_CORE) for m in PURE_CORES}
    return {module: _result(probe) for module, probe in probes.items()}


@pytest.mark.parametrize("module", ROLE_MODULES)
def test_roles_that_run_no_model_import_no_model_library(module, loaded):
    assert [name for name in loaded[module] if name in MODEL_LIBRARIES] == []


@pytest.mark.parametrize("module", PURE_CORES)
def test_pure_cores_import_neither_model_libraries_nor_redis(module, loaded):
    assert loaded[module] == []


def test_the_dispatcher_routes_without_celery(loaded):
    """Routing reads streams and heartbeats; the CPU stages' task queue is not its business."""
    assert "celery" not in loaded["backend.dispatch.service"]


def test_the_probe_sees_an_import():
    """The guard can fail: a module that does import torch is reported."""
    assert loaded_after_import("backend.engine.attention", MODEL_LIBRARIES) == ["torch"]

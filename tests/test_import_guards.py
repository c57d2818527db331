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
    "studio.mount",  # the studio
    "studio.app",
    "backend.cachestatus",
    "backend.janitor",
    "backend.config_reference",
)
PURE_CORES = (
    "backend.protocol",
    "backend.costmodel.costs",
    "backend.costmodel.plan",
    "backend.costmodel.profiles",
    "backend.models.catalog",
    "backend.models",
    "backend.worker.batching",
    "backend.dispatch.router",
    "backend.cache.manager",
    "backend.cache.policies",
    "backend.retention",
)


def loaded_after_import(module: str, watched: tuple[str, ...]) -> list[str]:
    """The ``watched`` top-level packages in ``sys.modules`` after importing ``module`` alone."""
    probe = (
        f"import json, sys, {module}; "
        f"print(json.dumps([m for m in {list(watched)!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ROLE_MODULES)
def test_roles_that_run_no_model_import_no_model_library(module):
    assert loaded_after_import(module, MODEL_LIBRARIES) == []


@pytest.mark.parametrize("module", PURE_CORES)
def test_pure_cores_import_neither_model_libraries_nor_redis(module):
    assert loaded_after_import(module, (*MODEL_LIBRARIES, "redis")) == []


def test_the_probe_sees_an_import():
    """The guard can fail: a module that does import torch is reported."""
    assert loaded_after_import("backend.engine.attention", MODEL_LIBRARIES) == ["torch"]


def test_the_dispatcher_routes_without_celery():
    """Routing reads streams and heartbeats; the CPU stages' task queue is not its business."""
    assert loaded_after_import("backend.dispatch.service", ("celery",)) == []

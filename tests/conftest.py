"""Shared fixtures: settings, tiny models and template images built with fixed seeds."""

from __future__ import annotations

import pytest
import torch

pytest_plugins = ["tests.redis_fixtures"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")

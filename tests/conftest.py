"""Shared fixtures and markers: settings, tiny models and template images built with fixed seeds.

Markers added here from what a test uses, so ``make test-fast`` can leave out everything that
needs more than Python: ``redis`` (a test using a Redis server fixture), ``model`` (a test using
the tiny models), ``browser`` (set by the browser test module), ``gpu`` (skipped without CUDA).
torch is imported only when a collected test asks for a GPU.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.redis_fixtures", "tests.s3_fixtures", "tests.api_factory"]

FIXTURE_MARKERS = {
    "redis_server": "redis",
    "redis_url": "redis",
    "redis_client": "redis",
    "models_dir": "model",
}


def _cuda_available() -> bool:
    import torch  # only when a GPU test was collected: most runs never need torch here

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture in set(FIXTURE_MARKERS) & set(getattr(item, "fixturenames", ())):
            item.add_marker(FIXTURE_MARKERS[fixture])
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _cuda_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in gpu_items:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")

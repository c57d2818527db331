"""`make clean` frees what setup and runs rebuild and keeps the user's data; `make clean-data`
deletes the data directory only when confirmed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEPT = ("templates/t.png", "blobs/results/r.png", "api_key", "logs/api.log", "train-demo/x.ckpt")
REBUILT = ("template_cache/entry.bin", "models/tiny/model_index.json")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@pytest.fixture
def checkout(tmp_path):
    """A directory with the Makefile, a virtual environment, benchmark output and a data
    directory holding both kinds of files."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for relative in (
        ".venv/bin/python",
        "bench_out/engine.json",
        *(f".maskserve/{name}" for name in KEPT + REBUILT),
    ):
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    return tmp_path


def make(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "-C", str(checkout), *args], capture_output=True, text=True, timeout=60
    )


def test_clean_removes_what_is_rebuilt_and_keeps_the_users_data(checkout):
    assert make(checkout, "clean").returncode == 0
    assert not (checkout / ".venv").exists() and not (checkout / "bench_out").exists()
    assert not any((checkout / ".maskserve" / name).exists() for name in REBUILT)
    assert all((checkout / ".maskserve" / name).is_file() for name in KEPT)


def test_clean_data_refuses_without_confirmation_and_says_what_it_would_delete(checkout):
    refused = make(checkout, "clean-data")
    assert refused.returncode != 0 and "CONFIRM=1" in refused.stdout
    assert "templates" in refused.stdout
    assert all((checkout / ".maskserve" / name).is_file() for name in KEPT + REBUILT)
    assert make(checkout, "clean-data", "CONFIRM=1").returncode == 0
    assert not (checkout / ".maskserve").exists()

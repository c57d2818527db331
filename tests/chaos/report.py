"""Measured recovery times of the chaos tests, merged into one JSON file per run of the suite.

``MASKSERVE_CHAOS_REPORT`` names the file (e.g. ``docs/bench/chaos.json``, to refresh the table
in docs/design/chaos.md); default ``test-output/chaos.json``. Each fault's entry is replaced by its
latest run, so the file holds one line of the table per fault.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from tests.chaos.checker import Verdict

DEFAULT_PATH = "test-output/chaos.json"


def report_path() -> Path:
    return Path(os.environ.get("MASKSERVE_CHAOS_REPORT") or DEFAULT_PATH)


def record(fault: str, outcome: Verdict, accepted: int, refused: list[str]) -> None:
    path = report_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("faults", {})[fault] = {
        "ok": outcome.ok,
        "violations": len(outcome.violations),
        "accepted_jobs": accepted,
        "refused_submissions": len(refused),
        "refusals": refused[:3],  # what a client was told while the fault lasted
        "fault_to_first_new_done_s": _round(outcome.first_new_done_s),
        "fault_to_all_terminal_s": _round(outcome.all_terminal_s),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    data["machine"] = f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)

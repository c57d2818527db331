"""Where fitted cost profiles live and how they are read (one file per model, device kind, mode).

Invariant: ``profile_path`` is the only place that spells a profile's file name; the profiler
writes there and every reader (engine planners, dispatcher, route simulation) reads from there.
"""

from __future__ import annotations

from pathlib import Path

from backend.costmodel.costs import CostProfile


def device_kind(device: str) -> str:
    """'cuda:1' -> 'cuda', 'cpu' -> 'cpu': profiles are fitted per device kind."""
    return "cuda" if device.startswith("cuda") else device.split(":", 1)[0]


def profile_path(profiles_dir: Path | str, model_id: str, device: str, mode: str) -> Path:
    """The profile file of ``model_id`` on ``device``'s kind in cache ``mode``."""
    safe_model = model_id.replace("/", "_").replace(":", "_")
    return Path(profiles_dir) / f"{safe_model}__{device_kind(device)}__{mode}.json"


def load_profile(profiles_dir: Path | str, model_id: str, device: str, mode: str) -> CostProfile:
    """The fitted profile; ``OSError`` when missing, ``ValueError`` when the file is malformed."""
    return CostProfile.from_json(profile_path(profiles_dir, model_id, device, mode).read_text())


def all_profiles(profiles_dir: Path | str, mode: str) -> list[CostProfile]:
    """Every profile of ``mode`` in ``profiles_dir``, in file-name order."""
    paths = sorted(Path(profiles_dir).glob(f"*__{mode}.json"))
    return [CostProfile.from_json(path.read_text()) for path in paths]

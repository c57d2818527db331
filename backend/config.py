"""One typed settings tree for every MaskServe process.

Invariant: environment variables are read here and nowhere else (``load_settings``); every other
module receives a validated ``Settings`` (or one of its sub-trees) as an argument.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CacheMode = Literal["kv", "hidden"]
DTypeName = Literal["float32", "float16", "bfloat16"]

ENV_PREFIX = "MASKSERVE_"


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the setting and what to fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PathSettings(_Strict):
    """Where MaskServe keeps its files. Sub-directories are derived from ``data_dir`` unless set."""

    data_dir: Path = Path(".maskserve")
    models_dir: Path | None = None
    cache_dir: Path | None = None
    profiles_dir: Path = Path(__file__).resolve().parent.parent / "profiles"

    def resolved_models_dir(self) -> Path:
        return self.models_dir or self.data_dir / "models"

    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or self.data_dir / "template_cache"


class EngineSettings(_Strict):
    """How the mask-aware engine runs one model on one device."""

    model_id: str = "tiny-sd2-inpaint"
    device: str = "cpu"
    dtype: DTypeName = "float32"
    cache_mode: CacheMode = "kv"
    # Tokens grown around the painted area on every token grid; hides seams at the mask border.
    mask_margin_tokens: int = Field(default=0, ge=0, le=16)
    # Past this mask ratio caching stops paying off (and quality matters more): run dense.
    dense_above_ratio: float = Field(default=0.75, gt=0.0, le=1.0)
    # An edit of a template with no cache yet records the cache on its way (second edit is fast).
    record_on_first_edit: bool = True
    template_seed: int = 0

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {value!r}")
        return value


class Settings(_Strict):
    paths: PathSettings = PathSettings()
    engine: EngineSettings = EngineSettings()
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


# Environment variable -> (section, field). The one place that knows variable names.
_ENV_FIELDS: dict[str, tuple[str | None, str]] = {
    "DATA_DIR": ("paths", "data_dir"),
    "MODELS_DIR": ("paths", "models_dir"),
    "CACHE_DIR": ("paths", "cache_dir"),
    "PROFILES_DIR": ("paths", "profiles_dir"),
    "MODEL": ("engine", "model_id"),
    "DEVICE": ("engine", "device"),
    "DTYPE": ("engine", "dtype"),
    "CACHE_MODE": ("engine", "cache_mode"),
    "MASK_MARGIN": ("engine", "mask_margin_tokens"),
    "LOG_LEVEL": (None, "log_level"),
}


def load_settings(env: Mapping[str, str] | None = None, **overrides: dict) -> Settings:
    """Build and validate the settings tree from ``env`` (default: ``os.environ``) plus overrides.

    ``overrides`` are section dicts, e.g. ``engine={"model_id": "tiny-flux-fill"}``; they win over env.
    Raises ``SettingsError`` naming the offending variable or field.
    """
    env = os.environ if env is None else env
    tree: dict[str, dict] = {"paths": {}, "engine": {}}
    top: dict = {}
    for suffix, (section, field) in _ENV_FIELDS.items():
        value = env.get(ENV_PREFIX + suffix)
        if value is None or value == "":
            continue
        (tree[section] if section else top)[field] = value
    for section, values in overrides.items():
        if section in tree:
            tree[section].update(values)
        else:
            top[section] = values
    try:
        return Settings(paths=PathSettings(**tree["paths"]), engine=EngineSettings(**tree["engine"]), **top)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise SettingsError(f"invalid settings ({problems}); set them via {ENV_PREFIX}* variables") from exc

"""docs/configuration.md is generated from the live settings tree and kept in step with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from backend import config, config_reference
from backend.cli import main

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "configuration.md"


def _fields():
    for section, field in config.Settings.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            for name, sub in model.model_fields.items():
                yield f"{section}.{name}", sub
        else:
            yield section, field


def test_committed_reference_is_current():
    committed = REFERENCE.read_text(encoding="utf-8") if REFERENCE.exists() else ""
    assert committed == config_reference.generate(), (
        "docs/configuration.md is stale: run `make docs`"
    )


def test_every_setting_is_documented():
    undocumented = [name for name, field in _fields() if not (field.description or "").strip()]
    assert not undocumented, (
        f"settings without a description (a docstring under the field in backend/config.py): "
        f"{undocumented}"
    )


def test_reference_names_every_setting_and_variable():
    text = config_reference.generate()
    for name, _ in _fields():
        assert f"| `{name}` |" in text, name
    for variable in config.env_variable_names():
        assert f"`{variable}`" in text, variable
    for section, field in config.Settings.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            assert f"\n## {section}\n" in text, section


def test_reference_shows_defaults_types_and_machine_independent_paths():
    text = config_reference.generate()
    row = next(line for line in text.splitlines() if line.startswith("| `engine.cache_mode` |"))
    assert "`MASKSERVE_CACHE_MODE`" in row and "one of `kv`, `hidden`" in row and "| `kv` |" in row
    row = next(line for line in text.splitlines() if line.startswith("| `redis.url` |"))
    assert "`MASKSERVE_REDIS_URL`, `REDIS_URL`" in row
    row = next(
        line for line in text.splitlines() if line.startswith("| `engine.mask_margin_tokens`")
    )
    assert "int, >= 0, <= 16" in row
    assert str(ROOT) not in text  # the shipped profiles directory is shown relative to the source


def test_cli_prints_writes_and_checks(tmp_path, capsys):
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == config_reference.generate()
    out = tmp_path / "configuration.md"
    assert main(["config-reference", "--check", "--out", str(out)]) == 1
    assert "is stale: run `make docs`" in capsys.readouterr().err
    assert main(["config-reference", "--out", str(out)]) == 0
    assert main(["config-reference", "--check", "--out", str(out)]) == 0


def test_generator_does_not_import_torch():
    code = (
        "import sys, backend.config_reference as r; r.generate(); "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0

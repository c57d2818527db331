"""Settings tree and the `maskserve` command line (real tiny model, real files)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from backend.cli import main
from backend.config import SettingsError, load_settings, unknown_variables
from tests.factories import make_template, rect_mask


def test_settings_from_env_and_overrides(tmp_path):
    settings = load_settings(
        {
            "MASKSERVE_DATA_DIR": str(tmp_path),
            "MASKSERVE_MODEL": "tiny-flux-fill",
            "MASKSERVE_CACHE_MODE": "hidden",
            "MASKSERVE_MASK_MARGIN": "2",
            "MASKSERVE_ATTENTION": "padded",
            "MASKSERVE_LORA_BATCHING": "grouped",
        }
    )
    assert settings.engine.model_id == "tiny-flux-fill" and settings.engine.cache_mode == "hidden"
    assert settings.engine.mask_margin_tokens == 2 and settings.engine.attention == "padded"
    assert settings.engine.lora_batching == "grouped"
    assert load_settings({}).engine.attention == "auto"
    assert load_settings({}).engine.lora_batching == "stacked"
    assert settings.paths.resolved_cache_dir() == tmp_path / "template_cache"
    overridden = load_settings({"MASKSERVE_DEVICE": "cpu"}, engine={"device": "cuda:1"})
    assert overridden.engine.device == "cuda:1"


def test_deadline_settings_from_env():
    deadlines = load_settings(
        {
            "MASKSERVE_INTERACTIVE_TARGET_S": "12.5",
            "MASKSERVE_SHED_CLASSES": "batch, interactive",
            "MASKSERVE_STEP_SCHEDULER": "edf",
            "MASKSERVE_MAX_PARKS_PER_ROUND": "0",
            "MASKSERVE_SIZE_BATCHES": "false",
            "MASKSERVE_KEEP_SLOT_WHILE_READING": "off",
        }
    ).deadlines
    assert deadlines.target_s("interactive") == 12.5 and deadlines.target_s("batch") == 600.0
    assert deadlines.shed_classes == ("batch", "interactive") and deadlines.scheduler == "edf"
    assert deadlines.max_parks_per_round == 0 and deadlines.size_batches is False
    assert deadlines.keep_slot_while_reading is False
    assert load_settings({}).deadlines.keep_slot_while_reading is True
    # an empty variable is unset (the default sheds batch); "none" sheds no class
    assert load_settings({"MASKSERVE_SHED_CLASSES": ""}).deadlines.shed_classes == ("batch",)
    assert load_settings({"MASKSERVE_SHED_CLASSES": "none"}).deadlines.shed_classes == ()


@pytest.mark.parametrize(
    "env, field",
    [
        ({"MASKSERVE_SHED_CLASSES": "bulk"}, "shed_classes"),
        ({"MASKSERVE_STEP_SCHEDULER": "random"}, "scheduler"),
        ({"MASKSERVE_ROUND_STEPS": "0"}, "round_steps"),
        ({"MASKSERVE_SIZE_BATCHES": "sometimes"}, "size_batches"),
        ({"MASKSERVE_KEEP_SLOT_WHILE_READING": "maybe"}, "keep_slot_while_reading"),
        ({"MASKSERVE_LATE_FACTOR": "0.5"}, "late_factor"),
        ({"MASKSERVE_CACHE_MODE": "both"}, "cache_mode"),
        ({"MASKSERVE_DEVICE": "tpu"}, "device"),
        ({"MASKSERVE_MASK_MARGIN": "-1"}, "mask_margin_tokens"),
        ({"MASKSERVE_ATTENTION": "dense"}, "attention"),
        ({"MASKSERVE_LORA_BATCHING": "merged"}, "lora_batching"),
        ({"MASKSERVE_LOG_LEVEL": "LOUD"}, "log_level"),
    ],
)
def test_bad_settings_name_the_field(env, field):
    with pytest.raises(SettingsError, match=field):
        load_settings(env)


@pytest.fixture()
def cli_env(tmp_path, models_dir, monkeypatch):
    monkeypatch.setenv("MASKSERVE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MASKSERVE_MODELS_DIR", str(models_dir))
    monkeypatch.setenv("MASKSERVE_MODEL", "tiny-sd2-inpaint")
    make_template().save(tmp_path / "template.png")
    rect_mask((32, 32, 96, 80)).save(tmp_path / "mask.png")
    return tmp_path


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prepare_then_edit_uses_the_cache(cli_env, capsys):
    base = ["--size", "128", "--steps", "3", "--image", str(cli_env / "template.png")]
    code, out, _ = _run(capsys, "prepare", *base)
    assert code == 0 and json.loads(out)["bytes"] > 0
    target = cli_env / "edited.png"
    code, out, _ = _run(
        capsys,
        "edit",
        *base,
        "--mask",
        str(cli_env / "mask.png"),
        "--prompt",
        "a vase",
        "--seed",
        "4",
        "--out",
        str(target),
    )
    report = json.loads(out)
    assert code == 0 and report["used_cache"] and report["seed"] == 4
    edited = np.asarray(Image.open(target))
    outside = np.asarray(Image.open(cli_env / "mask.png")) == 0
    assert np.array_equal(edited[outside], np.asarray(make_template())[outside])


def test_edit_with_bad_inputs_exits_2_with_a_message(cli_env, capsys):
    base = [
        "--size",
        "128",
        "--steps",
        "2",
        "--image",
        str(cli_env / "template.png"),
        "--prompt",
        "x",
    ]
    rect_mask((0, 0, 0, 0)).save(cli_env / "empty.png")
    code, _, err = _run(capsys, "edit", *base, "--mask", str(cli_env / "empty.png"))
    assert code == 2 and "empty" in err
    rect_mask((0, 0, 8, 8), size=64).save(cli_env / "small.png")
    code, _, err = _run(capsys, "edit", *base, "--mask", str(cli_env / "small.png"))
    assert code == 2 and "size" in err
    (cli_env / "junk.png").write_bytes(b"not an image")
    with pytest.raises(SystemExit, match="not an image"):
        main(["edit", *base, "--mask", str(cli_env / "junk.png")])
    code, _, err = _run(
        capsys, "edit", *base, "--mask", str(cli_env / "mask.png"), "--model", "tiny-nothing"
    )
    assert code == 2 and "unknown model" in err


def test_models_list(capsys):
    code, out, _ = _run(capsys, "models", "list")
    assert code == 0 and "small-sdxl-inpaint" in out.split()


def test_a_misspelt_variable_is_named_with_the_nearest_setting_and_never_its_value():
    env = {
        "MASKSERVE_API_PORTT": "8001",
        "MASKSERVE_INTERACTIVE_TARGET": "secret-3",
        "MASKSERVE_FOO": "x",
        "MASKSERVE_API_PORT": "8000",  # a setting: nothing to say
        "PATH": "/usr/bin",  # not ours
    }
    lines = unknown_variables(env)
    assert lines == [
        "MASKSERVE_API_PORTT sets no setting and is ignored: did you mean MASKSERVE_API_PORT? "
        "(docs/configuration.md)",
        "MASKSERVE_FOO sets no setting and is ignored (docs/configuration.md)",
        "MASKSERVE_INTERACTIVE_TARGET sets no setting and is ignored: did you mean "
        "MASKSERVE_INTERACTIVE_TARGET_S? (docs/configuration.md)",
    ]
    assert not any("secret" in line or "8001" in line for line in lines)
    assert load_settings(env).api.port == 8000  # the settings themselves are not touched


def test_every_command_warns_of_a_variable_that_sets_nothing(monkeypatch, capsys, caplog):
    monkeypatch.setenv("MASKSERVE_LOG_LEVL", "DEBUG")
    with caplog.at_level("WARNING", logger="maskserve"):
        assert main(["models", "list"]) == 0
    assert [r.getMessage() for r in caplog.records if r.name == "maskserve"] == [
        "MASKSERVE_LOG_LEVL sets no setting and is ignored: did you mean MASKSERVE_LOG_LEVEL? "
        "(docs/configuration.md)"
    ]

"""``scripts/gpu-checks.sh`` against the CLI, on the CPU: a GPU lease is rare and short, so a
renamed or dropped flag must fail here, not there. Every ``maskserve`` command and every Python
script the script runs parses, every check of its default list has a case (and every case is in
the list), and the test files its pytest check names exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from backend.bench.engine_arms import ARMS
from backend.cli import build_parser
from tests.factories import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "gpu-checks.sh").read_text()
LINES = SCRIPT.replace("\\\n", " ").splitlines()  # continued lines joined


def _maskserve_commands() -> list[list[str]]:
    return [
        shlex.split(line.split("$MS ", 1)[1].split(";;")[0].replace("$RESULTS", "/tmp/results"))
        for line in LINES
        if "$MS " in line and not line.lstrip().startswith("MS=")
    ]


def _cases() -> set[str]:
    return {m.group(1) for line in LINES if (m := re.fullmatch(r" {4}([a-z0-9-]+)\)(.*)", line))}


def _default_checks() -> set[str]:
    listed = re.search(r"CHECKS=\(([a-z0-9 -]+)\)", " ".join(LINES))
    assert listed, "the script's default list of checks is missing"
    return set(listed.group(1).split())


def _script_commands() -> list[list[str]]:
    """``python3 scripts/NAME.py ARGS`` lines: [path, *args] (variables as placeholders)."""
    return [
        shlex.split(
            line.split("python3 scripts/", 1)[1]
            .split(";;")[0]
            .replace("$RESULTS", "/tmp/results")
            .replace("$MASKSERVE_DATA_DIR", "/tmp/data")
        )
        for line in LINES
        if "python3 scripts/" in line
    ]


COMMANDS = _maskserve_commands()
SCRIPTS = _script_commands()


def test_the_script_runs_a_command_per_check():
    # pytest-gpu runs pytest, every other check a maskserve command or a script of scripts/
    assert len(COMMANDS) + len(SCRIPTS) >= len(_default_checks()) - 1


@pytest.mark.parametrize("argv", SCRIPTS, ids=lambda argv: argv[0])
def test_every_python_script_it_runs_exists_and_parses(argv):
    args = load_script(argv[0]).build_parser().parse_args(argv[1:])
    assert args.json.startswith("/tmp/results/")


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_every_maskserve_command_parses(argv):
    args = build_parser().parse_args(argv)
    assert callable(args.func)


def test_every_default_check_has_a_case_and_every_case_is_listed():
    assert _default_checks() == _cases()


def test_the_test_files_of_its_pytest_check_exist():
    named = set(re.findall(r"tests/[a-z_]+\.py", SCRIPT))
    assert named and all((ROOT / path).is_file() for path in named)


def test_engine_graphs_runs_first_and_fits_eight_minutes_keeping_partial_results():
    listed = re.search(r"CHECKS=\(([a-z0-9 -]+)\)", " ".join(LINES))
    assert listed and listed.group(1).split()[0] == "engine-graphs"
    limits = [int(line.split()[2]) for line in LINES if "step engine-graphs-" in line]
    assert len(limits) == 3 and sum(limits) <= 8 * 60  # each model cut off on its own
    runs = [
        build_parser().parse_args(argv)
        for argv in COMMANDS
        if any("/engine-graphs-" in arg for arg in argv)
    ]
    assert [args.model for args in runs] == [
        "arch-sd2-inpaint",
        "arch-sdxl-inpaint",
        "arch-flux-fill",
    ]
    for args in runs:  # every arm built, both batch sizes, the targets' mask ratio first
        assert args.batch == "1,8" and args.mask_ratios.split(",")[0] == "0.2"
        assert args.arms.split(",") == list(ARMS)[:5] and args.json.endswith("-cuda.json")
        assert {"maskaware-device", "maskaware-compiled"} <= set(args.arms.split(","))

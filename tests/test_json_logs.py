"""Every line a role writes to its log is one JSON object: library warnings and loggers
(transformers, diffusers, huggingface_hub, Celery, uvicorn) go through the role's JSON handler,
progress bars are off in service roles, and what still bypasses logging (a C extension or a library
writing straight to the file descriptors) is wrapped in JSON by ``maskserve up``, which writes each
role's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.config import load_settings
from backend.runtime import json_line
from backend.services.role_log import RoleLog
from backend.services.stack import Role, Stack

ROOT = Path(__file__).resolve().parent.parent

# What a service role does (``maskserve <role>``: logging first, then its imports), then library
# chatter of every kind: loggers with their own handlers, warnings, progress bars.
LIBRARIES_SPEAK = """
import logging, sys, warnings
from backend.config import load_settings
from backend.runtime import configure_logging
{before}
configure_logging(load_settings(env={{}}), "worker")
import diffusers, huggingface_hub, transformers
from diffusers.utils import logging as diffusers_logging
from huggingface_hub.utils import tqdm as hub_tqdm
from transformers.utils import logging as transformers_logging
transformers_logging.get_logger("transformers.modeling_utils").warning("transformers speaks")
transformers_logging.get_logger("transformers.tokenization").warning_once("transformers once")
diffusers_logging.get_logger("diffusers.pipelines").warning("diffusers speaks")
logging.getLogger("huggingface_hub.file_download").warning("the hub speaks")
warnings.warn("a library warns")
{bars}
"""
BARS = """
from tqdm import tqdm
from tqdm.auto import tqdm as auto_tqdm
for bar in (tqdm, auto_tqdm, diffusers_logging.tqdm, transformers_logging.tqdm, hub_tqdm):
    for _ in bar(range(3), desc="progress"):
        pass
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={  # no progress-bar switch of the caller's shell: the role's setup sets its own
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("TQDM_", "HF_HUB_DISABLE"))
        },
    )


def _records(text: str) -> list[dict]:
    """The JSON object of every line (blank lines are not lines of a log); fails on any other."""
    records = []
    for line in text.splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                raise AssertionError(f"not a JSON line: {line!r}\nin:\n{text}") from None
            assert isinstance(record, dict), line
            records.append(record)
    return records


@pytest.mark.slow
def test_a_service_role_turns_library_logs_warnings_and_progress_bars_into_json_lines():
    done = _run(LIBRARIES_SPEAK.format(before="", bars=BARS))
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    records = _records(done.stderr)
    by_message = {record["msg"]: record for record in records}
    for message, logger in (
        ("transformers speaks", "transformers.modeling_utils"),
        ("transformers once", "transformers.tokenization"),
        ("diffusers speaks", "diffusers.pipelines"),
        ("the hub speaks", "huggingface_hub.file_download"),
    ):
        assert by_message[message]["logger"] == logger
        assert by_message[message]["role"] == "worker" and by_message[message]["level"] == "WARNING"
    warned = [record for record in records if record["logger"] == "py.warnings"]
    assert len(warned) == 1 and "a library warns" in warned[0]["msg"]
    assert len(records) == 5  # each once (no second, plain copy), and no progress bar at all
    assert not any("progress" in record["msg"] for record in records)


@pytest.mark.slow
def test_libraries_imported_before_the_logging_setup_are_routed_too():
    """A library imported before ``configure_logging`` (its handler installed already) loses its
    handler then: its records are JSON lines, once."""
    before = "import diffusers, huggingface_hub.utils, transformers.utils.logging"
    done = _run(LIBRARIES_SPEAK.format(before=before, bars=""))
    assert done.returncode == 0, done.stderr
    records = _records(done.stderr)
    assert {"transformers speaks", "diffusers speaks", "the hub speaks"} <= {
        record["msg"] for record in records
    }
    assert len(records) == 5


def test_a_line_is_kept_when_json_and_wrapped_otherwise():
    record = json.dumps({"ts": 1.0, "level": "INFO", "msg": "kept"})
    assert json_line(record + "\n", "api") == record
    wrapped = json.loads(
        json_line("Segmentation fault in libfoo\n", "worker-0", "stderr", "WARNING")
    )
    assert wrapped | {"ts": 0} == {
        "ts": 0,
        "level": "WARNING",
        "logger": "stderr",
        "role": "worker-0",
        "msg": "Segmentation fault in libfoo",
    }
    bar = json.loads(json_line("  0%|     | 0/3\r 33%|#    | 1/3\r100%|#####| 3/3\n", "w"))
    assert bar["msg"] == "100%|#####| 3/3"  # a progress bar's last frame only
    assert json.loads(json_line("[1, 2]", "w"))["msg"] == "[1, 2]"  # JSON, but not an object


PRINTS_PAST_LOGGING = r"""
import json, os, sys
print("plain text on stdout", flush=True)
sys.stderr.write(json.dumps({"level": "INFO", "msg": "already json"}) + "\n")
sys.stderr.flush()
os.write(2, b"a C extension writes to fd 2\n\n   \n")
os.write(2, b" 50%|#####     | 1/2\r100%|##########| 2/2\n")
os.write(1, b"x" * 70000 + b"\n")
"""


def test_the_stack_writes_what_a_role_prints_past_logging_as_json_lines(tmp_path):
    role_log = RoleLog(tmp_path / "worker-0.log", "worker-0")
    process = subprocess.Popen(
        [sys.executable, "-c", PRINTS_PAST_LOGGING],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    role_log.pump(process.stdout, "stdout")
    role_log.pump(process.stderr, "stderr")
    assert process.wait(timeout=60) == 0
    role_log.join(timeout_s=10)
    records = _records(role_log.path.read_text())
    by_message = {record["msg"]: record for record in records}
    assert by_message["plain text on stdout"] | {"ts": 0} == {
        "ts": 0,
        "level": "INFO",
        "logger": "stdout",
        "role": "worker-0",
        "msg": "plain text on stdout",
    }
    assert by_message["a C extension writes to fd 2"]["level"] == "WARNING"
    assert by_message["already json"] == {"level": "INFO", "msg": "already json"}  # unchanged
    assert "100%|##########| 2/2" in by_message
    assert "x" * 70000 in by_message
    assert len(records) == 5  # blank lines dropped


def test_a_role_that_fails_before_its_logging_is_set_up_still_logs_json(tmp_path, redis_url):
    """``maskserve up`` starts a role that dies in argument parsing (argparse prints its usage to
    stderr, no logging yet): its log holds that as JSON lines, and the restart record's tail too."""
    settings = load_settings(
        {"MASKSERVE_REDIS_URL": redis_url, "MASKSERVE_DATA_DIR": str(tmp_path)},
        supervisor={"restart_initial_s": 30.0, "restart_max_s": 60.0},
    )
    stack = Stack(settings, [Role("dispatcher", ["dispatcher", "--no-such-option"])])
    stack.start()
    try:
        deadline = time.monotonic() + 60
        while stack.snapshot()["dispatcher"]["running"]:
            assert time.monotonic() < deadline, "the role did not exit"
            stack.poll()
            time.sleep(0.05)
        records = _records((stack.log_dir / "dispatcher.log").read_text())
        assert any("unrecognized arguments: --no-such-option" in r["msg"] for r in records)
        assert all(r["role"] == "dispatcher" and r["logger"] == "stderr" for r in records)
        assert "--no-such-option" in stack.log_tail("dispatcher")
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_cpu_worker_run_by_the_stack_logs_only_json_lines(tmp_path, redis_url):
    """The real CPU worker (Celery, then the model's CPU stages: transformers warns while they
    load) from start to stop: Celery's banner is gone, its loggers and the libraries' warnings
    are JSON records, and its shutdown line (written straight to a file descriptor) is wrapped."""
    settings = load_settings(
        {"MASKSERVE_REDIS_URL": redis_url, "MASKSERVE_DATA_DIR": str(tmp_path)}
    )
    stack = Stack(settings, [Role("cpu-worker-0", ["cpu-worker"])])
    log = stack.log_dir / "cpu-worker-0.log"
    stack.start()
    try:
        deadline = time.monotonic() + 240
        while "CPU stages of" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            assert stack.snapshot()["cpu-worker-0"]["running"], log.read_text()
            stack.poll()
            time.sleep(0.2)
    finally:
        stack.stop()
    records = _records(log.read_text())
    loggers = {record["logger"] for record in records}
    assert any(name.startswith("celery.") for name in loggers), loggers
    assert any("ready" in record["msg"] for record in records)
    assert not any("[queues]" in record["msg"] for record in records)  # no banner
    assert any("stopped after" in record["msg"] for record in records)
    assert any(  # Celery's goodbye, written to fd 2 past logging, wrapped by the stack
        record["logger"] in ("stdout", "stderr") and "Warm shutdown" in record["msg"]
        for record in records
    )
    assert {record["role"] for record in records} == {"cpu-worker"}

"""What every MaskServe process does the same way: structured logs, dying with its parent, logging
its crash, and stopping cleanly on SIGTERM/SIGINT.

Each role's entry point is ``run_<role>(settings)``, called through ``run_role`` so that a crash is
logged with its traceback and turned into exit status 1 instead of vanishing with the process.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.abc
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from backend.config import Settings

# What a client sees while Redis restarts or a link to it is cut: every role waits and retries on
# these (with backoff), never exits.
REDIS_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError)

log = logging.getLogger("maskserve")
_PR_SET_PDEATHSIG = 1


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, role, message, the exception if any, and the
    record's ``fields`` (``log.info(..., extra={"fields": {...}})``: values a log query filters on,
    such as the role and exit status of a restart) as top-level keys."""

    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "role": self.role,
            "msg": record.getMessage(),
        }
        entry |= getattr(record, "fields", {})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def json_line(line: str, role: str, logger: str = "output", level: str = "INFO") -> str:
    """``line`` as it goes into a role's log: unchanged when it is a JSON object already (a record
    of ``JsonFormatter``), else wrapped in one (text a library or C extension printed straight to
    stdout/stderr; a progress bar's carriage returns keep only the last frame)."""
    text = line.rstrip("\r\n").rsplit("\r", 1)[-1]
    if text.startswith("{"):
        try:
            if isinstance(json.loads(text), dict):
                return text
        except ValueError:
            pass
    entry = {
        "ts": round(time.time(), 3),
        "level": level,
        "logger": logger,
        "role": role,
        "msg": text,
    }
    return json.dumps(entry)


# What a service role sets in its environment before the libraries read it (children inherit it):
# no progress bars (tqdm's defaults, the hub's downloads). The operator's own values win. The CLI's
# long commands (training, benchmarks) never call ``configure_logging`` and keep their bars.
SERVICE_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
# Loggers that bring their own handler (plain text on stderr) or may be given one: their handlers
# are removed and their records propagate to the root's JSON handler.
LIBRARY_LOGGERS = (
    "transformers",
    "diffusers",
    "huggingface_hub",
    "celery",
    "kombu",
    "uvicorn",
    "uvicorn.error",
    "uvicorn.access",
    "py.warnings",
)


def configure_logging(settings: Settings, role: str) -> None:
    """Make every line this process logs one JSON object (``JsonFormatter``) on stderr: the root
    logger gets the one handler; Python ``warnings`` become records of ``py.warnings``; the
    libraries' own handlers are removed so their records reach the root (transformers, diffusers
    and huggingface_hub now, or right after their first import: ``_after_import``); their progress
    bars are off (``SERVICE_ENV``, and the libraries' switches). Idempotent. What still bypasses
    logging (a C extension writing to fd 2) is wrapped by whoever writes the log file
    (``json_line``; ``maskserve up`` does it for every role)."""
    for name, value in SERVICE_ENV.items():
        os.environ.setdefault(name, value)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    logging.captureWarnings(True)
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
    for name, quiet in _LIBRARY_SWITCHES.items():
        if name in sys.modules:
            quiet(sys.modules[name])
        else:
            _after_import(name, quiet)


def _quiet_hf(logs: ModuleType) -> None:
    """``transformers.utils.logging``, ``diffusers.utils.logging``: no default handler,
    propagation on, no progress bars."""
    logs.disable_default_handler()
    logs.enable_propagation()
    logs.disable_progress_bar()


def _quiet_hub(_logs: ModuleType) -> None:
    """``huggingface_hub.utils.logging`` gives the library's logger a handler when imported; its
    progress bars follow ``HF_HUB_DISABLE_PROGRESS_BARS`` (``SERVICE_ENV``) read at its import, or
    the switch when it was imported before."""
    library = logging.getLogger("huggingface_hub")
    library.handlers.clear()
    library.propagate = True
    hub_utils = sys.modules.get("huggingface_hub.utils")
    if hub_utils is not None and hasattr(hub_utils, "disable_progress_bars"):
        hub_utils.disable_progress_bars()


# the module that installs a library's own stderr handler -> what undoes it (right after that
# module's import when it comes later: ``_after_import``)
_LIBRARY_SWITCHES: dict[str, Callable[[ModuleType], None]] = {
    "transformers.utils.logging": _quiet_hf,
    "diffusers.utils.logging": _quiet_hf,
    "huggingface_hub.utils.logging": _quiet_hub,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a function on a module right after its first import (a library installs its handler
    at import time; importing it here instead would cost a role that never uses it seconds and
    hundreds of MB: the dispatcher, the API)."""

    def __init__(self) -> None:
        self.hooks: dict[str, Callable[[ModuleType], None]] = {}

    def find_spec(self, fullname, path, target=None):
        hook = self.hooks.pop(fullname, None)
        if hook is None:
            return None
        # the other finders (this one has no hook for it now); a submodule's parent is imported
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookedLoader(spec.loader, hook)
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hook: Callable[[ModuleType], None]):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        try:
            self.hook(module)
        except Exception:  # a library's layout changed: keep the import, say so
            log.warning("could not route the logs of %s", module.__name__, exc_info=True)

    def __getattr__(self, name: str):  # get_resource_reader, is_package, get_source...
        return getattr(self.loader, name)


_import_hooks = _AfterImport()


def _after_import(name: str, hook: Callable[[ModuleType], None]) -> None:
    if _import_hooks not in sys.meta_path:
        sys.meta_path.insert(0, _import_hooks)
    _import_hooks.hooks[name] = hook


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits (no orphans after Ctrl-C of `up`)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            log.warning("prctl unavailable: this process will outlive its parent")


def stop_event_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (the loop finishes its step, then exits)."""
    stop = threading.Event()

    def handler(signum, _frame):
        log.info("signal %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def run_role(role: str, entry: Callable[[Settings], int | None], settings: Settings) -> int:
    configure_logging(settings, role)
    die_with_parent()
    started = time.time()
    try:
        status = entry(settings) or 0
    except KeyboardInterrupt:
        status = 0
    except Exception:
        log.exception("%s crashed after %.1f s", role, time.time() - started)
        return 1
    log.info("%s stopped after %.1f s", role, time.time() - started)
    return status

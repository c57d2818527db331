"""What every MaskServe process does the same way: structured logs, dying with its parent, logging
its crash, and stopping cleanly on SIGTERM/SIGINT.

Each role's entry point is ``run_<role>(settings)``, called through ``run_role`` so that a crash is
logged with its traceback and turned into exit status 1 instead of vanishing with the process.
"""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable

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


def configure_logging(settings: Settings, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)


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

"""A role's log file under ``maskserve up`` (``RoleLog``): the lines of its stdout and stderr, one
JSON object each, and its rotation (``rotate_log``, copytruncate) by the stack's supervision."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import IO

from backend.runtime import json_line

log = logging.getLogger(__name__)

LOG_PUMP_JOIN_S = 1.0  # how long a role's exit waits for the last lines of its output (a child
# that outlives it may hold the pipe: supervision goes on)
MAX_LOG_LINE = 1 << 20  # a longer line (no newline in a MiB of output) is cut into several


def rotate_log(path: Path, max_bytes: int) -> bool:
    """Copy a log past ``max_bytes`` to ``<name>.1`` and empty it in place ("copytruncate"): its
    writer (``RoleLog``) appends, so its next line lands at the start of the emptied file. Lines
    written between the copy and the truncation are lost; that window is one copy of at most
    ``max_bytes`` plus what arrived meanwhile. True when rotated."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        shutil.copyfile(path, path.with_name(path.name + ".1"))
        os.truncate(path, 0)
    except OSError as exc:  # a full disk must not stop supervision: try again next turn
        log.warning("log %s not rotated: %s", path, exc)
        return False
    return True


class RoleLog:
    """A role's log file, written by the threads that read its stdout and stderr: each line once
    a whole line is read, as one JSON object (``json_line``; blank lines are dropped). The file is
    opened for appending, so ``rotate_log`` can empty it under the writers. ``role``: what the
    wrapped lines name, as the role's own records do (its kind: ``cpu-worker``; the file is the
    instance's)."""

    def __init__(self, path: Path, role: str):
        self.path, self.role = path, role
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        try:
            path.touch()  # there from the start, like the role's
        except OSError as exc:
            log.warning("log %s not created: %s", path, exc)

    def pump(self, source: IO[bytes], stream: str) -> None:
        """Copy ``source`` (the role's ``stream``, stdout or stderr) into the log from a daemon
        thread until its end (the role and whatever inherited the pipe exited)."""
        level = "WARNING" if stream == "stderr" else "INFO"
        thread = threading.Thread(
            target=self._copy, args=(source, stream, level), name=f"log-{self.role}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _copy(self, source: IO[bytes], stream: str, level: str) -> None:
        try:
            with source:
                for raw in iter(lambda: source.readline(MAX_LOG_LINE), b""):
                    text = raw.decode("utf-8", errors="replace")
                    if text.strip():
                        self.write(json_line(text, self.role, logger=stream, level=level))
        except (OSError, ValueError) as exc:  # the pipe closed under the reader
            log.warning("log of %s: reading its %s stopped: %s", self.role, stream, exc)

    def write(self, line: str) -> None:
        data = (line + "\n").encode()
        with self._lock:
            try:
                with open(self.path, "ab") as out:
                    out.write(data)
            except OSError as exc:  # a full disk must not stop the role: its line is lost
                log.warning("log %s: a line of %s lost: %s", self.path, self.role, exc)

    def join(self, timeout_s: float = LOG_PUMP_JOIN_S) -> None:
        """Wait (at most ``timeout_s`` in all) for the readers to reach the end of the output."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [thread for thread in self._threads if thread.is_alive()]

"""``maskserve up --share``: a public Gradio share link to the studio, behind the same login.

The API process opens the tunnel once uvicorn is serving (``open_share_link``) and writes the
outcome to ``<data_dir>/share_url`` (the link, or ``error: <why>``) for ``maskserve up`` to print.
The tunnel needs Gradio's share server on the internet; where it cannot be reached the studio still
runs locally and the reason is reported, nothing crashes.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from pathlib import Path

from backend.atomic import write_atomic
from backend.config import Settings

log = logging.getLogger(__name__)
SHARE_WAIT_S = 60.0


def share_url_path(settings: Settings) -> Path:
    return Path(settings.paths.data_dir) / "share_url"


def open_share_link(settings: Settings, is_serving) -> threading.Thread:
    """Start a thread that waits for ``is_serving()`` and then opens the tunnel."""

    def run() -> None:
        while not is_serving():
            time.sleep(0.2)
        try:
            from gradio import networking

            url = networking.setup_tunnel(
                settings.api.host,
                settings.api.port,
                secrets.token_urlsafe(32),
                settings.studio.share_server or None,
                None,
            )
            outcome = url.rstrip("/") + settings.studio.path + "/"
            log.info("studio share link: %s", outcome)
        except Exception as exc:  # any failure to reach the share server: report it, keep serving
            outcome = (
                f"error: no share link ({exc}; {exc.__cause__ or 'no further detail'}): is the "
                "internet reachable from this machine?"
            )
            log.warning("%s", outcome)
        write_atomic(share_url_path(settings), outcome.encode())

    thread = threading.Thread(target=run, name="share-link", daemon=True)
    thread.start()
    return thread


def wait_for_share_url(settings: Settings, stop, timeout_s: float = SHARE_WAIT_S) -> str:
    """The link (or ``error: ...``) the API process wrote, waiting up to ``timeout_s``."""
    path, deadline = share_url_path(settings), time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if path.exists():
            return path.read_text()
        stop.wait(0.2)
    return f"error: no share link within {timeout_s:.0f} s (see the api log)"

"""An ASGI app served over real HTTP by uvicorn in a thread, on a free port, for tests whose
client must speak HTTP (the openai package, schemathesis)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from backend.services.redis_server import free_port


@contextlib.contextmanager
def serve(app, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Yields the base URL (``http://127.0.0.1:<port>``) once uvicorn has started; stops it
    after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)

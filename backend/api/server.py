"""`maskserve api`: the REST API served by uvicorn on ``settings.api.host:port``.

Entry convention (``backend.runtime``): call it as ``run_role("api", run_api, settings)``; logging
is configured there (uvicorn's own logging config is switched off so its lines go through the same
JSON handler), and uvicorn stops cleanly on SIGTERM/SIGINT. The process also runs the blob janitor
(``backend.janitor``: why there is said there) and the CPU-task lease sweeper
(``backend.tasks.celery_app.start_lease_sweeper``), which re-sends a pre/post-processing task lost
with its Celery worker.
"""

from __future__ import annotations

import logging

import uvicorn

from backend.config import Settings

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM/SIGINT once it has shut down (so the process dies of the
    signal); MaskServe processes stop cleanly and return instead, and ``run_role`` logs the exit."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()


def run_api(settings: Settings) -> int:
    from backend.api.app import create_app
    from backend.janitor import start_janitor
    from backend.tasks.celery_app import start_lease_sweeper

    api = settings.api
    if settings.studio.share and api.auth_disabled:
        raise ValueError(
            "a studio share link is public: it needs the login, so unset MASKSERVE_AUTH_DISABLED"
        )
    if api.auth_disabled:
        log.warning(
            "API auth is DISABLED (MASKSERVE_AUTH_DISABLED): anyone who reaches %s:%d can submit "
            "jobs",
            api.host,
            api.port,
        )
    elif not api.api_keys:
        log.error(
            "no API keys configured: every /v1 request will be refused with 401; set "
            "MASKSERVE_API_KEYS (comma-separated) or MASKSERVE_AUTH_DISABLED=1 for local use"
        )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=api.host,
        port=api.port,
        log_config=None,
        access_log=False,
        proxy_headers=False,
        timeout_graceful_shutdown=5,
        server_header=False,
    )
    log.info("API on http://%s:%d (docs at /docs)", api.host, api.port)
    server = _Server(config)
    if settings.studio.share:
        from studio.share import open_share_link

        open_share_link(settings, lambda: server.started)
    stop_janitor = start_janitor(
        settings, app.state.redis, app.state.service.blobs, app.state.metrics.record_sweep
    )
    service = app.state.service
    stop_sweeper = start_lease_sweeper(
        service.celery_app, app.state.redis, settings, service.jobstate
    )
    try:
        server.run()
    finally:
        stop_sweeper.set()
        if stop_janitor is not None:
            stop_janitor.set()
    return 0 if server.started else 1

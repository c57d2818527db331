"""Mounts the studio into the API's FastAPI app: one process, one port, one auth layer.

The Gradio login page checks ``Guard.check_login`` (the users in ``MASKSERVE_USERS``; failed
sign-ins throttled by ``studio.login_throttle``), the REST routes check the same Guard's API keys;
with auth disabled neither asks. The studio acts as one tenant, ``Guard.studio_owner``: its
templates, jobs and adapters are that tenant's. ``/``
redirects to the studio so a person opening the server's address lands on it, and
``/favicon.ico`` to the studio's icon (browsers ask the site's root for it on every page).
"""

from __future__ import annotations

import gradio as gr
from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from backend.api.middleware import ApiMetrics
from backend.api.security import Guard
from backend.api.service import JobService
from backend.config import Settings
from studio.actions import StudioActions
from studio.app import build_studio
from studio.components import CSS, EDITOR_JS
from studio.login_throttle import LoginThrottle
from templates_store.store import TemplateStore

NO_USERS_MESSAGE = (
    "No studio users are configured on this server, so nobody can sign in: the operator must "
    "set MASKSERVE_USERS (name:password, comma-separated)."
)
LOGIN_MESSAGE = (
    "Sign in with your MaskServe user (the operator lists users in MASKSERVE_USERS; "
    "`maskserve up` prints the generated one)."
)


def mount_studio(
    app: FastAPI,
    service: JobService,
    templates: TemplateStore,
    guard: Guard,
    settings: Settings,
    metrics: ApiMetrics,
) -> gr.Blocks:
    path = settings.studio.path
    counted = metrics.jobs_submitted
    page = build_studio(
        StudioActions(
            service,
            templates,
            guard.studio_owner,
            lambda model: counted.labels(model, "studio").inc(),
            # the REST upload's own path (``create_app`` sets it before mounting the studio)
            adapter_uploads=app.state.adapter_service,
        )
    )
    page.queue(default_concurrency_limit=8)
    auth = guard.check_login if guard.login_required else None
    message = (LOGIN_MESSAGE if guard.has_logins else NO_USERS_MESSAGE) if auth else None
    gr.mount_gradio_app(
        app,
        page,
        path=path,
        auth=auth,
        auth_message=message,
        footer_links=["api"],
        run_history=False,
        show_error=True,
        ssr_mode=False,
        max_file_size=int(settings.api.max_template_mb * 2**20),
        css=CSS,
        js=EDITOR_JS,
    )

    if auth:
        app.add_middleware(LoginThrottle, limiter=guard.logins, login_path=f"{path}/login")

    @app.get("/", include_in_schema=False)
    def to_studio() -> RedirectResponse:
        return RedirectResponse(url=f"{path}/")

    # Gradio serves its icon under the studio's path only, and its page names none: without this
    # every studio load logs a 404 for the root's icon in the browser's console
    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> RedirectResponse:
        return RedirectResponse(url=f"{path}/favicon.ico")

    return page

"""The REST API as a FastAPI app: ``create_app(settings)``.

Routes: ``/v1/templates...``, ``/v1/adapters...`` and ``/v1/jobs...`` (API key + rate limit, see
``backend.api.security``), ``/healthz`` (the process is up), ``/readyz`` (Redis answers),
``/metrics`` (Prometheus), ``/docs``.

Errors are JSON ``{"error": "<what is wrong and how to fix it>"}`` (with ``field`` naming the
request field to fix, when there is one): 400 a body that cannot be parsed (malformed multipart),
401/403 auth, 404 unknown job, template or adapter, 409 result not ready / job finished, 410 result
expired (blob retention), 413 too large, 415 unsupported image or adapter file format, 422 a bad
field or one the route does not take (``backend.api.fields``), 429 rate limited or refused by
admission control (``Retry-After``), 503 Redis or the queue unavailable (or no CPU worker answered
an adapter upload; ``Retry-After`` too).
Bad input never gives a 500.
"""

from __future__ import annotations

import logging

import anyio
from fastapi import Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis import Redis
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.adapters.service import AdapterService
from backend.adapters.store import AdapterError, AdapterNotFound, AdapterStore
from backend.api import (
    routes_adapters,
    routes_batches,
    routes_jobs,
    routes_openai,
    routes_templates,
)
from backend.api.admission import DeadlineCollector
from backend.api.batches import BatchService
from backend.api.fields import refuse_unknown_fields
from backend.api.middleware import (
    ApiMetrics,
    BodyLimitMiddleware,
    MetricsMiddleware,
    SecurityHeadersMiddleware,
)
from backend.api.openai_errors import OpenAIErrorMiddleware
from backend.api.security import (
    API_KEY_HEADER,
    API_KEY_QUERY,
    Guard,
    accepts_query_key,
    api_key_header,
    bearer_key,
    presented_key,
)
from backend.api.service import JobService, ServiceError
from backend.blobs import BlobError, BlobStore, BlobStoreUnavailable
from backend.blobs.factory import open_objects
from backend.config import Settings
from backend.jobstate import JobStateStore
from backend.metrics import JobLatencyCollector
from backend.runtime import REDIS_UNAVAILABLE
from templates_store.store import TemplateError, TemplateNotFound, TemplateStore

log = logging.getLogger(__name__)

MB = 2**20
MAX_EVENT_STREAMS = 256  # threads that may wait on Redis for event streams at once
STATUS_BY_CODE = {
    "invalid": 422,
    "not_found": 404,
    "conflict": 409,
    "gone": 410,
    "unsupported_format": 415,
    "too_large": 413,
    "too_many": 429,
    "unavailable": 503,
}
# A 503's Retry-After: Redis restarting, the job queue or a CPU worker briefly away are back within
# seconds, and a client that retries at once only adds load
UNAVAILABLE_RETRY = {"Retry-After": "5"}


def _error(
    status: int, message: str, headers: dict | None = None, detail: dict | None = None
) -> JSONResponse:
    """An error answer; every 503 says when to try again (``Retry-After``), unless it says so
    itself."""
    if status == 503:
        headers = UNAVAILABLE_RETRY | (headers or {})
    return JSONResponse({"error": message, **(detail or {})}, status_code=status, headers=headers)


def _where(err: dict) -> str:
    """The field an error of FastAPI's validation is about ("" for the request as a whole)."""
    return ".".join(
        str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header", "form")
    )


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    found = [(_where(err), err.get("msg", "invalid")) for err in exc.errors()]
    parts = [f"{where or 'request'}: {message}" for where, message in found]
    field = next((where for where, _ in found if where), None)
    return _error(
        422,
        "; ".join(parts) + " (see /docs for the expected fields)",
        detail={"field": field} if field else None,
    )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400:  # a body Starlette could not parse (malformed multipart)
            detail = f"{detail.rstrip('.')}: resend the fields as multipart/form-data"
        return _error(exc.status_code, detail, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        return _validation_error(exc)

    @app.exception_handler(ServiceError)
    async def service_error(_request, exc: ServiceError):
        return _error(STATUS_BY_CODE.get(exc.code, 422), str(exc), exc.headers, exc.detail)

    async def coded_error(_request, exc: TemplateError | AdapterError):
        return _error(STATUS_BY_CODE.get(exc.code, 422), str(exc))

    async def not_found(_request, exc: LookupError):
        return _error(404, str(exc))

    for coded in (TemplateError, AdapterError):
        app.add_exception_handler(coded, coded_error)
    for missing in (TemplateNotFound, AdapterNotFound):
        app.add_exception_handler(missing, not_found)

    @app.exception_handler(BlobError)
    async def blob_error(_request, exc: BlobError):
        return _error(404, str(exc))

    async def redis_down(_request, exc: Exception):
        log.warning("Redis unavailable: %s", exc)
        return _error(503, f"Redis is unavailable ({exc}): try again shortly")

    for unavailable in REDIS_UNAVAILABLE:
        app.add_exception_handler(unavailable, redis_down)

    @app.exception_handler(BlobStoreUnavailable)
    async def blob_store_down(_request, exc: BlobStoreUnavailable):
        log.warning("blob store unavailable: %s", exc)
        return _error(503, f"the blob store is unavailable ({exc}): try again shortly")


def _ops_routes(app: FastAPI, client: Redis, metrics: ApiMetrics) -> None:
    @app.get("/healthz", tags=["ops"], summary="The process is up")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="Ready to take jobs (Redis answers)")
    def readyz() -> JSONResponse:
        try:
            client.ping()
        except Exception as exc:  # any failure means not ready; say which
            return JSONResponse(
                {"status": "unavailable", "error": f"Redis does not answer: {exc}"},
                status_code=503,
                headers=UNAVAILABLE_RETRY,
            )
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics", response_class=Response)
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _redis_client(settings: Settings) -> Redis:
    if not settings.redis.url:
        raise ValueError(
            "the API needs a Redis URL: set MASKSERVE_REDIS_URL (or start the stack with "
            "`maskserve up`)"
        )
    # event streams block on Redis for at most a second at a time (routes_jobs.BLOCK_SLICE_MS)
    return Redis.from_url(
        settings.redis.url, socket_connect_timeout=5, socket_timeout=10, health_check_interval=30
    )


def create_app(settings: Settings, redis_client: Redis | None = None, celery_app=None) -> FastAPI:
    """The API app. ``redis_client`` / ``celery_app`` default to ones built from ``settings``
    (nothing connects until the first request)."""
    if celery_app is None:
        from backend.tasks.celery_app import make_celery

        celery_app = make_celery(settings)
    client = redis_client if redis_client is not None else _redis_client(settings)
    blobs = BlobStore(open_objects(settings, "blobs"))
    templates = TemplateStore(
        open_objects(settings, "templates"),
        max_pixels=settings.celery.max_upload_pixels,
        max_bytes=int(settings.api.max_template_mb * MB),
    )
    metrics = ApiMetrics()
    metrics.registry.register(JobLatencyCollector(client))  # every job's, from Redis
    metrics.registry.register(DeadlineCollector(client))  # deadline attainment, from Redis
    app = FastAPI(
        title="MaskServe",
        version="1",
        summary="Mask-based image edits: template gallery and jobs",
        docs_url=None,  # served by _offline_docs
        redoc_url=None,
    )
    app.state.settings, app.state.redis, app.state.templates = settings, client, templates
    jobstate = JobStateStore(client, settings.retention.job_record_s)
    app.state.service = JobService(
        settings, client, celery_app, blobs, templates, jobstate, registry=metrics.registry
    )
    app.state.batches = BatchService(app.state.service)  # many edits of one template in one call
    app.state.metrics = metrics
    app.state.adapters = AdapterStore(open_objects(settings, "adapters"))
    app.state.adapter_service = AdapterService(
        settings, client, celery_app, blobs, app.state.adapters, app.state.service._model
    )
    app.state.sse_limiter = anyio.CapacityLimiter(MAX_EVENT_STREAMS)
    guard = Guard(settings.api, client, on_limited=metrics.rate_limited.inc)

    def require_api_key(
        request: Request,
        api_key: str | None = Security(api_key_header),
        bearer: HTTPAuthorizationCredentials | None = Security(bearer_key),
    ) -> None:
        # the caller owns the jobs and templates it creates; only it sees them
        request.state.caller = guard.check(
            request,
            presented_key(api_key, bearer),
            request.query_params.get(API_KEY_QUERY),
            accepts_query_key(request),
        )

    # routers carry their full /v1/... prefix themselves: the route template then is the metrics
    # label; the OpenAI-compatible route refuses unknown fields itself, in OpenAI's error shape
    for module in (routes_templates, routes_adapters, routes_jobs, routes_batches):
        app.include_router(
            module.router,
            dependencies=[Depends(require_api_key), Depends(refuse_unknown_fields)],
        )
    app.include_router(routes_openai.router, dependencies=[Depends(require_api_key)])
    _ops_routes(app, client, metrics)
    _offline_docs(app)
    _install_error_handlers(app)
    if settings.studio.enabled:
        from studio.mount import mount_studio

        mount_studio(app, app.state.service, templates, guard, settings, metrics)
    # the last added runs first: metrics see every response, the body limit's 413s included
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=int(settings.api.max_body_mb * MB),
        # the adapter limit is checked exactly while staging; this bound leaves room for the form
        path_limits={"/v1/adapters": int(settings.adapters.max_mb * MB) + MB},
    )
    app.add_middleware(OpenAIErrorMiddleware)  # outside the body limit: its 413 is reshaped too
    _add_cors(app, settings)
    app.add_middleware(SecurityHeadersMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


DOCS_ASSETS = "/docs/assets"


def _offline_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI from the installed ``swagger-ui-bundle-v2`` package, so the page works
    with no internet (FastAPI's default fetches Swagger UI and a favicon from CDNs). Like the
    OpenAPI document it shows, it needs no key."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles
    from swagger_ui_bundle import swagger_ui_path

    app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )


def _add_cors(app: FastAPI, settings: Settings) -> None:
    """Cross-origin calls only from ``api.cors_origins`` (none by default: then no CORS headers at
    all, so a browser page of another origin cannot read any response). No credentials: the key is
    a header the page sends itself, never a cookie the browser adds."""
    if settings.api.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.api.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=[API_KEY_HEADER, "Authorization", "Content-Type", "Last-Event-ID"],
            expose_headers=["Location", "Retry-After"],
            allow_credentials=False,
        )

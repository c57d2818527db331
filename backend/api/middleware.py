"""ASGI middleware of the API: the request body limit, security headers and request metrics.

Both are plain ASGI (not ``BaseHTTPMiddleware``), so a streamed response (the event stream) passes
through untouched and no body is buffered here.
"""

from __future__ import annotations

import json
import time

from prometheus_client import CollectorRegistry, Counter, Histogram


def _error_response(status: int, message: str, headers: list | None = None) -> tuple[dict, dict]:
    body = json.dumps({"error": message}).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *(headers or []),
        ],
    }
    return start, {"type": "http.response.body", "body": body}


def human_bytes(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.0f} KiB"


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes`` (or over ``path_limits[path]`` for the paths it
    names: uploads that may be larger, such as adapters): at once when ``Content-Length`` says so,
    else as soon as the streamed body passes the limit. Past the limit, reading the body raises, so
    no route ever acts on a partial body; whatever response the app makes of that is replaced."""

    def __init__(self, app, max_bytes: int, path_limits: dict[str, int] | None = None):
        self.app, self.max_bytes = app, int(max_bytes)
        self.path_limits = {path: int(limit) for path, limit in (path_limits or {}).items()}

    @staticmethod
    def _message(limit: int) -> str:
        return (
            f"request body is larger than this server's limit of {human_bytes(limit)}: "
            "send smaller files"
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, limit)
        state = {"received": 0, "over": False, "replaced": False}

        async def limited_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit:
                    state["over"] = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message):
            if not state["over"]:
                return await send(message)
            if message["type"] == "http.response.start" and not state["replaced"]:
                state["replaced"] = True
                await self._refuse(send, limit)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            if not state["replaced"]:
                state["replaced"] = True
                await self._refuse(send, limit)

    async def _refuse(self, send, limit: int):
        start, body = _error_response(413, self._message(limit), [(b"connection", b"close")])
        await send(start)
        await send(body)


# on every response: no MIME sniffing, never framed (clickjacking), no URL (ids) sent to other sites
SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"referrer-policy", b"no-referrer"),
)
NO_STORE = (b"cache-control", b"no-store")
JOB_DATA_PREFIX = "/v1/jobs"


class SecurityHeadersMiddleware:
    """Adds ``SECURITY_HEADERS`` to every response (the studio's and ``/docs`` too: neither is meant
    to be framed, and the CSP names only ``frame-ancestors``, so their scripts load as before).

    Job data (``/v1/jobs...``: records, results, events) is ``Cache-Control: no-store``, whatever
    the route said: no shared or browser cache keeps one tenant's results. Other ``/v1`` responses
    get ``no-store`` unless the route chose a policy (template images: ``private``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        job_data, api = path.startswith(JOB_DATA_PREFIX), path.startswith("/v1/")

        async def with_headers(message):
            if message["type"] == "http.response.start":
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if not (job_data and name.lower() == NO_STORE[0])
                ]
                has_cache = any(name.lower() == NO_STORE[0] for name, _ in headers)
                headers += SECURITY_HEADERS
                if (job_data or api) and not has_cache:
                    headers.append(NO_STORE)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class ApiMetrics:
    """Counters of one API app, in their own registry (``/metrics`` serves it)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "maskserve_api_requests",
            "HTTP requests by route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "maskserve_api_request_seconds",
            "Time to the response's first byte",
            ["route"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.jobs_submitted = Counter(
            "maskserve_api_jobs_submitted",
            "Jobs accepted, by model and by where they came from (rest, studio)",
            ["model", "source"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "maskserve_api_rate_limited",
            "Requests refused by the rate limit",
            registry=self.registry,
        )
        self.blobs_deleted = Counter(
            "maskserve_blobs_deleted",
            "Blobs the janitor deleted (retention passed), by kind",
            ["kind"],
            registry=self.registry,
        )
        self.blob_bytes_freed = Counter(
            "maskserve_blob_bytes_freed",
            "Bytes the janitor freed, by blob kind",
            ["kind"],
            registry=self.registry,
        )

    def record_sweep(self, report) -> None:
        """Count what one janitor sweep (``backend.janitor.SweepReport``) deleted."""
        for kind, count in report.deleted.items():
            self.blobs_deleted.labels(kind).inc(count)
            self.blob_bytes_freed.labels(kind).inc(report.bytes_freed[kind])


class MetricsMiddleware:
    """Counts every HTTP request by method, route template (never the raw path: ids would make a
    label per job) and status."""

    def __init__(self, app, metrics: ApiMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        seen = {"status": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                self.metrics.latency.labels(_route(scope)).observe(time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(scope["method"], _route(scope), str(seen["status"])).inc()


def _route(scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"

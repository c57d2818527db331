"""The one error shape of the REST API, documented on every route: ``{"error": "<what to fix>"}``.

``ERROR_RESPONSES`` is given to each router (``APIRouter(responses=...)``), so the OpenAPI schema
says which statuses a ``/v1`` route may answer and what their bodies hold; the API fuzz test
(tests/test_api_fuzz.py) checks every response against it.
"""

from __future__ import annotations

from pydantic import BaseModel


class ApiError(BaseModel):
    """Every 4xx/5xx body of the API."""

    error: str
    """What is wrong with the request and how to fix it."""


_STATUSES = {
    400: "The body could not be parsed (malformed multipart form data): resend it as "
    "multipart/form-data",
    401: "No API key given (or none configured on the server)",
    403: "The API key is not valid",
    404: "No such job, template or adapter",
    409: "The job is not in a state that allows this (result not ready, already finished)",
    410: "The result expired (blob retention)",
    413: "The body, the file or its pixel count is over the limit",
    415: "The file is not one of the supported image formats",
    422: "A field is missing or invalid: the message names it",
    429: "Rate limited: retry after the Retry-After header's seconds",
    503: "Redis or the job queue is unavailable: try again shortly",
}
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ApiError, "description": text} for status, text in _STATUSES.items()
}

"""The one error shape of the REST API, documented on every route: ``{"error": "<what to fix>"}``.

``ERROR_RESPONSES`` is given to each router (``APIRouter(responses=...)``), so the OpenAPI schema
says which statuses a ``/v1`` route may answer and what their bodies hold; the API fuzz test
(tests/test_api_fuzz.py) checks every response against it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ApiError(BaseModel):
    """Every 4xx/5xx body of the API."""

    error: str
    """What is wrong with the request and how to fix it."""
    field: str | None = None
    """The request field to fix, when the error is about one (``steps``, ``prompt``, ``image``,
    a misspelt field's name, ...)."""


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
    429: "Rate limited, too many of your jobs unfinished, or refused by admission control: retry "
    "after the Retry-After header's seconds (when it gives one)",
    503: "Redis or the job queue is unavailable: try again after the Retry-After header's seconds",
}
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ApiError, "description": text} for status, text in _STATUSES.items()
}


class AdmissionRefused(ApiError):
    """A job refused by admission control (429, with ``Retry-After``)."""

    reason: Literal["deadline", "queue"] | None = None
    """The bound that refused it: ``deadline`` (predicted to finish later than ``late_factor``
    times the time to its deadline) or ``queue`` (``max_queue`` jobs accepted and not running)."""
    service_class: str | None = None
    retry_after_s: int | None = None
    """When to try again (the ``Retry-After`` header): when the work ahead should have drained."""
    deadline_s: float | None = None
    """Seconds from submission to its deadline."""
    predicted_latency_s: float | None = None
    """Seconds from submission to its predicted finish (when a worker's forecast exists)."""
    late_factor: float | None = None
    queued: int | None = None
    """Jobs accepted and not running, over the deployment."""
    max_queue: int | None = None


ADMISSION_REFUSED: dict = {
    "model": AdmissionRefused,
    "description": "Refused: admission control predicts the job would finish too late for its "
    "deadline, or the queue is at its bound (for classes that shed; others are accepted and "
    "marked late); the error says why and what to do (retry after Retry-After seconds, give a "
    "longer deadline_s, or use another service_class). Also: the rate limit, or too many of "
    "your jobs unfinished",
    "headers": {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}}},
}

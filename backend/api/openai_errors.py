"""The OpenAI error shape, for the OpenAI-compatible routes (``/v1/images/...``) only.

OpenAI clients read ``{"error": {"message", "type", "param", "code"}}`` and pick their exception
class from the HTTP status (the ``openai`` package: 400 ``BadRequestError``, 401
``AuthenticationError``, 404 ``NotFoundError``, 429 ``RateLimitError``, 5xx
``InternalServerError``). The rest of the API keeps its own shape (``backend.api.errors``).

``OpenAIErrorMiddleware`` rewrites every error answered under ``OPENAI_PREFIX`` into that shape,
whoever made it (the API key guard, the body limit, the job service, a route not found), so the
route and the shared parts of the API stay unaware of each other. Statuses OpenAI clients would not
expect are mapped to OpenAI's: 403 (a key that is not valid) to 401, 413/415/422 (a bad upload or
field) to 400. Invariants: headers (``Retry-After``) are kept; an error already in the OpenAI shape
passes unchanged; the field our error names (``field``) is OpenAI's ``param``; the other extra
fields of our errors (admission control's numbers) are kept inside ``error``; an exception escaping
the route becomes a 500 in the same shape.
"""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel, ConfigDict

log = logging.getLogger(__name__)

OPENAI_PREFIX = "/v1/images/"
STATUS_MAP = {403: 401, 413: 400, 415: 400, 422: 400}
# OpenAI's own codes where it has one for the case (an invalid key, a rate limit)
CODE_BY_STATUS = {401: "invalid_api_key", 429: "rate_limit_exceeded", 503: "service_unavailable"}
# tells the openai package not to retry (it retries 408, 409, 429 and 5xx by default): a retry
# after jobs were submitted would submit them again
NO_RETRY = {"x-should-retry": "false"}


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class OpenAIError(Exception):
    """An error this route answers itself, in the OpenAI shape: ``param`` names the field to fix;
    ``extra`` adds fields to the ``error`` object (the job ids of edits that did not finish)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.headers, self.extra = dict(headers or {}), dict(extra or {})

    def body(self) -> dict:
        return error_body(self.status, str(self), self.param, self.code, self.extra)


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    extra: dict | None = None,
) -> dict:
    error = {"message": message, "type": error_type(status), "param": param, "code": code}
    return {"error": {**error, **(extra or {})}}


def reshape(status: int, raw: bytes) -> tuple[int, dict | None]:
    """(status, body) for one of our error bodies; body None: already in the OpenAI shape."""
    try:
        payload = json.loads(raw) if raw else {}
    except ValueError:
        payload = {"error": raw.decode("utf-8", "replace").strip() or "error"}
    if not isinstance(payload, dict):
        payload = {"error": str(payload)}
    error = payload.get("error", payload.get("detail", ""))
    if isinstance(error, dict) and "message" in error:
        return status, None
    status = STATUS_MAP.get(status, status)
    extra = {key: value for key, value in payload.items() if key not in ("error", "detail")}
    param = extra.pop("field", None)  # the field our error is about is OpenAI's param
    return status, error_body(status, str(error), param, CODE_BY_STATUS.get(status), extra)


class OpenAIErrorMiddleware:
    """Plain ASGI: an error response (status >= 400) under ``OPENAI_PREFIX`` is buffered (error
    bodies are small) and rewritten by ``reshape``; success responses pass through untouched."""

    def __init__(self, app, prefix: str = OPENAI_PREFIX):
        self.app, self.prefix = app, prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith(self.prefix):
            return await self.app(scope, receive, send)
        held: dict = {"start": None, "body": b"", "sent": False}

        async def reshaping_send(message):
            if message["type"] == "http.response.start":
                held["sent"] = True
                if message["status"] < 400:
                    return await send(message)
                held["start"] = message
                return None
            if held["start"] is None:
                return await send(message)
            held["body"] += message.get("body", b"")
            if not message.get("more_body", False):
                await _send_reshaped(send, held["start"], held["body"])
            return None

        try:
            await self.app(scope, receive, reshaping_send)
        except Exception:
            # never let a bug answer in another shape: log it whole, answer a 500 in OpenAI's
            log.exception("unhandled error on %s", scope.get("path"))
            if held["sent"]:
                raise
            body = error_body(500, "internal error: the server logged it; try again", None, None)
            await _send_json(send, 500, body, [])


async def _send_reshaped(send, start: dict, raw: bytes) -> None:
    status, body = reshape(start["status"], raw)
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    if body is None:
        headers.append((b"content-length", str(len(raw)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": raw})
        return
    kept = [(k, v) for k, v in headers if k.lower() != b"content-type"]
    await _send_json(send, status, body, kept)


async def _send_json(send, status: int, body: dict, headers: list) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                *headers,
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class OpenAIErrorDetail(BaseModel):
    """The ``error`` object of an OpenAI error."""

    model_config = ConfigDict(extra="allow")  # our extras: job_ids, admission control's numbers

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """Every 4xx/5xx body of the OpenAI-compatible routes."""

    error: OpenAIErrorDetail


_STATUSES = {
    400: "A field is missing or invalid (param names it), the upload is not a usable image, the "
    "mask has no fully transparent pixel, or the body is too large",
    401: "No API key, or one that is not valid (Authorization: Bearer <key> or X-API-Key)",
    404: "No such gallery template (extra_body template_id) or route",
    429: "Rate limited, too many of your jobs unfinished, or refused by admission control: retry "
    "after the Retry-After header's seconds",
    500: "An edit failed (error.job_ids names its jobs)",
    503: "Redis or the job queue is unavailable: try again after the Retry-After header's seconds",
    504: "The edits did not finish within api.openai_wait_s: they go on running; error.job_ids "
    "names them (GET /v1/jobs/{job_id}/result)",
}
OPENAI_ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": OpenAIErrorBody, "description": text} for status, text in _STATUSES.items()
}

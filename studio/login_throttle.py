"""Throttles failed studio sign-ins: a token bucket per (user name, client address) in Redis.

Gradio's login route calls ``Guard.check_login(username, password)`` without the request, so the
throttle is ASGI middleware in front of that one route (``POST <studio path>/login``): before the
login is checked it looks whether the bucket of this user name from this address still holds a
token (without spending one); when it is empty the answer is 429 with ``Retry-After`` and the check
never runs, so guessing is as slow for a right password as for a wrong one. A failed login (Gradio
answers 400) spends a token; a successful one spends nothing. Buckets are shared by every API
process (``security.RateLimiter``: the same Lua script as the API's rate limits; keys are hashes).
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

import anyio

from backend.api.security import RateLimiter

FAILED_LOGIN_STATUS = 400  # what Gradio answers to wrong credentials


class LoginThrottle:
    def __init__(self, app, limiter: RateLimiter, login_path: str):
        self.app, self.limiter, self.login_path = app, limiter, login_path.rstrip("/")

    async def __call__(self, scope, receive, send):
        if not self._is_login(scope):
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        username = parse_qs(body.decode("utf-8", "replace")).get("username", [""])[0].strip()
        client = scope.get("client") or ("-", 0)
        identity = f"login:{client[0]}\0{username}"
        decision = await anyio.to_thread.run_sync(self.limiter.take, identity, 0)
        if not decision.allowed:
            return await _refuse(send, decision.retry_after_s)
        seen = {"status": 0}

        async def replay():
            # the body was read here: hand it to the login route once, then whatever comes next
            if not seen.get("replayed"):
                seen["replayed"] = 1
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def watching_send(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            await send(message)

        await self.app(scope, replay, watching_send)
        if seen["status"] == FAILED_LOGIN_STATUS:
            await anyio.to_thread.run_sync(self.limiter.take, identity, 1)

    def _is_login(self, scope) -> bool:
        return (
            self.limiter.enabled
            and scope["type"] == "http"
            and scope.get("method") == "POST"
            and scope.get("path", "").rstrip("/") == self.login_path
        )


async def _read_body(receive) -> bytes:
    """The whole request body (``BodyLimitMiddleware`` outside bounds it)."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _refuse(send, retry_after_s: int) -> None:
    message = (
        f"too many failed sign-ins for this user from your address: try again in {retry_after_s} s"
    )
    # Gradio's login page shows ``detail``; API clients read ``error``
    body = json.dumps({"error": message, "detail": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(retry_after_s).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})

"""API keys and per-key rate limits for everything under ``/v1``.

Auth: header ``X-API-Key``; 401 when it is missing, 403 when it is not one of
``settings.api.api_keys`` (compared in constant time). With no keys configured every request is
refused with 401 unless ``settings.api.auth_disabled`` is set explicitly: a deployment that forgot
its keys fails closed, not open.

Routes that declare ``Security(api_key_query)`` (only the job event stream: a browser's
``EventSource`` cannot send headers) also take the key as the query parameter ``api_key``; the
header wins when both are given. Anywhere else a query key is refused with 401, so keys do not
spread into URLs (and from there into proxy logs and browser history) beyond the one route that
needs it. It is the same ``Guard``, the same key list and the same rate limit either way.

Studio logins: ``settings.api.users`` (``name:password``) checked by ``Guard.check_login`` (the
Gradio login page calls it), compared in constant time over every entry. With auth disabled the
studio has no login; with no users configured every login is refused (fail closed, as for keys).

Rate limit: a token bucket per key kept in Redis (one Lua script, so every API process on every
host draws from the same bucket): ``rate_limit_burst`` tokens, refilled at
``rate_limit_per_minute / 60`` tokens a second; an empty bucket answers 429 with ``Retry-After``
(whole seconds until a token is back). Buckets are keyed by a hash of the key, never the key itself;
with auth disabled the bucket is per client address.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass

from fastapi import HTTPException, Request
from fastapi.security import APIKeyHeader, APIKeyQuery

from backend.config import ApiSettings
from backend.protocol.keys import rate_limit_key

API_KEY_HEADER = "X-API-Key"
API_KEY_QUERY = "api_key"
api_key_header = APIKeyHeader(
    name=API_KEY_HEADER, auto_error=False, description="One of the keys in MASKSERVE_API_KEYS"
)
# Declared by the routes that accept the key in the URL (``accepts_query_key``): the event stream.
api_key_query = APIKeyQuery(
    name=API_KEY_QUERY,
    auto_error=False,
    description="The API key for a browser's EventSource, which cannot send "
    f"{API_KEY_HEADER} (the job event stream only; the header wins)",
)
_BOTH_WAYS = (
    f"send it in the {API_KEY_HEADER} header (or, on GET /v1/jobs/{{job_id}}/events only, as the "
    f"{API_KEY_QUERY} query parameter)"
)

# KEYS[1] bucket hash. ARGV: capacity, refill per second, now (s), ttl (s).
# Returns {allowed (0/1), milliseconds until one token is back}.
_TAKE = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or capacity
local at = tonumber(state[2]) or now
if now > at then tokens = math.min(capacity, tokens + (now - at) * rate) end
local allowed = 0
local wait_ms = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait_ms = math.ceil((1 - tokens) / rate * 1000)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(math.max(now, at)))
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {allowed, wait_ms}
"""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: int


class RateLimiter:
    """Token buckets in Redis; ``take(identity)`` spends one token of that identity's bucket."""

    def __init__(self, redis_client, per_minute: int, burst: int):
        self.per_minute, self.burst = per_minute, burst
        self._take = redis_client.register_script(_TAKE)

    @property
    def enabled(self) -> bool:
        return self.per_minute > 0

    def take(self, identity: str) -> Decision:
        if not self.enabled:
            return Decision(True, 0)
        rate = self.per_minute / 60.0
        ttl = max(60, math.ceil(self.burst / rate) + 60)  # an idle bucket is full again: forget it
        key = rate_limit_key(identity)
        allowed, wait_ms = self._take(keys=[key], args=[self.burst, rate, time.time(), ttl])
        return Decision(bool(allowed), max(1, math.ceil(int(wait_ms) / 1000)) if not allowed else 0)


def _login_digest(username: str, password: str) -> bytes:
    """Fixed-length digest of a login, so comparisons take the same time whatever the lengths."""
    return hashlib.sha256(username.strip().encode() + b"\0" + password.encode()).digest()


def accepts_query_key(request: Request) -> bool:
    """Whether the matched route declared ``Security(api_key_query)`` (FastAPI puts the route in
    the scope before it runs the route's dependencies)."""
    route = request.scope.get("route")
    return any(
        getattr(dep, "dependency", None) is api_key_query
        for dep in getattr(route, "dependencies", ())
    )


class Guard:
    """The dependency every ``/v1`` route runs: authenticate, then rate-limit."""

    def __init__(self, settings: ApiSettings, limiter: RateLimiter, on_limited=lambda: None):
        self.settings, self.limiter, self.on_limited = settings, limiter, on_limited
        self._keys = [key.encode() for key in settings.api_keys]
        self._logins = [_login_digest(*entry.split(":", 1)) for entry in settings.users]

    @property
    def has_logins(self) -> bool:
        return bool(self._logins)

    @property
    def login_required(self) -> bool:
        return not self.settings.auth_disabled

    def check_login(self, username: str, password: str) -> bool:
        """True when ``username``/``password`` is one of ``settings.users``."""
        if self.settings.auth_disabled:
            return True
        given = _login_digest(str(username or ""), str(password or ""))
        # compare against every entry so the time taken does not say which user exists
        return any([hmac.compare_digest(given, login) for login in self._logins])

    def identity(
        self,
        request: Request,
        api_key: str | None,
        query_key: str | None = None,
        query_allowed: bool = False,
    ) -> str:
        """Who is calling (the key itself, or ``addr:<host>`` with auth disabled); raises 401/403.

        ``api_key`` comes from the header, ``query_key`` from the ``api_key`` query parameter, which
        counts only where ``query_allowed`` and only when the header is absent."""
        if self.settings.auth_disabled:
            return f"addr:{request.client.host if request.client else 'unknown'}"
        if not self._keys:
            raise HTTPException(
                401,
                "no API keys are configured on this server: the operator must set "
                "MASKSERVE_API_KEYS (or MASKSERVE_AUTH_DISABLED=1 for local use)",
            )
        source = f"the {API_KEY_HEADER} header"
        if not api_key and query_key:
            if not query_allowed:
                raise HTTPException(
                    401,
                    f"the {API_KEY_QUERY} query parameter is not accepted on this route: "
                    f"{_BOTH_WAYS}",
                    headers={"WWW-Authenticate": API_KEY_HEADER},
                )
            api_key, source = query_key, f"the {API_KEY_QUERY} query parameter"
        if not api_key:
            raise HTTPException(
                401, f"missing API key: {_BOTH_WAYS}", headers={"WWW-Authenticate": API_KEY_HEADER}
            )
        given = api_key.encode()
        # compare against every key so the time taken does not say which key came close
        if not any([hmac.compare_digest(given, key) for key in self._keys]):
            raise HTTPException(
                403,
                f"the API key in {source} is not valid: check it for typos, or ask for a "
                f"new one ({_BOTH_WAYS})",
            )
        return f"key:{api_key}"

    def check(
        self,
        request: Request,
        api_key: str | None,
        query_key: str | None = None,
        query_allowed: bool = False,
    ) -> str:
        """Authenticate and rate-limit; returns the caller's identity (see ``identity``)."""
        caller = self.identity(request, api_key, query_key, query_allowed)
        decision = self.limiter.take(caller)
        if not decision.allowed:
            self.on_limited()
            raise HTTPException(
                429,
                f"rate limit of {self.limiter.per_minute} requests a minute (bursts of "
                f"{self.limiter.burst}) exceeded: retry in {decision.retry_after_s} s",
                headers={"Retry-After": str(decision.retry_after_s)},
            )
        return caller

"""API keys, tenants and per-key rate limits for everything under ``/v1``.

Auth: header ``X-API-Key``, or ``Authorization: Bearer <key>`` (what OpenAI clients send; the
``X-API-Key`` header wins when both are given); 401 when it is missing, 403 when it is not one of
``settings.api.api_keys``. The server keeps only the SHA-256 digest of each configured key (an entry
may be given as ``sha256:<hex>`` so the raw key never needs to be in the environment); a presented
key is hashed and its digest compared in constant time against every configured digest. With no
keys configured every request is refused with 401 unless ``settings.api.auth_disabled`` is set
explicitly: a deployment that forgot its keys fails closed, not open.

Tenants: a caller is a ``Caller``: ``owner`` (who owns the jobs and templates it creates, and the
only one who can see them) and ``bucket`` (whose rate limit it spends). An API key's owner is
``key:<first 32 hex of its digest>``: the raw key never reaches Redis, a job record, a log line or a
file. The studio's users share one tenant, ``STUDIO_OWNER`` (their gallery is one team's); each
user's history is their own (``studio_user``). With auth disabled there is one tenant,
``LOCAL_OWNER`` (REST and studio alike), and buckets are per client address.

Routes that declare ``Security(api_key_query)`` (only the job event stream: a browser's
``EventSource`` cannot send headers) also take the key as the query parameter ``api_key``; the
header wins when both are given. Anywhere else a query key is refused with 401, so keys do not
spread into URLs (and from there into proxy logs and browser history) beyond the one route that
needs it.

Studio logins: ``settings.api.users`` (``name:password``) checked by ``Guard.check_login`` (the
Gradio login page calls it), compared in constant time over every entry. With auth disabled the
studio has no login; with no users configured every login is refused (fail closed, as for keys).
Failed logins are throttled per user name and client address (``LoginThrottle``).

Rate limit: token buckets in Redis (one Lua script, so every API process on every host draws from
the same bucket), two per caller: reads (GET, HEAD, event streams) and writes (POST, DELETE, ...),
each ``burst`` tokens refilled at ``per_minute / 60`` a second; an empty bucket answers 429 with
``Retry-After`` (whole seconds until a token is back). Bucket keys are hashes of the identity.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass

from fastapi import HTTPException, Request
from fastapi.security import APIKeyHeader, APIKeyQuery, HTTPAuthorizationCredentials, HTTPBearer

from backend.config import API_KEY_DIGEST_PREFIX, ApiSettings
from backend.protocol.keys import rate_limit_key

API_KEY_HEADER = "X-API-Key"
API_KEY_QUERY = "api_key"
api_key_header = APIKeyHeader(
    name=API_KEY_HEADER, auto_error=False, description="One of the keys in MASKSERVE_API_KEYS"
)
# the same keys as ``Authorization: Bearer <key>``: what the openai package (and most HTTP clients
# of OpenAI-style APIs) sends
bearer_key = HTTPBearer(
    auto_error=False,
    description=f"The same keys as {API_KEY_HEADER}, as Authorization: Bearer <key>",
)
# Declared by the routes that accept the key in the URL (``accepts_query_key``): the event stream.
api_key_query = APIKeyQuery(
    name=API_KEY_QUERY,
    auto_error=False,
    description="The API key for a browser's EventSource, which cannot send "
    f"{API_KEY_HEADER} (the job event stream only; the header wins)",
)
_BOTH_WAYS = (
    f"send it in the {API_KEY_HEADER} header or as Authorization: Bearer <key> (or, on GET "
    f"/v1/jobs/{{job_id}}/events only, as the {API_KEY_QUERY} query parameter)"
)

# KEYS[1] bucket hash. ARGV: capacity, refill per second, now (s), ttl (s), cost (0: only look).
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
  tokens = tokens - tonumber(ARGV[5])
  allowed = 1
else
  wait_ms = math.ceil((1 - tokens) / rate * 1000)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(math.max(now, at)))
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {allowed, wait_ms}
"""


LOCAL_OWNER = "local"  # the one tenant when auth is disabled
STUDIO_OWNER = "studio"  # the tenant of every studio user: they share one gallery
READ_METHODS = frozenset({"GET", "HEAD"})


def key_digest(key: str) -> bytes:
    """The SHA-256 of an API key: all the server keeps of it."""
    return hashlib.sha256(key.encode()).digest()


def configured_digest(entry: str) -> bytes:
    """The digest an ``api_keys`` entry stands for: ``sha256:<hex>`` as given, a raw key hashed."""
    if entry.startswith(API_KEY_DIGEST_PREFIX):
        return bytes.fromhex(entry.removeprefix(API_KEY_DIGEST_PREFIX))
    return key_digest(entry)


def key_owner(digest: bytes) -> str:
    """The tenant of an API key, named by its digest (never the key)."""
    return f"key:{digest.hex()[:32]}"


def studio_user(name: str) -> str:
    """A studio user's history identity, named by a digest of the user name."""
    return f"user:{hashlib.sha256(name.encode()).hexdigest()[:32]}"


@dataclass(frozen=True)
class Caller:
    """Who is calling: ``owner`` owns what it creates and alone sees it; ``bucket`` is whose rate
    limit it spends (the owner, or the client address with auth disabled)."""

    owner: str
    bucket: str


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

    def take(self, identity: str, cost: int = 1) -> Decision:
        """Spend ``cost`` tokens (0: only look whether one is there)."""
        if not self.enabled:
            return Decision(True, 0)
        rate = self.per_minute / 60.0
        ttl = max(60, math.ceil(self.burst / rate) + 60)  # an idle bucket is full again: forget it
        key = rate_limit_key(identity)
        allowed, wait_ms = self._take(keys=[key], args=[self.burst, rate, time.time(), ttl, cost])
        return Decision(bool(allowed), max(1, math.ceil(int(wait_ms) / 1000)) if not allowed else 0)

    def refusal(self, what: str, decision: Decision) -> HTTPException:
        """The 429 for an empty bucket of ``what``."""
        return HTTPException(
            429,
            f"rate limit of {self.per_minute} {what} a minute (bursts of {self.burst}) exceeded: "
            f"retry in {decision.retry_after_s} s",
            headers={"Retry-After": str(decision.retry_after_s)},
        )


def _login_digest(username: str, password: str) -> bytes:
    """Fixed-length digest of a login, so comparisons take the same time whatever the lengths."""
    return hashlib.sha256(username.strip().encode() + b"\0" + password.encode()).digest()


def presented_key(
    header_key: str | None, bearer: HTTPAuthorizationCredentials | None
) -> str | None:
    """The key a request presents in a header: ``X-API-Key``, else ``Authorization: Bearer``."""
    return header_key or (bearer.credentials if bearer is not None else None)


def accepts_query_key(request: Request) -> bool:
    """Whether the matched route declared ``Security(api_key_query)`` (FastAPI puts the route in
    the scope before it runs the route's dependencies)."""
    route = request.scope.get("route")
    return any(
        getattr(dep, "dependency", None) is api_key_query
        for dep in getattr(route, "dependencies", ())
    )


class Guard:
    """The dependency every ``/v1`` route runs: authenticate, then rate-limit (reads and writes in
    buckets apart)."""

    def __init__(self, settings: ApiSettings, redis_client, on_limited=lambda: None):
        self.settings, self.on_limited = settings, on_limited
        self.reads = RateLimiter(redis_client, settings.read_rate_per_minute, settings.read_burst)
        self.writes = RateLimiter(
            redis_client, settings.write_rate_per_minute, settings.write_burst
        )
        # failed studio sign-ins (``studio.login_throttle``)
        self.logins = RateLimiter(
            redis_client, settings.login_failures_per_minute, settings.login_failures_burst
        )
        self._digests = [configured_digest(entry) for entry in settings.api_keys]
        self._logins = [_login_digest(*entry.split(":", 1)) for entry in settings.users]

    @property
    def has_logins(self) -> bool:
        return bool(self._logins)

    @property
    def login_required(self) -> bool:
        return not self.settings.auth_disabled

    @property
    def studio_owner(self) -> str:
        """The tenant the studio acts as (the local one when auth is disabled)."""
        return LOCAL_OWNER if self.settings.auth_disabled else STUDIO_OWNER

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
    ) -> Caller:
        """Who is calling; raises 401/403.

        ``api_key`` comes from the header, ``query_key`` from the ``api_key`` query parameter, which
        counts only where ``query_allowed`` and only when the header is absent."""
        if self.settings.auth_disabled:
            return Caller(LOCAL_OWNER, f"addr:{request.client.host if request.client else '-'}")
        if not self._digests:
            raise HTTPException(
                401,
                "no API keys are configured on this server: the operator must set "
                "MASKSERVE_API_KEYS (or MASKSERVE_AUTH_DISABLED=1 for local use)",
            )
        # presented_key: X-API-Key wins, else Authorization: Bearer
        source = f"the {API_KEY_HEADER} header"
        if not request.headers.get(API_KEY_HEADER):
            source = "the Authorization header"
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
        given = key_digest(api_key)
        # compare against every digest so the time taken does not say which one came close
        if not any([hmac.compare_digest(given, digest) for digest in self._digests]):
            raise HTTPException(
                403,
                f"the API key in {source} is not valid: check it for typos, or ask for a "
                f"new one ({_BOTH_WAYS})",
            )
        owner = key_owner(given)
        return Caller(owner, owner)

    def check(
        self,
        request: Request,
        api_key: str | None,
        query_key: str | None = None,
        query_allowed: bool = False,
    ) -> Caller:
        """Authenticate and spend a token of the caller's read or write bucket."""
        caller = self.identity(request, api_key, query_key, query_allowed)
        is_read = request.method in READ_METHODS
        limiter, what = (self.reads, "reads") if is_read else (self.writes, "writes")
        decision = limiter.take(f"{what}:{caller.bucket}")
        if not decision.allowed:
            self.on_limited()
            raise limiter.refusal(what, decision)
        return caller

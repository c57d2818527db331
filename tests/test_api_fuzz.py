"""The whole REST API fuzzed from its own OpenAPI schema (schemathesis) over real HTTP.

The real app (``create_app``) is served by uvicorn on a free port, on a real Redis, with API keys,
the real submit path (the job state in Redis, blobs on disk, the Celery pre-processing queue in
Redis) and the tiny model's settings; no engine worker runs (the API surface does not need one).
Every operation gets schema-valid (positive) and schema-violating (negative) requests, with the
right key, a wrong key or none. Checked on every response:

* never a 5xx;
* the status is one the schema documents, and the body matches the schema of that status (errors:
  ``{"error": str}``);
* a refused request (4xx) stores nothing: the blob directory, the template gallery and the set of
  Redis keys (less rate-limit buckets, which count refused requests by design) are unchanged.

The number of requests sent is printed (``-s``) per operation and in total.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import schemathesis
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from backend.api.app import create_app
from backend.config import load_settings
from backend.protocol import keys
from tests.property_settings import examples
from tests.served_app import serve

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
EXAMPLES_PER_MODE = 40  # per operation and generation mode
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# who calls: the right key, a wrong one, none
CALLERS = st.sampled_from([{"X-API-Key": KEY}, {"X-API-Key": "not-a-key"}, {}])
RATE_LIMIT_PREFIX = keys.rate_limit_key("x").rsplit(":", 1)[0] + ":"


@pytest.fixture
def served(redis_url, redis_client, models_dir, tmp_path):
    """(base URL, settings) of the app served by uvicorn in a thread."""
    settings = load_settings(
        {
            "MASKSERVE_REDIS_URL": redis_url,
            "MASKSERVE_DATA_DIR": str(tmp_path / "data"),
            "MASKSERVE_MODELS_DIR": str(models_dir),
            "MASKSERVE_MODEL": "tiny-sd2-inpaint",
            "MASKSERVE_API_KEYS": KEY,
            "MASKSERVE_STUDIO": "0",
            # no CPU worker runs here: an adapter upload is answered 503 (nothing stored) in 1 s
            "MASKSERVE_ADAPTER_INGEST_TIMEOUT_S": "1",
        },
        # a fuzzer sends thousands of requests a minute: a real limit would answer 429 to most
        api={
            "read_rate_per_minute": 10**9,
            "read_burst": 10**9,
            "write_rate_per_minute": 10**9,
            "write_burst": 10**9,
            "max_queued_jobs": 0,
            "sse_keepalive_s": 0.2,
        },
    )
    with serve(create_app(settings)) as base:
        yield base, settings


def stored(settings, redis_client) -> tuple[frozenset, ...]:
    """What a request could have stored: blob files, gallery and adapter registry files, Redis
    keys (less buckets)."""
    data_dir = Path(settings.paths.data_dir)

    def files(root: Path) -> frozenset:
        return frozenset(
            (str(p.relative_to(root)), p.stat().st_size)
            for p in root.rglob("*")
            if p.is_file() and p.name != ".lock"
        )

    redis_keys = frozenset(
        k
        for k in (key.decode() for key in redis_client.keys("*"))
        if not k.startswith(RATE_LIMIT_PREFIX)
    )
    registry = files(settings.paths.resolved_adapters_dir())
    return files(data_dir / "blobs"), files(data_dir / "templates"), registry, redis_keys


def test_every_operation_fuzzed_answers_per_schema_without_5xx_and_refusals_store_nothing(
    served, redis_client
):
    base_url, settings = served
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    sent: Counter = Counter()
    statuses: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @examples(EXAMPLES_PER_MODE)
            @given(case=operation.as_strategy(generation_mode=mode), caller=CALLERS)
            def fuzz(case, caller):
                case.headers = {
                    k: v for k, v in (case.headers or {}).items() if k.lower() != "x-api-key"
                } | caller
                before = stored(settings, redis_client)
                response = case.call(base_url=base_url, timeout=30)
                sent[case.operation.label] += 1
                statuses[response.status_code] += 1
                case.validate_response(response, checks=CHECKS)
                if 400 <= response.status_code < 500:
                    assert stored(settings, redis_client) == before, (
                        f"{case.operation.label} answered {response.status_code}, stored something"
                    )

            try:
                fuzz()
            except Unsatisfiable:  # an operation without inputs has no negative case
                assert mode is GenerationMode.NEGATIVE, operation.label
    total = sum(sent.values())
    print(f"\nAPI fuzz: {total} requests over {len(sent)} operations")
    for label, count in sorted(sent.items()):
        print(f"  {count:5d}  {label}")
    print(f"  statuses: {dict(sorted(statuses.items()))}")
    assert len(sent) >= 12 and statuses[200] > 0

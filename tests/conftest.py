"""Fixtures shared by the whole suite.

The suite talks to a real Redis. By default it starts its own throwaway ``redis-server`` for the
session (see ``tests/_redis_server.py``); set ``QUEUESERVE_TEST_REDIS_URL`` to use a server of
yours instead. Either way nothing is ever FLUSHALLed: each test works under its own key
``prefix``, and ``redis_client`` deletes that prefix's keys afterwards. When no server can be
had, the session fails; it never skips.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest
import redis

from ._redis_server import RedisServer, prefixed_client, start_redis_server

REDIS_URL_ENV = "QUEUESERVE_TEST_REDIS_URL"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of the Redis for this session: ``$QUEUESERVE_TEST_REDIS_URL``, or a private one."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        client = redis.Redis.from_url(url, socket_timeout=5.0)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise RuntimeError(f"{REDIS_URL_ENV}={url!r} does not answer PING: {exc!r}") from exc
        finally:
            client.close()
        yield url
        return
    server = start_redis_server(tmp_path_factory.mktemp("redis-session"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """Same as ``redis_server``; the name to ask for in tests."""
    return redis_server


@pytest.fixture
def prefix() -> str:
    """A key prefix unique to this test, e.g. ``qst1a2b3c4d5e``."""
    return f"qst{uuid4().hex[:10]}"


@pytest.fixture
def redis_client(redis_url: str, prefix: str) -> Iterator[redis.Redis]:
    """A client on the session's Redis; every key containing ``prefix`` is deleted after the
    test, pass or fail."""
    with prefixed_client(redis_url, prefix) as client:
        yield client


@pytest.fixture
def redis_tmp_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private server for one test (AOF off); for restarts with AOF call start_redis_server."""
    server = start_redis_server(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()

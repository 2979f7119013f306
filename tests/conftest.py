"""Fixtures shared by the whole suite.

The suite is laid out along what a test needs:

- ``tests/unit/``: no Redis server; pure logic, or fakeredis where it models Redis faithfully
  (``tests/unit/conftest.py`` refuses the real-Redis fixtures there).
- ``tests/integration/``: a real Redis; protocol, batching, clients, worker, streaming, CLI.
- ``tests/faults/``: crashes, signals, Redis restarts, the guarantees under failure.
- ``tests/support/``: what the tests share; worker processes import its ``*_app`` modules.

The real Redis is by default a throwaway ``redis-server`` started for the session (see
``tests/support/redis_server.py``); set ``QUEUESERVE_TEST_REDIS_URL`` to use a server of yours
instead. Either way nothing is ever FLUSHALLed: each test works under its own key ``prefix``,
and ``redis_client`` deletes that prefix's keys afterwards. When no server can be had, the
session fails; it never skips.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import redis

import queueserve as qs
from tests.support.fault_app import Workers
from tests.support.helpers import pending_requests, stream_key
from tests.support.redis_server import (
    REDIS_URL_ENV,
    RedisServer,
    prefixed_client,
    start_redis_server,
)

# The suite's clients, and the processes it starts, are often made before the worker that
# declares their serving: they wait for it, as a deployment's clients started first would
# (QUEUESERVE_WAIT_FOR_WORKER). Tests of the default, which fails at once with
# UnknownServing, pass wait_for_worker=False (tests/integration/test_unknown_serving.py).
os.environ.setdefault("QUEUESERVE_WAIT_FOR_WORKER", "1")


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


# --- workers and clients (integration and fault tests) -------------------------------------
@pytest.fixture
def pending(redis_client: redis.Redis, prefix: str) -> Callable[..., int]:
    """``pending(serving, batch_key="default")``: requests workers have read and not acked
    yet (a pack, one entry, counts each of its requests)."""

    def count(serving: str, batch_key: str = "default") -> int:
        return pending_requests(redis_client, stream_key(prefix, serving, batch_key))

    return count


@pytest.fixture
def start_worker(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> Iterator[Callable[..., qs.Worker]]:
    """``start_worker(*servings, **worker_options)``: a worker in background threads of this
    process, under the test's prefix. Every one is stopped after the test, pass or fail, after
    opening the gates of the servings it runs (see ``tests.support.servings.Recording``)."""
    started: list[tuple[qs.Worker, tuple[qs.Serving, ...]]] = []

    def start(*servings: qs.Serving, **options: Any) -> qs.Worker:
        options.setdefault("handle_signals", False)
        options.setdefault("shutdown_timeout", 10.0)
        worker = qs.Worker(list(servings), redis_url=redis_url, prefix=prefix, **options)
        started.append((worker, servings))
        return worker.start()

    yield start
    for worker, servings in reversed(started):
        for serving in servings:
            gate = getattr(serving, "gate", None)
            if gate is not None:
                gate.set()
        worker.stop(timeout=10.0)


@pytest.fixture
def client(redis_client: redis.Redis, redis_url: str, prefix: str) -> Iterator[qs.Client]:
    """A sync client under the test's prefix, closed after the test."""
    c = qs.Client(redis_url, prefix=prefix)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def workers(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[Workers]:
    """Real `queueserve worker` processes (tests/support/fault_app.py), all stopped after the
    test."""
    w = Workers(redis_url, prefix, tmp_path)
    try:
        yield w
    finally:
        w.close()

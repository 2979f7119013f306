"""Unit tests run without a Redis server: pure logic, or fakeredis (``fake_redis``) where it
models Redis faithfully. A unit test that asks for the real server fails here, saying where it
belongs, instead of quietly starting one."""

from __future__ import annotations

from collections.abc import Iterator

import fakeredis
import pytest

import queueserve.broker.core


@pytest.fixture
def redis_server() -> str:
    pytest.fail(
        "tests/unit/ runs without a Redis server, but this test asked for one (redis_server, "
        "redis_url, redis_client, client, start_worker or workers): move it to "
        "tests/integration/ or tests/faults/, or use the fake_redis fixture",
        pytrace=False,
    )


@pytest.fixture
def redis_tmp_server() -> str:
    pytest.fail(
        "tests/unit/ runs without a Redis server: move a test that needs a private "
        "redis-server to tests/integration/ or tests/faults/",
        pytrace=False,
    )


@pytest.fixture
def fake_redis(monkeypatch: pytest.MonkeyPatch) -> Iterator[fakeredis.FakeServer]:
    """One in-memory fakeredis server for this test. Every broker made meanwhile, the
    ones the CLI commands make from a URL included, connects to it, whatever the URL."""
    server = fakeredis.FakeServer()

    def connect(url: str) -> fakeredis.FakeRedis:
        return fakeredis.FakeRedis(server=server)

    monkeypatch.setattr(queueserve.broker.core, "connect", connect)
    yield server

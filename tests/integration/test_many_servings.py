"""A worker of many servings (issue 36): one with 130 declared about 50 after 70 s and answered
none, its log saying Redis was unavailable, while the limit was redis-py's default pool of 100
connections: each serving blocked on a connection of its own and listened for cancels on
another. Now a partition's idle servings block on one connection (broker/wakes.py) and listen
on one (broker/channels.py), its pool is sized from what it runs, and a pool at its limit is
said to be one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import pytest
import redis

import queueserve as qs
from queueserve.broker.channels import SharedSubscriptions
from queueserve.broker.connect import allow_connections
from queueserve.broker.consumer import Consumer
from queueserve.broker.errors import translate
from queueserve.broker.retry import Retry
from queueserve.wire.protocol import Keys
from tests.support.helpers import WAIT_S, wait_until
from tests.support.many_app import many_servings
from tests.support.redis_server import RedisServer


def subscribers(r: redis.Redis) -> int:
    """Connections subscribed to a pub/sub channel."""
    return sum(1 for c in r.client_list() if int(c.get("sub", 0)) > 0)


# -- a pool at its limit --------------------------------------------------------------------------
@pytest.fixture
def small_pool(redis_url: str) -> Iterator[Consumer]:
    """A worker's broker whose pool holds 2 connections, both taken."""
    broker = Consumer(redis_url, owner="partition 0 (test)")
    allow_connections(broker.redis, 2)
    pool = broker.redis.connection_pool
    held = [pool.get_connection() for _ in range(2)]
    try:
        yield broker
    finally:
        for connection in held:
            pool.release(connection)
        broker.close()


def test_a_pool_at_its_limit_is_reported_as_one_never_as_redis_down(
    small_pool: Consumer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(prefix, "s")
    # A command through redis-py, and one on the raw fast path, alike
    for command in (
        lambda: small_pool.config(keys),
        lambda: small_pool.read_ready(keys, "c", 1, 1, []),
    ):
        with pytest.raises(qs.ConnectionPoolExhausted) as caught:
            command()
        message = str(caught.value)
        assert message.startswith("connection pool of 2 exhausted:"), message
        assert "unavailable" not in message and "is up" not in message
        assert isinstance(caught.value, qs.RedisUnavailable)  # ridden out as an outage is
    # The loop that meets it logs it as what it is, once, and so its end
    with caplog.at_level(logging.INFO, logger="queueserve.broker.retry"):
        retry = Retry(small_pool.outage, "serving s reader")
        retry.failed(caught.value)
        retry.failed(caught.value)
        retry.succeeded()
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert "connection pool of 2 exhausted" in lines[0] and "serving s reader" in lines[0]
    assert "came free" in lines[1]
    assert not any("Redis unavailable" in line or "reachable" in line for line in lines)


def test_a_pool_error_of_redis_py_is_a_pool_limit_and_maxclients_a_server_limit() -> None:
    url = "redis://app:s3cret@127.0.0.1:1/0"
    pool = translate(redis.exceptions.MaxConnectionsError("Too many connections"), url)
    assert type(pool) is qs.ConnectionPoolExhausted
    assert str(pool).startswith("connection pool exhausted:") and "s3cret" not in str(pool)
    older = translate(redis.ConnectionError("Too many connections"), url)  # before redis-py 8
    assert type(older) is qs.ConnectionPoolExhausted
    server = translate(redis.ConnectionError("max number of clients reached"), url)
    assert type(server) is qs.RedisUnavailable and "maxclients" in str(server)
    assert "is up" not in str(server)


def test_a_partition_sizes_its_pool_from_what_it_runs(
    start_worker: Callable[..., qs.Worker],
) -> None:
    # Given a partition of 60 servings, run in this process
    worker = start_worker(*many_servings(60))
    host = worker._host
    assert host is not None
    # Then its pool holds two connections for each thread that may hold one at once (a thread
    # leaves one idle on each side: in the fast path's list and in redis-py's pool)
    threads = [t for r in host.runners for t in r.threads if not t.name.endswith("cancels")]
    assert len(threads) == 60 * 3  # a reader, a replier and an executor each
    pool = host.broker.redis.connection_pool
    assert pool.max_connections >= 2 * len(threads) > 100


def test_a_broker_sizes_its_pool_for_threads_never_under_the_default(redis_url: str) -> None:
    broker = Consumer(redis_url)
    try:
        broker.size_pool(130 * 3 + 2)  # 130 servings: reader, replier, executor each
        pool = broker.redis.connection_pool
        assert pool.max_connections >= 2 * (130 * 3 + 2)
        broker.size_pool(3)  # a small worker keeps redis-py's default
        assert pool.max_connections == 100
    finally:
        broker.close()


# -- cancel listeners share one connection --------------------------------------------------------
def shared_on(url: str) -> SharedSubscriptions:
    return SharedSubscriptions(redis.Redis.from_url(url), url)


def test_listeners_of_one_broker_share_one_pubsub_connection(
    redis_tmp_server: RedisServer, prefix: str
) -> None:
    r = redis.Redis.from_url(redis_tmp_server.url)
    shared = shared_on(redis_tmp_server.url)
    channels = [f"{prefix}:c{i}" for i in range(6)]
    listeners = [shared.listener(channel) for channel in channels]
    for listener in listeners:
        listener.open()
    got: dict[int, list[bytes]] = {i: [] for i in range(len(listeners))}

    def listen(i: int) -> None:
        while len(got[i]) < 2:
            message = listeners[i].get(timeout=0.2)
            if message is not None:
                got[i].append(message)

    threads = [threading.Thread(target=listen, args=(i,), daemon=True) for i in got]
    for thread in threads:
        thread.start()
    try:
        assert subscribers(r) == 1  # six listeners, one connection
        for i, channel in enumerate(channels):
            r.publish(channel, f"first {i}")
            r.publish(channel, f"second {i}")
        for thread in threads:
            thread.join(WAIT_S)
        # Each listener got its own channel's messages, in order, and no other's
        assert got == {i: [f"first {i}".encode(), f"second {i}".encode()] for i in got}
    finally:
        for listener in listeners:
            listener.close()
    wait_until(lambda: subscribers(r) == 0, "the connection closed with the last listener")
    r.close()


def test_shared_listeners_ride_out_a_dropped_connection(
    redis_tmp_server: RedisServer, prefix: str
) -> None:
    r = redis.Redis.from_url(redis_tmp_server.url)
    shared = shared_on(redis_tmp_server.url)
    first, second = shared.listener(f"{prefix}:a"), shared.listener(f"{prefix}:b")
    first.open()
    second.open()
    # The connection is dropped (a Redis restart, CLIENT KILL): a listener that meets it is
    # told, as any loop is, and the next read connects again, subscribed to both channels
    r.client_kill_filter(_type="pubsub")

    def read_on() -> bool:
        for listener in (first, second):
            with contextlib.suppress(qs.RedisUnavailable):
                listener.get(timeout=0.01)
        return subscribers(r) == 1 and r.pubsub_numsub(f"{prefix}:a", f"{prefix}:b") == [
            (f"{prefix}:a".encode(), 1),
            (f"{prefix}:b".encode(), 1),
        ]

    wait_until(read_on, "subscribed again, to both channels")
    r.publish(f"{prefix}:a", "to a")
    r.publish(f"{prefix}:b", "to b")
    assert wait_until(lambda: second.get(timeout=0.1), "b's message") == b"to b"
    assert wait_until(lambda: first.get(timeout=0.1), "a's message") == b"to a"
    first.close()
    second.close()
    r.close()

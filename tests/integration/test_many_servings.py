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
from pathlib import Path

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.broker import raw
from queueserve.broker.channels import SharedSubscriptions
from queueserve.broker.connect import allow_connections
from queueserve.broker.consumer import Consumer
from queueserve.broker.reads import ReadOutcome, WakeRead
from queueserve.broker.redis_errors import translate
from queueserve.broker.retry import Retry
from queueserve.wire.keys import Keys
from tests.support.broker import RedisBroker
from tests.support.fault_app import RawInbox, WorkerProc, header
from tests.support.helpers import WAIT_S, wait_until
from tests.support.many_app import SERVINGS, many_servings, name_of
from tests.support.redis_server import RedisServer

BLOCK_MS = 100  # what a worker's reader blocks for (worker/pipeline/lease.py)


def one_read_for_all(url: str, streams: list[str], reads: int = 3) -> bool:
    """Whether the next ``reads`` XREADs Redis runs (MONITOR) each block on every stream of
    ``streams`` at once: idle servings blocking together, never one by one."""
    seen = 0
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        with client.monitor() as monitor:
            while seen < reads:
                command = monitor.next_command()["command"].split()
                if command[0] == "XREAD":
                    seen += 1
                    if not set(streams) <= set(command):
                        return False
    finally:
        client.close()
    return True


def subscribers(r: redis.Redis) -> int:
    """Connections subscribed to a pub/sub channel."""
    return sum(1 for c in r.client_list() if int(c.get("sub", 0)) > 0)


# -- the worker -----------------------------------------------------------------------------------
def test_a_worker_of_130_servings_answers_each_and_idles_on_one_connection(
    redis_tmp_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    url = redis_tmp_server.url  # a server of its own: every connection on it is the test's
    r = redis.Redis.from_url(url)
    worker = WorkerProc.one_partition(
        ["tests.support.many_app:servings"], url, prefix, tmp_path / "worker.log"
    )
    client = qs.Client(url, prefix=prefix)
    try:
        # Given a worker of 130 servings in one partition, idle since it started
        # When a request goes to each of them in turn
        for i in range(SERVINGS):
            answer = client.dispatch(name_of(i), i, timeout=WAIT_S)
            # Then each answers (the 130th too), as itself
            assert answer == f"{name_of(i)}:{i}"
        client.close()
        # And once idle again, its servings block in one read and listen on one connection
        wakes = [Keys(prefix, name_of(i)).wake for i in range(SERVINGS)]
        wait_until(
            lambda: subscribers(r) == 1 and one_read_for_all(url, wakes),
            "the idle servings to block in one read and listen on one connection",
            process=worker,
        )
        log = worker.output()
        assert "unavailable" not in log and "exhausted" not in log, log
    finally:
        client.close()
        worker.kill_group()
        r.close()


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


# -- what a burst opened goes back ----------------------------------------------------------------
def test_connections_idle_since_the_last_trim_are_closed(redis_tmp_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_tmp_server.url)
    client = redis.Redis.from_url(redis_tmp_server.url, max_connections=5)
    connections = raw.Connections(client.connection_pool)
    try:
        # Given a burst: five commands at once, on five connections
        burst = [raw.send(connections, [("PING",)]) for _ in range(5)]
        for sent in burst:
            sent.read(1)
        assert len(r.client_list()) == 1 + 5
        connections.trim()  # (the first trim starts the count)
        # When two are needed at once since, and the rest stay idle
        for _ in range(3):
            both = [raw.send(connections, [("PING",)]) for _ in range(2)]
            for sent in both:
                sent.read(1)
        # Then a trim closes the three not needed, and the two go on serving
        assert connections.trim() == 3
        assert len(r.client_list()) == 1 + 2
        assert raw.run(connections, [("PING",)]) == [b"PONG"]
        # And trims after that close them too, the one the PING left idle first
        assert connections.trim() == 1 and connections.trim() == 1
        assert len(r.client_list()) == 1
        # Given back to the pool, they no longer count against its limit of 5
        assert raw.run(connections, [("PING",)]) == [b"PONG"]
    finally:
        connections.close()
        client.close()
        r.close()


# -- idle servings block together -----------------------------------------------------------------
def enqueue_one(broker: RedisBroker, keys: Keys, inbox: RawInbox, item: str) -> None:
    """What a client's dispatch writes: one request of one item (enqueue.lua)."""
    broker.enqueue(keys, [("default", 1, header(1, 1, inbox.key), msgpack.packb([item]), 0)], 0)


def test_idle_servings_block_on_one_connection_and_each_wakes_for_its_own_work(
    redis_tmp_server: RedisServer, prefix: str
) -> None:
    r = redis.Redis.from_url(redis_tmp_server.url)
    broker = RedisBroker(redis_tmp_server.url)
    servings = [Keys(prefix, f"s{i}") for i in range(8)]
    for keys in servings:
        broker.ensure_group(keys.stream("default"))
    got: dict[str, ReadOutcome] = {}
    stop = threading.Event()

    def reader(keys: Keys) -> None:
        """A serving's reader: block for work (BLOCK_MS at a time) until some comes."""
        after = broker.read_ready(keys, "c", 10, 10, []).wake_id
        while not stop.is_set():
            read = broker.wait_then_read(keys, WakeRead(after, BLOCK_MS, "c", 10, 10, []))
            if read.entries:
                got[keys.name] = read
                return
            after = read.wake_id

    threads = [threading.Thread(target=reader, args=(keys,), daemon=True) for keys in servings]
    for thread in threads:
        thread.start()
    try:
        # Given 8 idle servings, each waiting for work: they block in one read
        wakes = [keys.wake for keys in servings]
        wait_until(lambda: one_read_for_all(redis_tmp_server.url, wakes), "one read for all")
        # When a request comes for one of them
        enqueue_one(broker, servings[5], RawInbox(r, prefix), "x")
        # Then that one reads it, and the others go on waiting
        wait_until(lambda: servings[5].name in got, "the serving with work to read it")
        assert list(got) == [servings[5].name]
        (stream, entries), *_ = got[servings[5].name].entries
        assert stream == servings[5].stream("default") and len(entries) == 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        broker.close()
        r.close()


def test_a_watched_serving_finds_work_that_came_without_waking_it(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    """Work left ready with no entry on the wake stream (a key another worker left unread, a
    member anyone may write) is found, as each serving's read after its block found it."""
    broker = RedisBroker(redis_url)
    keys = Keys(prefix, "s")
    broker.ensure_group(keys.stream("default"))
    try:
        after = broker.read_ready(keys, "c", 10, 10, []).wake_id
        wait = WakeRead(after, BLOCK_MS, "c", 10, 10, [])
        for _ in range(3):  # (the first blocks alone: no XREAD of the watch covers it yet)
            assert not broker.wait_then_read(keys, wait).entries
        # An entry, and its key marked ready, as enqueue.lua would, but no wake entry
        redis_client.xadd(keys.stream("default"), {"h": header(1, 1, "i"), "p": b"\x91\xa1x"})
        redis_client.zadd(keys.ready, {"0default": 1})
        read = wait_until(
            lambda: broker.wait_then_read(keys, wait).entries, "the ready work to be read"
        )
        assert read[0][0] == keys.stream("default")
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

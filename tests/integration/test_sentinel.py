"""queueserve through Sentinel (1 master, 2 replicas, 3 sentinels): a ``redis+sentinel://``
URL, the core cases, durable enqueue, and a SENTINEL FAILOVER under load that every thread
rides out.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import pytest
import redis

import queueserve as qs
from queueserve.broker.connect import parse_url
from tests.support.helpers import wait_until
from tests.support.redis_topologies import SentinelSet, sentinel_set


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    with sentinel_set(tmp_path_factory.mktemp("sentinel")) as s:
        yield s


@pytest.fixture
def prefix() -> str:
    return f"qss{uuid4().hex[:8]}"


def double(xs: list[Any]) -> list[Any]:
    if any(x == "boom" for x in xs):
        raise ValueError("boom is not a number")
    return [x * 2 for x in xs]


def test_sentinel_urls_are_parsed_and_checked() -> None:
    t = parse_url("redis+sentinel://u:pw@s1:26379,s2/mymaster/2?sentinel_password=spw")
    assert (t.kind, t.hosts, t.service, t.db) == (
        "sentinel",
        (("s1", 26379), ("s2", 26379)),
        "mymaster",
        2,
    )
    assert (t.username, t.password, t.sentinel_auth) == ("u", "pw", {"password": "spw"})
    assert parse_url("redis+sentinel://s1/m?password=x").password == "x"
    with pytest.raises(ValueError, match="names no service"):
        parse_url("redis+sentinel://s1:26379")
    with pytest.raises(ValueError, match="database 'x' is not a number"):
        parse_url("redis+sentinel://s1:26379/m/x")
    with pytest.raises(ValueError, match="'s1:port' is not host:port"):
        parse_url("redis+sentinel://s1:port/m")
    assert qs.Client("redis+sentinel://127.0.0.1:1/m").url.startswith("redis+sentinel://")


def test_core_cases_through_sentinel(sentinels: SentinelSet, prefix: str) -> None:
    serving = qs.Serving(double, name="double", batch_size=16, batch_timeout=0.001, durable=True)
    worker = qs.Worker(
        [serving], redis_url=sentinels.url, prefix=prefix, handle_signals=False
    ).start()
    try:
        with qs.Client(sentinels.url, prefix=prefix) as client:
            assert client.dispatch("double", 4) == 8
            assert client.dispatch_many(serving, [1, "ab"]) == [2, "abab"]
            with pytest.raises(qs.RemoteError, match="boom is not a number"):
                client.dispatch(serving, "boom")
            assert list(client.map(serving, range(500), chunk_size=32)) == [
                2 * x for x in range(500)
            ]
            assert client.dispatch(serving, 1, batch_key="other") == 2
        asyncio.run(_async_dispatch(sentinels.url, prefix))
    finally:
        worker.stop(timeout=10)


async def _async_dispatch(url: str, prefix: str) -> None:
    async with qs.AsyncClient(url, prefix=prefix) as client:
        assert await client.dispatch("double", 21) == 42


def test_durable_enqueue_without_a_replica_tells_the_caller(tmp_path: Any) -> None:
    # Given a durable serving on a master whose replicas are gone (none can acknowledge)
    from tests.support.redis_server import start_redis_server

    lone = start_redis_server(tmp_path / "lone")
    try:
        with qs.Client(lone.url, prefix="qsd") as client, redis.Redis(port=lone.port) as r:
            serving = qs.Serving(double, name="lonely", durable=True)
            # When a request is sent, Then the caller learns it is not safe, after one wait
            with pytest.raises(qs.NotReplicated, match=r"no replica acknowledged it within"):
                client.dispatch(serving, 1, timeout=30)
            assert r.xlen("qsd:{lonely}:in:default") == 1  # queued on the primary all the same
            assert _waits(r) == 1
            # And the same serving without durable is sent without a WAIT
            client.submit(qs.Serving(double, name="lonely"), [1])
            wait_until(lambda: r.xlen("qsd:{lonely}:in:default") == 2, "the plain enqueue")
            assert _waits(r) == 1
    finally:
        lone.stop()


def test_a_durable_enqueue_whose_master_turns_replica_meanwhile_is_retried(tmp_path: Any) -> None:
    # Given a durable enqueue waiting (WAIT 1) on a master that has no replica
    from queueserve.wire.keys import Keys
    from tests.support.broker import RedisBroker
    from tests.support.redis_server import start_redis_server

    master = start_redis_server(tmp_path / "master")
    other = start_redis_server(tmp_path / "other")
    broker = RedisBroker(master.url)
    outcome: list[BaseException | None] = []

    def enqueue() -> None:
        try:
            broker.enqueue(Keys("qsd", "turned"), [("default", 1, b"h", b"p", 0)], 0, durable=True)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=enqueue)
    try:
        with redis.Redis(port=master.port) as r:
            thread.start()
            wait_until(lambda: int(r.info("clients")["blocked_clients"]) == 1, "the WAIT to block")
            # When a failover turns that master into a replica (Redis answers the blocked
            # WAIT with UNBLOCKED)
            r.replicaof("127.0.0.1", other.port)
            thread.join(timeout=10)
        # Then the sender gets a transient error, which its retry rides out on the new
        # master: not a TypeError that killed the client's sender thread, whose callers then
        # waited for their timeout (20 durable requests "lost" in bench.cluster's takeover)
        assert len(outcome) == 1 and isinstance(outcome[0], qs.RedisUnavailable), outcome
        assert "UNBLOCKED" in str(outcome[0])
    finally:
        broker.close()
        master.stop()
        other.stop()


def _waits(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_sentinel_failover_under_load_every_thread_rides_it_out(
    sentinels: SentinelSet, prefix: str
) -> None:
    # Given a worker and 4 sending threads through the sentinels
    serving = qs.Serving(double, name="ride", batch_size=32, batch_timeout=0.002, durable=True)
    worker = qs.Worker(
        [serving], redis_url=sentinels.url, prefix=prefix, handle_signals=False
    ).start()
    outcomes: Counter[str] = Counter()
    after_failover: Counter[str] = Counter()
    failed_over = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []

    def send(first: int) -> None:
        try:
            with qs.Client(sentinels.url, prefix=prefix) as client:
                n = first
                while not stop.is_set():
                    try:
                        ok = client.dispatch(serving, n, timeout=40) == 2 * n
                        kind = "answered" if ok else "wrong"
                    except qs.Timeout:
                        kind = "lost"
                    except (qs.NotReplicated, qs.RedisUnavailable):
                        kind = "refused"
                    outcomes[kind] += 1
                    if failed_over.is_set():
                        after_failover[kind] += 1
                    n += 4
        except BaseException as e:  # a thread that dies fails the test
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: outcomes["answered"] > 200, "answers before the failover")
        # When the sentinels promote a replica
        sentinels.failover()
        failed_over.set()
        # Then every thread keeps getting answers from the new master
        wait_until(
            lambda: after_failover["answered"] > 200, "answers after the failover", timeout=60
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        worker.stop(timeout=10)
    print(f"\nsentinel failover under durable load: {dict(outcomes)}")
    assert not errors and all(not t.is_alive() for t in threads)
    assert outcomes["lost"] == 0 and outcomes["wrong"] == 0, outcomes

"""The hot path's commands written straight onto pooled connections (queueserve/broker/raw.py):
error replies in their place, and a connection that breaks sends nothing twice."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis

from queueserve.broker import raw
from tests.support.helpers import wait_until


@pytest.fixture
def pool(redis_url: str) -> Iterator[raw.Connections]:
    redis_pool = redis.ConnectionPool.from_url(redis_url)
    connections = raw.Connections(redis_pool)
    yield connections
    connections.close()
    redis_pool.disconnect()


def test_each_reply_comes_back_in_its_commands_place_errors_too(
    pool: raw.Connections, redis_client: redis.Redis, prefix: str
) -> None:
    key = f"{prefix}:raw"
    replies = raw.run(pool, [("SET", key, "x"), ("LPUSH", key, "y"), ("GET", key)])
    assert replies[0] == b"OK"
    assert isinstance(replies[1], redis.ResponseError) and "WRONGTYPE" in str(replies[1])
    assert replies[2] == b"x"
    redis_client.delete(key)


def test_a_connection_killed_while_idle_is_made_anew(
    pool: raw.Connections, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a pooled connection that served a command, then was killed while idle in the pool
    key = f"{prefix}:raw"
    assert raw.run(pool, [("CLIENT", "SETNAME", f"{prefix}-raw")]) == [b"OK"]
    (mine,) = [c for c in redis_client.client_list() if c["name"] == f"{prefix}-raw"]
    redis_client.client_kill_filter(_id=mine["id"])
    # When commands go out again, Then they run, once, on a new connection
    assert raw.run(pool, [("INCR", key)]) == [1]
    assert redis_client.get(key) == b"1"
    redis_client.delete(key)


def test_commands_written_before_the_connection_broke_are_not_sent_again(
    pool: raw.Connections, redis_client: redis.Redis, prefix: str
) -> None:
    # Given an INCR written and run, with a BLPOP behind it that keeps its connection waiting
    key, empty = f"{prefix}:raw", f"{prefix}:empty"
    outcome: list[object] = []

    def send() -> None:
        try:
            outcome.append(raw.run(pool, [("INCR", key), ("BLPOP", empty, 10)]))
        except redis.ConnectionError as e:
            outcome.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    blocked = wait_until(
        lambda: [c for c in redis_client.client_list() if c["cmd"] == "blpop"],
        "the BLPOP blocks",
    )
    # When that connection is killed before the replies come back
    redis_client.client_kill_filter(_id=blocked[0]["id"])
    sender.join(10)
    # Then the caller gets the connection error, and the INCR ran once (an enqueue sent again
    # would queue its requests twice)
    assert len(outcome) == 1 and isinstance(outcome[0], redis.ConnectionError)
    assert redis_client.get(key) == b"1"
    redis_client.delete(key)

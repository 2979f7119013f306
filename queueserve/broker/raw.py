"""Commands written straight onto a pooled connection: the hot path's round trips.

A redis-py pipeline costs 15-35 µs of CPU per round trip beyond the packing and the socket
(command stacks, per-command wrappers, its retry and observability layers; ``python -m
bench.raw_cost`` on the development machine), and one dispatch makes four round trips (enqueue,
the worker's read, its reply, the caller's inbox read). On a plain server or a Sentinel-managed
master, those four go through ``run``: each command packed by hiredis, all written in one send,
each reply read back in order. A Redis Cluster client keeps redis-py's own routing.

Errors are what redis-py raises: a command's error reply is returned in its place (as a
pipeline's ``raise_on_error=False`` does); a connection that breaks is dropped, and raised for
the caller's ``redis_errors`` to map. The commands are sent again on a new connection only when
the first could not even take them: once written, they may have run, and enqueue must not run
twice. (A connection whose server went away meanwhile is found out and made anew by the pool as
it hands it over.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import hiredis
import redis
from redis.connection import ConnectionPool


def run(pool: ConnectionPool, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one write and read their replies (an exception for each error)."""
    packed = [hiredis.pack_command(command) for command in commands]
    for attempt in (1, 2):
        connection: Any = pool.get_connection()
        try:
            try:
                connection.send_packed_command(packed)
            except (redis.ConnectionError, redis.TimeoutError):
                if attempt == 2:
                    raise
                continue  # it dropped the connection: the finally hands it back for a new one
            return _replies(connection, len(packed))
        except BaseException:
            connection.disconnect()  # replies may be left unread on it
            raise
        finally:
            pool.release(connection)
    raise AssertionError("unreachable")


def _replies(connection: Any, count: int) -> list[Any]:
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(connection.read_response())
        except redis.ResponseError as e:
            replies.append(e)
    return replies

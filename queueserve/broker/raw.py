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
twice. (A connection whose server closed it meanwhile is found out, and connected anew,
before it is used: ``Connections.take``.)

``send`` writes and leaves the replies to be read in parts (``Sent``): a worker sends its next
blocking read behind a reply, reads the reply's results, settles them, and only then waits for
the read; a part left unread is abandoned with its connection.

Connections wait between uses in a ``Connections`` list of this module's own rather than in
the redis-py pool, whose checkout costs 12 µs here (locks, a fork check, deprecation and
observability wrappers; four checkouts per dispatch). Each is checked out of the pool once,
when the list has none idle, so the pool makes it as it makes any (address, options, health
checks; for Sentinel, the master it asks the sentinels for), and keeps it counted in use until
the client closes or ``trim`` gives it back, closed, for staying idle; before each use it is
checked for a server that closed it, as the pool checks, and a forked child drops the list.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from typing import Any

import hiredis
import redis
from redis.connection import ConnectionPool


class Connections:
    """Idle connections for ``run``, made by ``pool``."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._idle: deque[Any] = deque()  # the last given back on the right
        self._low = 0  # the fewest idle since the last trim: none of those was needed
        self._pid = os.getpid()
        self._closed = False

    def take(self) -> Any:
        if self._pid != os.getpid():  # a forked child: the parent's sockets are not its own
            self._idle, self._pid = deque(), os.getpid()
        try:
            connection = self._idle.pop()
        except IndexError:
            self._low = 0
            return self._pool.get_connection()  # ours until trimmed or closed
        if len(self._idle) < self._low:
            self._low = len(self._idle)
        try:
            # connect() itself, not the send's own reconnect: a Sentinel-managed connection
            # asks the sentinels for the master only there (the send would reconnect to the
            # address it last had, an old master after a failover).
            connection.connect()
            closed = connection.can_read()  # a server that closed it: an end of file
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            closed = True
        if closed:  # (a restart, CLIENT KILL, its idle timeout)
            connection.disconnect()
            connection.connect()
        return connection

    def give_back(self, connection: Any) -> None:
        if self._closed:
            connection.disconnect()
        else:
            self._idle.append(connection)

    def trim(self) -> int:
        """Close the connections that stayed idle since the last trim (the least recently
        used: those left of the fewest idle meanwhile), and give them back to the pool, whose
        limit counts them until then; returns how many. A burst's connections last until the
        next trim, not for ever."""
        closed = 0
        for _ in range(self._low):
            try:
                connection = self._idle.popleft()
            except IndexError:  # (taken meanwhile)
                break
            connection.disconnect()
            self._pool.release(connection)
            closed += 1
        self._low = len(self._idle)
        return closed

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().disconnect()


def run(connections: Connections, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one write and read their replies (an exception for each error)."""
    return send(connections, commands).read(len(commands))


def send(connections: Connections, commands: Sequence[tuple[Any, ...]]) -> Sent:
    """Write ``commands`` in one send; their replies are read from what this returns."""
    # One buffer, one send: redis-py sends a list item by item, a segment each, and Redis
    # may run the first commands and serve the clients they unblock before the rest arrive.
    packed = [b"".join([hiredis.pack_command(command) for command in commands])]
    for attempt in (1, 2):
        connection = connections.take()  # (a server that cannot be reached raises here)
        try:
            connection.send_packed_command(packed)
        except (redis.ConnectionError, redis.TimeoutError):
            connections.give_back(connection)  # dropped by redis-py: connected anew when taken
            if attempt == 2:
                raise
            continue
        except BaseException:
            connection.disconnect()
            connections.give_back(connection)
            raise
        return Sent(connections, connection, len(commands))
    raise AssertionError("unreachable")


class Sent:
    """Commands written on a connection, whose replies are read in order, in parts: the
    connection goes back to the list once every reply was read, or disconnected when the
    rest are abandoned (they may still come, and must not be read as another's)."""

    __slots__ = ("_connection", "_connections", "_left")

    def __init__(self, connections: Connections, connection: Any, replies: int) -> None:
        self._connections = connections
        self._connection = connection
        self._left = replies

    def read(self, count: int) -> list[Any]:
        """The next ``count`` replies (an exception for each error reply)."""
        try:
            replies = _replies(self._connection, count)
        except BaseException:
            self.abandon()
            raise
        self._left -= count
        if self._left == 0:
            self._connections.give_back(self._connection)
        return replies

    def abandon(self) -> None:
        if self._left:
            self._left = 0
            self._connection.disconnect()
            self._connections.give_back(self._connection)


def _replies(connection: Any, count: int) -> list[Any]:
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(connection.read_response())
        except redis.ResponseError as e:
            replies.append(e)
    return replies

"""One pub/sub connection for many listeners: a worker partition's cancel listeners (one per
serving) share it, where each held a connection of its own (a partition of 130 servings held
130, and ran out of redis-py's pool of 100).

Each listener subscribes its channels on the shared connection (``open``) and reads as it would
read a ``Subscription`` of its own (``get``). Whichever listener's ``get`` finds nobody reading
reads for all of them and hands each message to the listeners of its channel; the others wait
for theirs, or for their turn to read. After a failure the connection is made anew, subscribed
to every listener's channels, by the next listener to read; the failure reaches the listener
that met it, whose loop rides it out as before.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any, cast

import redis

from queueserve.broker.core import Subscription, pubsub_errors
from queueserve.errors import RedisUnavailable


class SharedSubscriptions:
    """The shared connection, its channels, and who reads it now."""

    def __init__(self, client: redis.Redis | redis.RedisCluster, url: str) -> None:
        self.url = url
        self._client = client
        self._lock = threading.Lock()
        self._pubsub: Any = None
        self._subscribed: dict[str, None] = {}  # every channel ever opened, in order
        self._listeners: dict[bytes, list[Listener]] = {}  # channel -> its listeners
        self._reading = False  # a listener reads the connection now
        self._waiting: list[Listener] = []  # listeners in get(), waiting for their turn or data

    def listener(self, *channels: str) -> Listener:
        return Listener(self, channels)

    def open(self, listener: Listener) -> None:
        """Subscribe ``listener``'s channels now (a cancel published between a serving's first
        read and a later subscription would be missed)."""
        with self._lock:
            new = [c for c in listener.channels if c not in self._subscribed]
            for channel in listener.channels:
                self._listeners.setdefault(channel.encode(), []).append(listener)
            self._subscribed.update(dict.fromkeys(new))
            try:
                if self._pubsub is None:
                    self._connected()
                elif new:
                    with pubsub_errors(self.url):
                        self._pubsub.subscribe(*new)
            except RedisUnavailable:
                self._drop(listener)  # its owner opens another (the channels stay subscribed)
                self._close_connection()
                raise

    def get(self, listener: Listener, timeout: float) -> bytes | None:
        """The next message of ``listener``'s channels, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                done, found = self._turn(listener, deadline)
                if done:
                    return cast(bytes | None, found)
            message = None
            try:
                with pubsub_errors(self.url):
                    message = found.get_message(timeout=max(0.0, deadline - time.monotonic()))
            except RedisUnavailable:
                with self._lock:
                    if self._pubsub is found:
                        self._close_connection()
                raise
            finally:
                with self._lock:
                    self._reading = False
                    if message is not None:
                        self._deliver(message)
                    self._pass_turn()

    def close(self, listener: Listener) -> None:
        with self._lock:
            self._drop(listener)
            if not self._listeners:
                self._close_connection()

    def _turn(self, listener: Listener, deadline: float) -> tuple[bool, Any]:
        """(True, what ``get`` returns) once there is one, or (False, the connection) when it
        is ``listener``'s turn to read it (caller holds the lock)."""
        while True:
            if listener.messages:
                self._pass_turn()
                return True, listener.messages.popleft()
            left = deadline - time.monotonic()
            if left <= 0:
                self._pass_turn()
                return True, None
            if not self._reading:
                self._reading = True
                try:
                    return False, self._connected()
                except BaseException:
                    self._reading = False
                    self._pass_turn()
                    raise
            self._waiting.append(listener)
            try:
                listener.ready.wait(left)
            finally:
                self._waiting.remove(listener)

    def _pass_turn(self) -> None:
        """Nobody reads now: wake a waiting listener to read (caller holds the lock)."""
        if not self._reading and self._waiting:
            self._waiting[0].ready.notify()

    def _connected(self) -> Any:
        """The connection, subscribed to every channel opened (caller holds the lock)."""
        if self._pubsub is None:
            with pubsub_errors(self.url):
                pubsub = self._client.pubsub(  # type: ignore[no-untyped-call, unused-ignore]
                    ignore_subscribe_messages=False
                )
                self._pubsub = pubsub
                try:
                    pubsub.subscribe(*self._subscribed)
                except BaseException:
                    self._close_connection()
                    raise
        return self._pubsub

    def _deliver(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        channel = message.get("channel")
        for listener in self._listeners.get(channel, []) if isinstance(channel, bytes) else []:
            if kind == "message":
                listener.messages.append(message["data"])
                listener.ready.notify()
            elif kind == "subscribe":
                listener.confirmed = True

    def _drop(self, listener: Listener) -> None:
        for channel in listener.channels:
            held = self._listeners.get(channel.encode(), [])
            if listener in held:
                held.remove(listener)
            if not held:
                self._listeners.pop(channel.encode(), None)
        listener.messages.clear()

    def _close_connection(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                pubsub.close()


class Listener(Subscription):
    """Channels read on a ``SharedSubscriptions`` connection: a ``Subscription`` to its user."""

    def __init__(self, shared: SharedSubscriptions, channels: tuple[str, ...]) -> None:
        super().__init__(shared._client, shared.url, *channels)
        self._shared = shared
        self.messages: deque[bytes] = deque()
        self.ready = threading.Condition(shared._lock)

    def open(self) -> None:
        self._shared.open(self)

    def get(self, timeout: float) -> bytes | None:
        return self._shared.get(self, timeout)

    def close(self) -> None:
        self._shared.close(self)

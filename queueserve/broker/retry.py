"""The one retry policy for Redis: backoff, and one log line per outage at each end.

Every long-lived loop that talks to Redis (client sender, inbox reader and event subscriber,
sync and async; worker reader, replier, heartbeat, cancel listener) holds a :class:`Retry` and
reports each attempt to it. All the loops of one broker share its :class:`Outage`, so an outage
logs one warning when the first loop hits it and one info line, with its duration, when the
last loop that hit it gets through again, however many loops and attempts it took.

A transient error (``RedisUnavailable``: connection lost, OOM, READONLY, UNBLOCKED, LOADING,
NOGROUP, MASTERDOWN) is ridden out. An error retrying will not fix (``RedisCommandError``) is
logged as an error once per loop and message, and retried with the same backoff: a long-lived
thread never ends of a Redis reply while its owner lives.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from queueserve.errors import (
    ConnectionPoolExhausted,
    QueueServeError,
    RedisCommandError,
    RedisUnavailable,
)
from queueserve.wire.timing import backoff

log = logging.getLogger(__name__)

T = TypeVar("T")
RedisFailure = (RedisUnavailable, RedisCommandError)


class Outage:
    """Whether one Redis deployment is failing, as the loops of one owner see it."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # who is told about it in the log: "client 3f2a...", "partition 0"
        self._lock = threading.Lock()
        self._failing: set[str] = set()
        self._since = 0.0
        self._pool_limit = False  # the outage is a connection pool at its limit
        self.failures = 0  # failed attempts of every loop so far (the workers' metrics)

    @property
    def ongoing(self) -> bool:
        return bool(self._failing)

    def failed(self, loop: str, error: RedisUnavailable) -> None:
        with self._lock:
            self.failures += 1
            if self._failing:
                self._failing.add(loop)
                return
            self._failing.add(loop)
            self._since = time.monotonic()
            # A pool at its limit is this process's, not Redis's: said as what it is.
            pool_limit = self._pool_limit = isinstance(error, ConnectionPoolExhausted)
        if pool_limit:
            log.warning(
                "%s: %s (first seen by the %s); retrying with backoff", self.owner, error, loop
            )
            return
        log.warning(
            "%s: Redis unavailable (%s, first seen by the %s); retrying with backoff",
            self.owner,
            error,
            loop,
        )

    def recovered(self, loop: str) -> None:
        if self._pool_limit:
            self._leave(loop, "a connection of the pool came free after %.1fs exhausted")
        else:
            self._leave(loop, "Redis is reachable again after %.1fs unavailable")

    def abandoned(self, loop: str) -> None:
        """``loop`` stopped retrying with Redis still failing (its caller's time ran out)."""
        self._leave(loop, "gave up waiting for Redis after %.1fs unavailable")

    def _leave(self, loop: str, message: str) -> None:
        with self._lock:
            if loop not in self._failing:
                return
            self._failing.discard(loop)
            if self._failing:
                return
            took = time.monotonic() - self._since
        log.info("%s: " + message, self.owner, took)


class Retry:
    """Backoff state of one loop; ``run`` / ``arun`` retry one operation until it succeeds,
    ``once`` / ``aonce`` make one turn of a loop that goes on."""

    def __init__(self, outage: Outage, loop: str) -> None:
        self.outage = outage
        self.loop = loop
        self.attempt = 0
        self._refusals: set[str] = set()

    def failed(self, error: QueueServeError) -> float:
        """Record a failed attempt; returns how long to wait before the next one."""
        if isinstance(error, RedisUnavailable):
            self.outage.failed(self.loop, error)
        elif str(error) not in self._refusals:
            self._refusals.add(str(error))
            log.error("%s: %s: %s; retrying with backoff", self.outage.owner, self.loop, error)
        delay = backoff(self.attempt)
        self.attempt += 1
        return delay

    def succeeded(self) -> None:
        if self.attempt:
            self.attempt = 0
            self._refusals.clear()
            self.outage.recovered(self.loop)

    def gave_up(self) -> None:
        """The loop stops retrying (its caller's time is up, or it is closing)."""
        self.attempt = 0
        self.outage.abandoned(self.loop)

    def once(
        self,
        operation: Callable[[], T],
        then: Callable[[T], object],
        *,
        sleep: Callable[[float], object] = time.sleep,
        most: float | None = None,
    ) -> None:
        """One turn of a long-lived loop: ``then(operation())``; after a failure, the backoff
        slept instead (at most ``most`` seconds), and the loop's next turn tries again."""
        try:
            result = operation()
        except RedisFailure as e:
            delay = self.failed(e)
            sleep(delay if most is None else min(delay, most))
            return
        self.succeeded()
        then(result)

    async def aonce(
        self, operation: Callable[[], Awaitable[T]], then: Callable[[T], object]
    ) -> None:
        """``once`` for coroutines."""
        try:
            result = await operation()
        except RedisFailure as e:
            await asyncio.sleep(self.failed(e))
            return
        self.succeeded()
        then(result)

    def _wait_before_retry(
        self, error: QueueServeError, keep_going: Callable[[], bool], give_up_at: float | None
    ) -> float | None:
        """Seconds to wait before the next attempt, or None when there is none to make."""
        delay = self.failed(error)
        now = time.monotonic()
        if keep_going() and (give_up_at is None or now < give_up_at):
            return delay if give_up_at is None else min(delay, give_up_at - now)
        self.gave_up()
        return None

    def run(
        self,
        operation: Callable[[], T],
        *,
        keep_going: Callable[[], bool] = lambda: True,
        give_up_at: float | None = None,
        sleep: Callable[[float], object] = time.sleep,
    ) -> T:
        """``operation()``, retried while ``keep_going()`` and until ``give_up_at`` (monotonic);
        then its last error is raised. ``sleep`` may be an Event's wait, to stop sooner."""
        while True:
            try:
                result = operation()
            except RedisFailure as e:
                if (delay := self._wait_before_retry(e, keep_going, give_up_at)) is None:
                    raise
                sleep(delay)
                continue
            self.succeeded()
            return result

    async def arun(
        self,
        operation: Callable[[], Awaitable[T]],
        *,
        keep_going: Callable[[], bool] = lambda: True,
        give_up_at: float | None = None,
    ) -> T:
        """``run`` for coroutines."""
        while True:
            try:
                result = await operation()
            except RedisFailure as e:
                if (delay := self._wait_before_retry(e, keep_going, give_up_at)) is None:
                    raise
                await asyncio.sleep(delay)
                continue
            self.succeeded()
            return result

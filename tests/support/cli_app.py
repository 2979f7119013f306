"""Servings for the CLI tests, loaded by worker processes as ``tests.support.cli_app:NAME``.

Nothing here imports torch, so worker processes start fast.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import redis

import queueserve as qs

GATE_TIMEOUT_S = 30
GO_READ_S = 1  # each wait on the go list: short, so one failed read is not the gate's end


def wait_for_go(url: str, key: str, limit: float = GATE_TIMEOUT_S) -> None:
    """Block until the list ``key`` gets a value (the test's go), for ``limit`` seconds at
    most, in short reads on a connection made anew after a failed one. One 30 s BLPOP, in a
    partition draining after a SIGTERM to its process group, once failed with redis-py's
    "Timeout reading from" on a connection made without a timeout (cause not found): the
    batch then failed with an error of the test's gate, not of the worker."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        client = redis.Redis.from_url(url)
        try:
            if client.blpop([key], timeout=GO_READ_S) is not None:
                return
        except (redis.TimeoutError, redis.ConnectionError):
            pass  # read again, on a new connection
        finally:
            client.close()
    raise TimeoutError("the test never said go")


def _square(xs: list[int]) -> list[int]:
    return [x * x for x in xs]


square = qs.Serving(_square, name="square", batch_size=8)


@qs.serving(name="cube", batch_size=8)
def cube(xs: list[int]) -> list[int]:
    return [x**3 for x in xs]


both = [square, cube]


class Doubler(qs.Serving):
    """A subclass spec: the CLI instantiates it."""

    name = "doubler"
    batch_size = 4

    def setup(self, partition: qs.Partition) -> None:
        self.factor = 2

    def handle_batch(self, batch: qs.Batch) -> list[int]:
        return [self.factor * x for x in batch]


class Gated(qs.Serving):
    """A batch that signals it started and then waits for the test's go.

    The test passes ``CLI_APP_REDIS_URL`` and ``CLI_APP_PREFIX`` in the worker's environment
    (partition processes inherit it). A batch SETs ``{prefix}:started`` and blocks (up to
    GATE_TIMEOUT_S) on the list ``{prefix}:go``. Every SIGTERM the partition process receives is
    recorded in the list ``{prefix}:signals`` before the worker's own handler runs, so the test
    knows the partition is draining before it lets the batch finish.
    """

    name = "gated"
    batch_size = 8

    def setup(self, partition: qs.Partition) -> None:
        self.url = os.environ["CLI_APP_REDIS_URL"]
        self.prefix = os.environ["CLI_APP_PREFIX"]
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        url, key = self.url, f"{self.prefix}:signals"

        def record(signum: int, frame: FrameType | None) -> None:
            client = redis.Redis.from_url(url)
            try:
                client.rpush(key, f"{os.getpid()}:{signal.Signals(signum).name}")
                client.expire(key, 120)
            finally:
                client.close()
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, record)

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        client = redis.Redis.from_url(self.url)
        try:
            client.set(f"{self.prefix}:started", len(batch), ex=120)
        finally:
            client.close()
        wait_for_go(self.url, f"{self.prefix}:go")
        return [2 * x for x in batch]


not_a_serving = 42
empty_list: list[qs.Serving] = []
mixed_list = [square, "not a serving"]

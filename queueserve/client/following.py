"""Calls answered by another request's job: a keyed request whose key's first request was sent
before (client/once.py) takes that request's answer from its job record (wire/jobs.py), read
here until the job ends, by one thread (``Followers``) or task (``AsyncFollowers``) per client.

Such calls are rare (a retry, a race of two senders), so they are polled, from every 5 ms up
to every 250 ms while none ends; a call added starts the pause again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from queueserve.client.calls import Call
from queueserve.client.jobs import AsyncJob, Job
from queueserve.errors import QueueServeError, RedisUnavailable

log = logging.getLogger("queueserve.client")
_FIRST_S, _MOST_S = 0.005, 0.25


def take(call: Call, results: list[Any] | None) -> None:
    """Give ``call`` the results of the job it follows (errors as values); None: not yet."""
    if results is None:
        return
    if len(results) != call.n:
        call.fail(
            QueueServeError(
                f"job {call.follows} answered {len(results)} items and this call sent the same "
                f"{call.n} by its idempotency key's digest: the job's record was not written "
                "by queueserve for this key; forget the job, delete the key's record, and "
                "send again"
            )
        )
        return
    call.apply(0, results)
    call.finish()


def failed(call: Call, error: Exception) -> None:
    """A look at a followed job that failed: an outage is looked past (the next round looks
    again), an error of queueserve's is the call's, anything else a bug the call is told of."""
    if isinstance(error, RedisUnavailable):
        return
    if not isinstance(error, QueueServeError):
        log.error("following job %s failed unexpectedly", call.follows, exc_info=error)
        error = QueueServeError(f"following job {call.follows} failed: {error!r}")
    call.fail(error)


class Followers:
    """The sync client's followed calls and the thread that reads their jobs."""

    def __init__(self, job: Callable[[str], Job], name: str) -> None:
        self._job = job
        self._name = name
        self._calls: list[tuple[Call, Job]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, calls: list[Call]) -> None:
        jobs = [(call, self._job(call.follows or "")) for call in calls]
        with self._lock:
            self._calls += jobs
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        pause = _FIRST_S
        while not self._closed:
            with self._lock:
                self._calls = calls = [c for c in self._calls if c[0].state == "pending"]
            for call, job in calls:
                try:
                    take(call, job.ended())
                except Exception as e:
                    failed(call, e)
            if self._wake.wait(pause if calls else 1.0):
                self._wake.clear()
                pause = _FIRST_S
            else:
                pause = min(pause * 2, _MOST_S)

    def close(self, error: QueueServeError) -> None:
        """Stop following; the calls still waiting fail with ``error``."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            calls, self._calls = self._calls, []
        for call, _ in calls:
            call.fail(error)


class AsyncFollowers:
    """The asyncio client's followed calls and the task that reads their jobs."""

    def __init__(self, job: Callable[[str], AsyncJob]) -> None:
        self._job = job
        self._calls: list[tuple[Call, AsyncJob]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def add(self, calls: list[Call]) -> None:
        self._calls += [(call, self._job(call.follows or "")) for call in calls]
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(self._wake))
        self._wake.set()

    async def _run(self, wake: asyncio.Event) -> None:
        pause = _FIRST_S
        while True:
            self._calls = calls = [c for c in self._calls if c[0].state == "pending"]
            if not calls:
                return
            for call, job in calls:
                try:
                    take(call, await job.ended())
                except Exception as e:
                    failed(call, e)
            try:
                await asyncio.wait_for(wake.wait(), pause)
                wake.clear()
                pause = _FIRST_S
            except TimeoutError:
                pause = min(pause * 2, _MOST_S)

    async def aclose(self, error: QueueServeError) -> None:
        """Stop following; the calls still waiting fail with ``error``."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        calls, self._calls = self._calls, []
        for call, _ in calls:
            call.fail(error)

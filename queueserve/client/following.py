"""Calls answered by another request's job: a keyed request whose key's first request was sent
before (client/once.py) takes that request's answer from its job record (wire/job_record.py), read
here until the job ends, by one thread (``Followers``) or task (``AsyncFollowers``) per client.

Each round reads every followed job's record in one round trip, then the answers of those that
ended in one more; rounds come every 5 ms, then less often, down to every 250 ms while none
ends. A call added starts the pause again. A corpus sent again whole (every item a retry)
costs two round trips per round, not two per item.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

from queueserve.broker.job_store import AsyncJobs, Jobs, Read
from queueserve.client.calls import Call
from queueserve.client.job_handles import AsyncJob, Job
from queueserve.errors import QueueServeError, RedisUnavailable
from queueserve.wire.job_record import JobRecord

log = logging.getLogger("queueserve.client")
_FIRST_S, _MOST_S = 0.005, 0.25

Followed = tuple[Call, Job | AsyncJob]
Ended = tuple[Call, Job | AsyncJob, JobRecord | None]


def failed(call: Call, error: Exception) -> None:
    """A look at a followed job that failed: an outage is looked past (the next round looks
    again), an error of queueserve's is the call's, anything else a bug the call is told of."""
    if isinstance(error, RedisUnavailable):
        return
    if not isinstance(error, QueueServeError):
        log.error("following job %s failed unexpectedly", call.follows, exc_info=error)
        error = QueueServeError(f"following job {call.follows} failed: {error!r}")
    call.fail(error)


def ended_of(calls: Sequence[Followed], reads: Sequence[Read | QueueServeError]) -> list[Ended]:
    """The followed calls whose jobs ended (or have no record), by one read of each record."""
    ended: list[Ended] = []
    for (call, job), raw in zip(calls, reads, strict=True):
        try:
            if isinstance(raw, QueueServeError):
                raise raw
            done, record = job.ended(raw)
        except Exception as e:
            failed(call, e)
            continue
        if done:
            ended.append((call, job, record))
    return ended


def wanted(ended: Sequence[Ended]) -> list[tuple[str, Sequence[bytes]]]:
    """The answer messages to read for the ended jobs (``Jobs.messages_of``)."""
    return [(job.place[0], record.refs if record else ()) for _, job, record in ended]


def answer(
    ended: Sequence[Ended], messages: Sequence[list[bytes | None] | QueueServeError]
) -> None:
    """Give each call the results of the job it follows (errors as values)."""
    for (call, job, record), raw in zip(ended, messages, strict=True):
        try:
            if isinstance(raw, QueueServeError):
                raise raw
            results = job.results_of(record, raw)
            if len(results) != call.n:
                raise QueueServeError(
                    f"job {call.follows} answered {len(results)} items and this call sent the "
                    f"same {call.n} by its idempotency key's digest: the job's record was not "
                    "written by queueserve for this key; forget the job, delete the key's "
                    "record, and send again"
                )
        except Exception as e:
            failed(call, e)
            continue
        call.apply(0, results)
        call.finish()


class Followers:
    """The sync client's followed calls and the thread that reads their jobs."""

    def __init__(self, jobs: Jobs, job: Callable[[str], Job], name: str) -> None:
        self._jobs = jobs
        self._job = job
        self._name = name
        self._calls: list[Followed] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, calls: list[Call]) -> None:
        jobs: list[Followed] = [(call, self._job(call.follows or "")) for call in calls]
        with self._lock:  # a new list: the thread reads the one it took meanwhile
            self._calls = [*self._calls, *jobs]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        pause = _FIRST_S
        while not self._closed:
            with self._lock:
                self._calls = calls = [c for c in self._calls if c[0].state == "pending"]
            if calls:
                self._look(calls)
            if self._wake.wait(pause if calls else 1.0):
                self._wake.clear()
                pause = _FIRST_S
            else:
                pause = min(pause * 2, _MOST_S)

    def _look(self, calls: list[Followed]) -> None:
        try:
            ended = ended_of(calls, self._jobs.reads([job.place for _, job in calls]))
            if ended:
                answer(ended, self._jobs.messages_of(wanted(ended)))
        except RedisUnavailable:
            pass  # the next round looks again
        except Exception as e:  # never the thread's end: its calls are told
            for call, _ in calls:
                failed(call, e)

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

    def __init__(self, jobs: AsyncJobs, job: Callable[[str], AsyncJob]) -> None:
        self._jobs = jobs
        self._job = job
        self._calls: list[Followed] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def add(self, calls: list[Call]) -> None:
        # a new list: the task may be reading the one it took
        self._calls = [*self._calls, *((call, self._job(call.follows or "")) for call in calls)]
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
            await self._look(calls)
            try:
                await asyncio.wait_for(wake.wait(), pause)
                wake.clear()
                pause = _FIRST_S
            except TimeoutError:
                pause = min(pause * 2, _MOST_S)

    async def _look(self, calls: list[Followed]) -> None:
        try:
            ended = ended_of(calls, await self._jobs.reads([job.place for _, job in calls]))
            if ended:
                answer(ended, await self._jobs.messages_of(wanted(ended)))
        except RedisUnavailable:
            pass
        except Exception as e:
            for call, _ in calls:
                failed(call, e)

    async def aclose(self, error: QueueServeError) -> None:
        """Stop following; the calls still waiting fail with ``error``."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        calls, self._calls = self._calls, []
        for call, _ in calls:
            call.fail(error)

"""Job records (wire/jobs.py) as clients touch them: create after enqueue, read, cancel,
forget; ``Jobs`` for the sync client, ``AsyncJobs`` for asyncio. The worker's write is
job.lua, in its reply-and-ack round trip (broker/replies.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.exceptions import NoScriptError, ResponseError

from queueserve.broker.common import load_script
from queueserve.broker.errors import redis_errors
from queueserve.wire.jobs import LIVE_TTL_MS, MAX_KEEP_MS
from queueserve.wire.protocol import GROUP

_NEW = load_script("job_new.lua")
_CANCEL = load_script("job_cancel.lua")


class NewJob(NamedTuple):
    """A job just enqueued: its record's key and what job_new.lua writes there."""

    key: str
    n: int
    keep_ms: int
    serving: str
    stream: str
    entry_id: bytes


def _new_args(job: NewJob) -> tuple[Any, ...]:
    return (
        job.key,
        job.n,
        job.keep_ms,
        job.serving,
        job.stream,
        job.entry_id,
        LIVE_TTL_MS,
    )


def _failures(out: Sequence[Any]) -> list[Exception]:
    return [r for r in out if isinstance(r, Exception)]


class Jobs:
    """Job records through one sync Redis client."""

    def __init__(self, client: Any, url: str) -> None:
        self.redis, self.url = client, url
        self._new = client.register_script(_NEW)
        self._cancel = client.register_script(_CANCEL)

    def created(self, jobs: Sequence[NewJob]) -> None:
        """Record ``jobs`` (one round trip; the script loaded first on a server without it)."""
        with redis_errors(self.url):
            for _ in range(2):
                pipe = self.redis.pipeline(transaction=False)
                for job in jobs:
                    pipe.execute_command("EVALSHA", self._new.sha, 1, *_new_args(job))
                failures = _failures(pipe.execute(raise_on_error=False))
                if not any(isinstance(f, NoScriptError) for f in failures):
                    break
                self.redis.script_load(_NEW)
            if failures:
                raise failures[0]

    def record(self, key: str) -> dict[bytes, bytes]:
        with redis_errors(self.url):
            return dict(self.redis.hgetall(key))

    def running(self, stream: str, entry_id: bytes) -> bool:
        """Whether a worker holds entry ``entry_id`` of ``stream`` (read, not yet acked)."""
        with redis_errors(self.url):
            try:
                return bool(self.redis.xpending_range(stream, GROUP, entry_id, entry_id, 1))
            except ResponseError:  # no stream or no group yet: nobody holds it
                return False

    def cancel(self, key: str, default_keep_ms: int) -> int:
        """job_cancel.lua: 1 cancelled now, 0 it had ended, -1 no record."""
        with redis_errors(self.url):
            return int(self._cancel(keys=[key], args=[default_keep_ms, MAX_KEEP_MS]))

    def forget(self, key: str) -> bool:
        with redis_errors(self.url):
            return bool(self.redis.delete(key))


class AsyncJobs:
    """``Jobs`` for asyncio."""

    def __init__(self, client: Any, url: str) -> None:
        self.redis, self.url = client, url
        self._new = client.register_script(_NEW)
        self._cancel = client.register_script(_CANCEL)

    async def created(self, jobs: Sequence[NewJob]) -> None:
        with redis_errors(self.url):
            for _ in range(2):
                pipe = self.redis.pipeline(transaction=False)
                for job in jobs:
                    pipe.execute_command("EVALSHA", self._new.sha, 1, *_new_args(job))
                failures = _failures(await pipe.execute(raise_on_error=False))
                if not any(isinstance(f, NoScriptError) for f in failures):
                    break
                await self.redis.script_load(_NEW)
            if failures:
                raise failures[0]

    async def record(self, key: str) -> dict[bytes, bytes]:
        with redis_errors(self.url):
            return dict(await self.redis.hgetall(key))

    async def running(self, stream: str, entry_id: bytes) -> bool:
        with redis_errors(self.url):
            try:
                found = await self.redis.xpending_range(stream, GROUP, entry_id, entry_id, 1)
            except ResponseError:  # no stream or no group yet: nobody holds it
                return False
            return bool(found)

    async def cancel(self, key: str, default_keep_ms: int) -> int:
        with redis_errors(self.url):
            return int(await self._cancel(keys=[key], args=[default_keep_ms, MAX_KEEP_MS]))

    async def forget(self, key: str) -> bool:
        with redis_errors(self.url):
            return bool(await self.redis.delete(key))

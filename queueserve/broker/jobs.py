"""Job records (wire/jobs.py) as clients touch them: create, read, cancel, forget; ``Jobs``
for the sync client, ``AsyncJobs`` for asyncio. enqueue.lua writes the records of the jobs it
admits; on a Redis Cluster, where they live in other slots than the streams, the producer
writes them around the enqueue instead (``created`` before it, ``placed`` after). The
worker's write is job.lua, in its reply-and-ack round trip (broker/replies.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.exceptions import NoScriptError, ResponseError

from queueserve.broker.common import Enqueued, Request, load_script
from queueserve.broker.connect import is_cluster
from queueserve.broker.errors import redis_errors
from queueserve.wire.jobs import LIVE_TTL_MS, MAX_KEEP_MS
from queueserve.wire.protocol import GROUP, Keys

_NEW = load_script("job_new.lua")
_PLACED = load_script("job_placed.lua")
_CANCEL = load_script("job_cancel.lua")


class NewJob(NamedTuple):
    """A job about to be enqueued: its record's key and what is written there first."""

    key: str
    n: int
    keep_ms: int
    serving: str


Placed = tuple[str, str, bytes | None]  # record key, stream, entry id (None: refused)
JobAt = tuple[int, str, int]  # a job among an enqueue's requests: its index, record key, keep ms


def new_jobs(keys: Keys, requests: Sequence[Request], jobs: Sequence[JobAt]) -> list[NewJob]:
    """The records of ``jobs`` to write before their requests are enqueued (on a cluster)."""
    return [NewJob(key, requests[i][1], keep_ms, keys.name) for i, key, keep_ms in jobs]


def placed_jobs(
    keys: Keys, requests: Sequence[Request], jobs: Sequence[JobAt], reply: Enqueued
) -> list[Placed]:
    """Where ``jobs`` wait once enqueued (no entry: refused, its record goes)."""
    placed = []
    for i, key, _ in jobs:
        entry = reply[2][i]
        stream = keys.stream(requests[i][0], requests[i][4])
        placed.append((key, stream, entry if isinstance(entry, bytes) else None))
    return placed


def _new_commands(sha: str, jobs: Sequence[NewJob]) -> list[tuple[Any, ...]]:
    """One script call per record: on a cluster each is in its own slot."""
    return [
        ("EVALSHA", sha, 1, job.key, LIVE_TTL_MS, job.n, job.keep_ms, job.serving) for job in jobs
    ]


def _placed_commands(sha: str, placed: Sequence[Placed]) -> list[tuple[Any, ...]]:
    return [("EVALSHA", sha, 1, key, stream, entry or b"") for key, stream, entry in placed]


def _failures(out: Sequence[Any]) -> list[Exception]:
    return [r for r in out if isinstance(r, Exception)]


class Jobs:
    """Job records through one sync Redis client (``created`` and ``placed`` on a Redis
    Cluster only: elsewhere enqueue.lua writes a job's record with its entry)."""

    def __init__(self, client: Any, url: str) -> None:
        self.redis, self.url = client, url
        self._new = client.register_script(_NEW)
        self._placed = client.register_script(_PLACED)
        self._cancel = client.register_script(_CANCEL)
        self.cluster = is_cluster(client)

    def created(self, jobs: Sequence[NewJob]) -> None:
        """Write the records of ``jobs`` about to be enqueued (one round trip)."""
        self._scripted(_NEW, _new_commands(self._new.sha, jobs))

    def placed(self, placed: Sequence[Placed]) -> None:
        """Where enqueued jobs wait; the records of refused ones go (one round trip)."""
        self._scripted(_PLACED, _placed_commands(self._placed.sha, placed))

    def _scripted(self, script: str, commands: list[tuple[Any, ...]]) -> None:
        """Send script calls; on a server without the script, load it and send them again."""
        with redis_errors(self.url):
            failures = _failures(self._send(commands))
            if any(isinstance(f, NoScriptError) for f in failures):
                self.redis.script_load(script)  # on a cluster: on every master
                failures = _failures(self._send(commands))
            if failures:
                raise failures[0]

    def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))

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
        self._placed = client.register_script(_PLACED)
        self._cancel = client.register_script(_CANCEL)
        self.cluster = is_cluster(client)

    async def created(self, jobs: Sequence[NewJob]) -> None:
        await self._scripted(_NEW, _new_commands(self._new.sha, jobs))

    async def placed(self, placed: Sequence[Placed]) -> None:
        await self._scripted(_PLACED, _placed_commands(self._placed.sha, placed))

    async def _scripted(self, script: str, commands: list[tuple[Any, ...]]) -> None:
        with redis_errors(self.url):
            failures = _failures(await self._send(commands))
            if any(isinstance(f, NoScriptError) for f in failures):
                await self.redis.script_load(script)
                failures = _failures(await self._send(commands))
            if failures:
                raise failures[0]

    async def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

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

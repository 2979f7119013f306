"""Job records (wire/job_record.py) as clients touch them: create, read, cancel, forget; ``Jobs``
for the sync client, ``AsyncJobs`` for asyncio. enqueue.lua writes the records of the jobs it
admits; on a Redis Cluster, where their groups live in other slots than the streams, the
producer writes them around the enqueue instead (``created`` before it, ``placed`` after).
The worker's write is job.lua, in its reply-and-ack round trip (broker/replies.py).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError, ResponseError

from queueserve.broker.common import Enqueued, Request, load_script
from queueserve.broker.connect import is_cluster
from queueserve.broker.redis_errors import redis_errors, translate
from queueserve.errors import QueueServeError
from queueserve.wire.job_record import LIVE_TTL_MS, MAX_KEEP_MS
from queueserve.wire.keys import GROUP, Keys

log = logging.getLogger(__name__)

ID_KEY_BYTES = 32  # AsyncJobs.secret: an HMAC-SHA256 key's worth
_NEW = load_script("job_new.lua")
_PLACED = load_script("job_placed.lua")
_END = load_script("job_end.lua")

# A job among an enqueue's requests: its index, its record group's key, its request id (a
# string: a field name) and keep (ms)
JobAt = tuple[int, str, str, int]


def _by_group(jobs: Sequence[JobAt]) -> dict[str, list[JobAt]]:
    groups: dict[str, list[JobAt]] = {}
    for job in jobs:
        groups.setdefault(job[1], []).append(job)
    return groups


def new_jobs(
    sha: str, keys: Keys, requests: Sequence[Request], jobs: Sequence[JobAt], again: bool
) -> list[tuple[Any, ...]]:
    """job_new.lua calls writing ``jobs``' fields before their enqueue (on a cluster: one
    per group, each its own slot); ``again``: the send was tried before."""
    commands: list[tuple[Any, ...]] = []
    for key, group in _by_group(jobs).items():
        args: list[Any] = []
        for i, _, rid, keep_ms in group:
            args += (rid, f"{requests[i][1]}:{keep_ms}:{keys.name}::")
        commands.append(("EVALSHA", sha, 1, key, LIVE_TTL_MS, int(again), *args))
    return commands


def placed_jobs(
    sha: str,
    keys: Keys,
    requests: Sequence[Request],
    jobs: Sequence[JobAt],
    reply: Enqueued,
    made: set[str],
) -> list[tuple[Any, ...]]:
    """job_placed.lua calls saying where ``jobs`` wait once enqueued. A refused one's field
    goes only if this send ``made`` it: a field an earlier try of the send made may name an
    entry that try enqueued."""
    commands: list[tuple[Any, ...]] = []
    for key, group in _by_group(jobs).items():
        args: list[Any] = []
        for i, _, rid, _ in group:
            entry = reply[2][i]
            # (an entry id; a keyed request answered from its key's record is not enqueued)
            if isinstance(entry, bytes) and entry[:1].isdigit():
                args += (rid, keys.stream(requests[i][0], requests[i][4]), entry)
            elif rid in made:
                args += (rid, "", b"")
        if args:
            commands.append(("EVALSHA", sha, 1, key, *args))
    return commands


def _made(out: list[Any]) -> set[str]:
    """The request ids job_new.lua calls say they made fields for."""
    return {rid.decode() if isinstance(rid, bytes) else str(rid) for made in out for rid in made}


def _failures(out: Sequence[Any]) -> list[Exception]:
    return [r for r in out if isinstance(r, Exception)]


def _read_commands(key: str, fields: Sequence[str]) -> list[tuple[Any, ...]]:
    return [("HMGET", key, *fields), ("TIME",)]


def _read(out: list[Any]) -> tuple[list[bytes | None], int]:
    for failure in _failures(out):
        raise failure  # (a key of another type: WRONGTYPE)
    values, (seconds, micros) = out
    return list(values), int(seconds) * 1000 + int(micros) // 1000


# Where a job's record is: its group's key and its fields (``wire/job_record.py``'s record_fields)
Place = tuple[str, Sequence[str]]
Read = tuple[list[bytes | None], int]


def _reads_commands(places: Sequence[Place]) -> list[tuple[Any, ...]]:
    return [*(("HMGET", key, *fields) for key, fields in places), ("TIME",)]


def _reads(out: list[Any], url: str) -> list[Read | QueueServeError]:
    """Each job's fields and Redis's clock; a group Redis refused (another type) its error."""
    *values, clock = out
    if isinstance(clock, Exception):
        raise clock
    now = int(clock[0]) * 1000 + int(clock[1]) // 1000
    return [
        translate(v, url) if isinstance(v, redis.RedisError) else (list(v), now) for v in values
    ]


def _messages_commands(wanted: Sequence[tuple[str, Sequence[bytes]]]) -> list[tuple[Any, ...]]:
    return [("HMGET", key, *(b"m" + ref for ref in refs)) for key, refs in wanted if refs]


def _messages(
    wanted: Sequence[tuple[str, Sequence[bytes]]], out: list[Any], url: str
) -> list[list[bytes | None] | QueueServeError]:
    replies = iter(out)
    found: list[list[bytes | None] | QueueServeError] = []
    for _, refs in wanted:
        reply = next(replies) if refs else []
        found.append(translate(reply, url) if isinstance(reply, redis.RedisError) else list(reply))
    return found


class _JobScripts:
    """The job scripts, registered on one Redis client (sync or asyncio)."""

    def __init__(self, client: Any, url: str) -> None:
        self.redis, self.url = client, url
        self._new = client.register_script(_NEW)
        self._placed = client.register_script(_PLACED)
        self._end = client.register_script(_END)
        self.cluster = is_cluster(client)


class Jobs(_JobScripts):
    """Job records through one sync Redis client (``created`` and ``placed`` on a Redis
    Cluster only: elsewhere enqueue.lua writes a job's record with its entry)."""

    def created(
        self, keys: Keys, requests: Sequence[Request], jobs: Sequence[JobAt], again: bool
    ) -> set[str]:
        """Write the records of ``jobs`` about to be enqueued (one round trip); the request
        ids whose fields this made."""
        return _made(self._scripted(_NEW, new_jobs(self._new.sha, keys, requests, jobs, again)))

    def placed(
        self,
        keys: Keys,
        requests: Sequence[Request],
        jobs: Sequence[JobAt],
        reply: Enqueued,
        made: set[str],
    ) -> None:
        """Where enqueued jobs wait; the records of refused ones go (one round trip)."""
        self._scripted(_PLACED, placed_jobs(self._placed.sha, keys, requests, jobs, reply, made))

    def _scripted(self, script: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send script calls; on a server without the script, load it and send them again."""
        with redis_errors(self.url):
            out = self._send(commands)
            if any(isinstance(f, NoScriptError) for f in _failures(out)):
                self.redis.script_load(script)  # on a cluster: on every master
                out = self._send(commands)
            for failure in _failures(out):
                raise failure
            return out

    def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))

    def record(self, key: str, fields: Sequence[str]) -> tuple[list[bytes | None], int]:
        """``fields`` of group ``key``, and Redis's clock (unix ms)."""
        with redis_errors(self.url):
            return _read(self._send(_read_commands(key, fields)))

    def messages(self, key: str, refs: Sequence[bytes]) -> list[bytes | None]:
        with redis_errors(self.url):
            return list(self.redis.hmget(key, [b"m" + ref for ref in refs])) if refs else []

    def reads(self, places: Sequence[Place]) -> list[Read | QueueServeError]:
        """``record`` of many jobs in one round trip (the calls a client follows)."""
        with redis_errors(self.url):
            return _reads(self._send(_reads_commands(places)), self.url)

    def messages_of(
        self, wanted: Sequence[tuple[str, Sequence[bytes]]]
    ) -> list[list[bytes | None] | QueueServeError]:
        """``messages`` of many jobs in one round trip."""
        with redis_errors(self.url):
            return _messages(wanted, self._send(_messages_commands(wanted)), self.url)

    def running(self, stream: str, entry_id: bytes) -> bool:
        """Whether a worker holds entry ``entry_id`` of ``stream`` (read, not yet acked)."""
        with redis_errors(self.url):
            try:
                return bool(self.redis.xpending_range(stream, GROUP, entry_id, entry_id, 1))
            except ResponseError:  # no stream or no group yet: nobody holds it
                return False

    def cancel(self, key: str, rid: str, default_keep_ms: int) -> int:
        """job_end.lua: 1 cancelled now, 0 it had ended, -1 no record."""
        with redis_errors(self.url):
            return int(self._end(keys=[key], args=["cancel", rid, default_keep_ms, MAX_KEEP_MS]))

    def forget(self, key: str, rid: str) -> bool:
        with redis_errors(self.url):
            return bool(self._end(keys=[key], args=["forget", rid, 0, MAX_KEEP_MS]))


class AsyncJobs(_JobScripts):
    """``Jobs`` for asyncio."""

    async def created(
        self, keys: Keys, requests: Sequence[Request], jobs: Sequence[JobAt], again: bool
    ) -> set[str]:
        commands = new_jobs(self._new.sha, keys, requests, jobs, again)
        return _made(await self._scripted(_NEW, commands))

    async def placed(
        self,
        keys: Keys,
        requests: Sequence[Request],
        jobs: Sequence[JobAt],
        reply: Enqueued,
        made: set[str],
    ) -> None:
        commands = placed_jobs(self._placed.sha, keys, requests, jobs, reply, made)
        await self._scripted(_PLACED, commands)

    async def _scripted(self, script: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        with redis_errors(self.url):
            out = await self._send(commands)
            if any(isinstance(f, NoScriptError) for f in _failures(out)):
                await self.redis.script_load(script)
                out = await self._send(commands)
            for failure in _failures(out):
                raise failure
            return out

    async def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

    async def record(self, key: str, fields: Sequence[str]) -> tuple[list[bytes | None], int]:
        with redis_errors(self.url):
            return _read(await self._send(_read_commands(key, fields)))

    async def messages(self, key: str, refs: Sequence[bytes]) -> list[bytes | None]:
        if not refs:
            return []
        with redis_errors(self.url):
            return list(await self.redis.hmget(key, [b"m" + ref for ref in refs]))

    async def reads(self, places: Sequence[Place]) -> list[Read | QueueServeError]:
        with redis_errors(self.url):
            return _reads(await self._send(_reads_commands(places)), self.url)

    async def messages_of(
        self, wanted: Sequence[tuple[str, Sequence[bytes]]]
    ) -> list[list[bytes | None] | QueueServeError]:
        with redis_errors(self.url):
            return _messages(wanted, await self._send(_messages_commands(wanted)), self.url)

    async def running(self, stream: str, entry_id: bytes) -> bool:
        with redis_errors(self.url):
            try:
                found = await self.redis.xpending_range(stream, GROUP, entry_id, entry_id, 1)
            except ResponseError:  # no stream or no group yet: nobody holds it
                return False
            return bool(found)

    async def cancel(self, key: str, rid: str, default_keep_ms: int) -> int:
        with redis_errors(self.url):
            args = ["cancel", rid, default_keep_ms, MAX_KEEP_MS]
            return int(await self._end(keys=[key], args=args))

    async def forget(self, key: str, rid: str) -> bool:
        with redis_errors(self.url):
            return bool(await self._end(keys=[key], args=["forget", rid, 0, MAX_KEEP_MS]))

    async def secret(self, key: str) -> bytes:
        """The ``ID_KEY_BYTES`` random bytes at ``key``, made by whichever process asks first
        (SET NX GET: one command, no race). A value that is not such bytes (anyone may write
        the key) is replaced with fresh ones: the ids made with it stop being recognized."""
        fresh = secrets.token_bytes(ID_KEY_BYTES)
        with redis_errors(self.url):
            try:
                held = await self.redis.set(key, fresh, nx=True, get=True)
            except ResponseError:  # a key of another type
                held = b""
            if held is None:
                return fresh
            if len(held) == ID_KEY_BYTES:
                return bytes(held)
            log.warning(
                "%s holds no job-id key (%d bytes): replaced with a new one", key, len(held)
            )
            await self.redis.set(key, fresh)
            return fresh

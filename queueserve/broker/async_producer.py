"""The asyncio producer side: the operations ``qs.AsyncClient`` needs, over ``redis.asyncio``.

The commands, script arguments and reply parsing are the sync producer's (``broker.common``);
every redis-py error is mapped by the same ``redis_errors`` as there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio import connection as aioconnection
from redis.commands.core import AsyncScript

from queueserve.broker.common import (
    CacheAt,
    Enqueued,
    OnceAt,
    Request,
    Together,
    add_listing,
    cancel_arguments,
    durable_replies,
    enqueue_and_wait_commands,
    enqueue_arguments,
    enqueued,
    inbox_command,
    inbox_messages,
    listing,
    load_script,
    not_replicated_message,
    pack_fast,
    pubsub_data,
    since_ms,
    texts,
)
from queueserve.broker.connect import aclose, connect_async, is_cluster
from queueserve.broker.job_store import AsyncJobs, JobAt
from queueserve.broker.redis_errors import error_code, raise_but_wrong_type, redis_errors
from queueserve.broker.retry import Outage
from queueserve.broker.tenants import AsyncTenants
from queueserve.broker.urls import redact_url
from queueserve.errors import NotReplicated, QueueServeError, RedisUnavailable
from queueserve.wire.keys import Keys


class _HiredisPacking:
    """redis.asyncio packs every command in Python; these connections go through hiredis,
    as the sync ones do (``HiredisPacker``)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return pack_fast(args) or super().pack_command(*args)  # type: ignore[misc]


class _Connection(_HiredisPacking, aioconnection.Connection):
    pass


class _SSLConnection(_HiredisPacking, aioconnection.SSLConnection):
    pass


class _UnixConnection(_HiredisPacking, aioconnection.UnixDomainSocketConnection):
    pass


_HIREDIS_CLASSES: dict[type[Any], type[Any]] = {
    aioconnection.Connection: _Connection,
    aioconnection.SSLConnection: _SSLConnection,
    aioconnection.UnixDomainSocketConnection: _UnixConnection,
}


def hiredis_packing(client: Any) -> Any:
    """``client`` with connections that pack commands with hiredis (a single node's; a cluster
    or Sentinel client keeps redis-py's own connections)."""
    if isinstance(client, aioredis.Redis):
        pool = client.connection_pool
        pool.connection_class = _HIREDIS_CLASSES.get(pool.connection_class, pool.connection_class)
    return client


async def _response(connection: Any) -> Any:
    """The next reply on ``connection``, an error reply as a value (as a pipeline gives it)."""
    try:
        return await connection.read_response()
    except redis.ResponseError as e:
        return e


class AsyncSubscription:
    """One pub/sub channel, read with ``await get``; resubscribes after a reconnect, on a new
    pub/sub connection after a failure (a cluster's stays bound to a node that may be gone)."""

    def __init__(
        self, client: aioredis.Redis | aioredis.RedisCluster, url: str, channel: str
    ) -> None:
        self.url = url
        self.channel = channel
        self.confirmed = False
        self._client = client
        self._pubsub: Any = None

    async def get(self, timeout: float) -> bytes | None:
        try:
            with redis_errors(self.url):
                if self._pubsub is None:
                    self._pubsub = self._client.pubsub(ignore_subscribe_messages=False)
                if not self._pubsub.subscribed:
                    await self._pubsub.subscribe(self.channel)
                message = await self._pubsub.get_message(timeout=timeout)
        except RedisUnavailable:
            await self.aclose()
            raise
        confirmation, data = pubsub_data(message)
        self.confirmed = self.confirmed or confirmation
        return data

    async def aclose(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                await pubsub.aclose()


class AsyncProducer:
    """``Producer``'s stream operations (broker/producer.py), for asyncio."""

    def __init__(self, url: str, *, owner: str | None = None) -> None:
        self.url = url
        self.redis: Any = hiredis_packing(connect_async(url))
        self.outage = Outage(owner or f"Redis at {redact_url(url)}")
        self._enqueue: AsyncScript = self.redis.register_script(load_script("enqueue.lua"))
        self._cancel: AsyncScript = self.redis.register_script(load_script("cancel.lua"))
        self._loaded = False  # enqueue.lua loaded (on every primary of a cluster), for durable
        self.jobs = AsyncJobs(self.redis, url)
        self.tenants = AsyncTenants(self.redis, url)

    async def aclose(self) -> None:
        await aclose(self.redis)

    async def enqueue(
        self,
        keys: Keys,
        requests: Sequence[Request],
        max_queue: int,
        *,
        durable: bool = False,
        jobs: Sequence[JobAt] = (),
        together: Sequence[Together] = (),
        again: bool = False,
        onces: Sequence[OnceAt] = (),
        caches: Sequence[CacheAt] = (),
    ) -> Enqueued:
        """``Producer.enqueue``: admit requests atomically, or reject them for max_queue;
        ``durable`` waits for a replica to hold them; ``jobs`` get their records; each run
        of ``together`` is admitted whole or refused whole."""
        if jobs and self.jobs.cluster:
            made = await self.jobs.created(keys, requests, jobs, again)
            reply = await self._enqueue_call(
                keys, requests, max_queue, durable, (), together, again, onces, caches
            )
            # Not retried with the enqueue (see Producer.enqueue)
            with contextlib.suppress(QueueServeError):
                await self.jobs.placed(keys, requests, jobs, reply, made)
            return reply
        return await self._enqueue_call(
            keys, requests, max_queue, durable, jobs, together, again, onces, caches
        )

    async def _enqueue_call(
        self,
        keys: Keys,
        requests: Sequence[Request],
        max_queue: int,
        durable: bool,
        jobs: Sequence[JobAt],
        together: Sequence[Together],
        again: bool = False,
        onces: Sequence[OnceAt] = (),
        caches: Sequence[CacheAt] = (),
    ) -> Enqueued:
        script_keys, args = enqueue_arguments(
            keys, requests, max_queue, jobs, together, again, onces, caches
        )
        with redis_errors(self.url):
            if not durable:
                return enqueued(await self._enqueue(keys=script_keys, args=args))
            reply, replicas = await self._enqueue_and_wait(script_keys, args)
        if replicas < 1:
            raise NotReplicated(not_replicated_message(keys, self.url))
        return enqueued(reply)

    async def _enqueue_and_wait(self, script_keys: list[str], args: list[Any]) -> tuple[Any, int]:
        """``enqueue_and_wait_commands`` on one connection: a pipeline, or on a cluster a
        connection of the shard's master."""
        if not self._loaded:  # first: after a NOSCRIPT the WAIT would still wait its full time
            await self.redis.script_load(self._enqueue.script)
            self._loaded = True
        commands = enqueue_and_wait_commands(self._enqueue.sha, script_keys, args)
        for first_try in (True, False):
            async with self._routed(script_keys[0]):
                out = durable_replies(await self._send(script_keys[0], commands), first_try)
            if out is not None:
                return out
            await self.redis.script_load(self._enqueue.script)
        raise AssertionError("unreachable: the second try returns or raises")

    async def _send(self, key: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Replies of ``commands`` sent on one connection to ``key``'s node, errors as values."""
        if not is_cluster(self.redis):
            pipe = self.redis.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(await pipe.execute(raise_on_error=False))
        node = self.redis.get_node_from_key(key)
        connection = node.acquire_connection()
        try:
            await connection.send_packed_command(connection.pack_commands(commands))
            return [await _response(connection) for _ in commands]
        except BaseException:
            await connection.disconnect()  # a reply may be left unread on it
            raise
        finally:
            node.release(connection)

    @contextlib.asynccontextmanager
    async def _routed(self, key: str) -> AsyncIterator[None]:
        """Around commands sent to ``key``'s node by name: a MOVED (as a ConnectionError, so
        the retry sends it again, to the new master), or a node that cannot be reached,
        reloads the slot map before the error goes on."""
        try:
            yield
        except redis.ResponseError as e:
            if error_code(e) not in ("MOVED", "ASK"):
                raise
            await self._refresh_slots()
            raise redis.ConnectionError(f"the slot of {key} moved: {e}") from None
        except redis.ConnectionError:
            await self._refresh_slots()
            raise

    async def _refresh_slots(self) -> None:
        if is_cluster(self.redis):
            with contextlib.suppress(redis.RedisError):
                await self.redis.nodes_manager.initialize()

    async def cancel(
        self, keys: Keys, stream: str, entry_id: bytes, n: int, rid: int, inbox: str
    ) -> bool:
        script_keys, args = cancel_arguments(keys, stream, entry_id, n, rid, inbox)
        with redis_errors(self.url):
            return bool(await self._cancel(keys=script_keys, args=args))

    async def read_inbox(self, inbox: str, timeout: float) -> list[bytes]:
        """Replies waiting in ``inbox`` (BLMPOP). On a cluster, sent to the inbox's node by
        name: redis-py would otherwise ask its default node COMMAND GETKEYS first, each time
        (one more round trip, and the same master's CPU for every client)."""
        command = inbox_command(inbox, timeout)
        with redis_errors(self.url):
            if not is_cluster(self.redis):
                return inbox_messages(await self.redis.execute_command(*command))
            async with self._routed(inbox):
                reply = await self.redis.execute_command(
                    *command, target_nodes=self.redis.get_node_from_key(inbox)
                )
            return inbox_messages(reply)

    def subscribe(self, channel: str) -> AsyncSubscription:
        return AsyncSubscription(self.redis, self.url, channel)

    async def ping(self) -> None:
        """One PING; RedisUnavailable when Redis does not answer (the gateway's /readyz)."""
        with redis_errors(self.url):
            await self.redis.ping()

    async def alive_workers(self, keys: Keys, within: float) -> int:
        with redis_errors(self.url):
            return int(await self.redis.zcount(keys.workers, since_ms(within), "+inf"))

    async def servings(self, prefix: str) -> list[str]:
        """``Producer.servings``: the registry P:servings, never a SCAN."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            add_listing(pipe, prefix, int(time.time() * 1000))
            found = raise_but_wrong_type(await pipe.execute(raise_on_error=False))
        return sorted(listing(found)[0])

    async def meta(self, keys: Keys) -> dict[str, str]:
        """As BrokerCore.meta: a key that is not a hash reads as no declaration."""
        with redis_errors(self.url):
            try:
                return texts(await self.redis.hgetall(keys.meta), "replace")
            except redis.ResponseError as e:
                if error_code(e) != "WRONGTYPE":
                    raise
                return {}

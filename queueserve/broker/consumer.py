"""The consumer side: what a worker does with Redis. Reads (broker/reads.py) and replies
(broker/replies.py) are its hot path, and dead letters (broker/dead_letters.py) its refusals,
each a part ``Consumer`` holds; here the rest: claims, pack splits, the heartbeat and the
serving's declaration.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import redis

from queueserve.broker.channels import SharedSubscriptions
from queueserve.broker.common import (
    consumer_name,
    register_servings,
    text,
    texts,
)
from queueserve.broker.connect import is_cluster
from queueserve.broker.core import BrokerCore, Subscription, no_group
from queueserve.broker.dead_letters import DeadLetters
from queueserve.broker.reads import Reads
from queueserve.broker.redis_errors import error_code, raise_but_wrong_type, redis_errors
from queueserve.broker.replies import Replies
from queueserve.wire.keys import GROUP, Keys, worker_key
from queueserve.wire.priority import PRIORITY_AGE_MS
from queueserve.wire.protocol import MAX_PACK_REQUESTS


class Consumer(BrokerCore):
    """The stream operations of a worker: claims, declarations and heartbeats here; its reads
    (``reads``), replies (``replies``) and dead letters (``letters``) are parts it holds,
    over its connection."""

    # The shared pub/sub connection and the wake watch's (size_pool).
    OWN_CONNECTIONS = 2

    def __init__(
        self, url: str, *, client: redis.Redis | None = None, owner: str | None = None
    ) -> None:
        super().__init__(url, client=client, owner=owner)
        self._channels = SharedSubscriptions(self.redis, url)
        self.reads = reads = Reads(self)
        self.replies = Replies(self, reads)
        self.letters = letters = DeadLetters(self)
        # What the worker calls of the parts, bound once (no call layer on its hot path)
        self.ensure_group, self.adopt_legacy_keys = reads.ensure_group, reads.adopt_legacy_keys
        self.read_ready, self.wait_then_read = reads.read_ready, reads.wait_then_read
        self.sweep, self.active_streams = reads.sweep, reads.active_streams
        self.pending_by_stream = reads.pending_by_stream
        self.reply_and_ack = self.replies.reply_and_ack
        self.dead_letter, self.write_dead_letters = letters.dead_letter, letters.write_dead_letters

    def close(self) -> None:
        self.reads.close()
        super().close()

    def subscribe(self, *channels: str) -> Subscription:
        """A subscription on the one pub/sub connection every subscription of this broker
        shares (broker/channels.py): a partition's cancel listeners, one per serving."""
        return self._channels.listener(*channels)

    def claim(
        self,
        stream: str,
        owner: str,
        claimer: str,
        min_idle_ms: int,
        count: int,
        skip: AbstractSet[bytes] = frozenset(),
    ) -> list[tuple[bytes, dict[bytes, bytes], int]]:
        """Move up to ``count`` of ``owner``'s entries idle for ``min_idle_ms`` to ``claimer``
        (``skip``: ids to leave), in one script (claim.lua), so an entry another consumer took
        from ``owner`` meanwhile is never taken from it.

        Returns (entry id, fields, times delivered so far). The claim does not count as a
        delivery (JUSTID): only running a redelivered entry does (``count_delivery``), so
        requests that merely sat beside a crasher are not blamed for its crashes. Entries
        deleted meanwhile (cancelled) leave the pending list without being returned. Two
        claimers racing never both get an entry: the claim resets its idle time.
        """
        with redis_errors(self.url):
            try:
                found = self._claim(
                    keys=[stream],
                    args=[GROUP, consumer_name(owner), claimer, min_idle_ms, count, *skip],
                )
            except redis.ResponseError as e:
                if not no_group(e):
                    raise
                return []  # the group went with Redis's data: nobody holds anything
        return [
            (entry_id, dict(zip(fields[::2], fields[1::2], strict=True)), int(delivered))
            for entry_id, fields, delivered in found
        ]

    def split_pack(self, keys: Keys, stream: str, entry_id: bytes) -> int:
        """Replace a pack this consumer holds by one new entry per request (split.lua).

        Returns how many entries it wrote: 0 when the entry is gone or is not a pack, -1 when
        its packed requests are malformed or more than MAX_PACK_REQUESTS (the caller
        dead-letters the entry)."""
        shard = keys.shard_of(stream)
        batch_key, priority = shard.parse_stream(stream)
        score = int(time.time() * 1000) - priority * PRIORITY_AGE_MS
        with redis_errors(self.url):
            return int(
                self._split(
                    keys=[stream, shard.ready, shard.wake],
                    args=[GROUP, entry_id, f"{priority}{batch_key}", score, MAX_PACK_REQUESTS],
                )
            )

    def count_delivery(self, stream: str, consumer: str, entry_id: bytes) -> None:
        """Count one more delivery of an entry this consumer is about to run."""
        with redis_errors(self.url):
            try:
                self.redis.xclaim(stream, GROUP, consumer, 0, [entry_id])
            except redis.ResponseError as e:
                if not no_group(e):  # no group, no count: the entry is gone with it
                    raise

    def consumers(self, stream: str) -> list[tuple[str, int, int]]:
        """(name, pending, idle ms) of every consumer in the stream's group."""
        with redis_errors(self.url):
            try:
                info = self.redis.xinfo_consumers(stream, GROUP)
            except redis.ResponseError as e:
                # No group, no stream, or a key of another type under its name (anyone may
                # add any name to the active set): nobody is in a group there
                if not (no_group(e) or error_code(e) == "WRONGTYPE" or "no such key" in str(e)):
                    raise
                return []
        return [
            (text(c["name"], "surrogateescape"), int(c["pending"]), int(c["idle"])) for c in info
        ]

    def forget_consumer(self, stream: str, consumer: str) -> None:
        with redis_errors(self.url):
            self.redis.xgroup_delconsumer(stream, GROUP, consumer_name(consumer))

    def clear_junk_bookkeeping(self, keys: Keys) -> list[str]:
        """Delete those of a serving's bookkeeping keys (never its streams) that hold another
        type than queueserve writes there, and return their names. Anyone may write them, and
        a string where the meta hash or the workers set belongs made every starting worker
        fail; none of them holds what a worker cannot rebuild (declarations, heartbeats,
        ready marks, counts), and a config hash of another type holds no override."""
        expected = {
            keys.meta: "hash",
            keys.config: "hash",
            keys.depth: "hash",
            keys.workers: "zset",
            keys.seen: "zset",
            keys.ready: "zset",
            keys.active: "zset",
            keys.keys: "set",
            keys.wake: "stream",
            keys.queued: "string",
            keys.servings: "zset",
        }
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for key in expected:
                pipe.type(key)
            found = [text(t) for t in pipe.execute()]
            junk = [
                key
                for (key, want), got in zip(expected.items(), found, strict=True)
                if got not in ("none", want)
            ]
            if junk:
                self.redis.delete(*junk)
        return junk

    def declare(self, keys: Keys, options: Mapping[str, Any]) -> None:
        """Publish a serving's options (clients read codec and max_queue from them), and list
        the serving in the prefix's registry (P:servings), in the same round trip."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(keys.meta, mapping={k: str(v) for k, v in options.items()})
            self._registered(pipe, [keys], 1)

    def redeclare(self, keys: Keys, options: Mapping[str, Any]) -> None:
        """Replace a meta key of another type by the declaration (``declare`` would fail)."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(keys.meta)
            pipe.hset(keys.meta, mapping={k: str(v) for k, v in options.items()})
            pipe.execute()
            # apart: on a cluster the registry is in another slot than the transaction's
            self._registered(self.redis.pipeline(transaction=False), [keys], 0)

    def _registered(self, pipe: Any, keys_list: Sequence[Keys], before: int) -> None:
        """Run ``pipe`` (``before`` commands queued) with the registry's refresh for
        ``keys_list`` added, raising the first error of those ``before``. A registry of
        another type (anyone may write one: it holds nothing a worker cannot rebuild) is
        replaced, never a failed heartbeat or declaration."""
        now_ms = int(time.time() * 1000)
        register_servings(pipe, keys_list, now_ms)
        replies = pipe.execute(raise_on_error=False)
        errors = [r for r in replies if isinstance(r, Exception)]
        if any(
            not isinstance(e, redis.RedisError) or error_code(e) != "WRONGTYPE" for e in errors
        ) or any(isinstance(r, Exception) for r in replies[:before]):
            raise errors[0]
        if errors:  # the registry's
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(keys_list[0].servings)
            register_servings(pipe, keys_list, now_ms)
            pipe.execute()

    def declarations(
        self, keys: Keys, last: Keys | None
    ) -> tuple[dict[str, str] | None, dict[str, str] | None, dict[str, str] | None]:
        """The meta hash, the config hash and the last shard's meta hash (``last``; None when
        not asked) as Redis holds them, in one round trip, each None when its key holds
        another type. The meta hash is read first (worker/pipeline/declaration.py says why)."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(keys.meta)
            pipe.hgetall(keys.config)
            if last is not None:
                pipe.hgetall(last.meta)
            found = raise_but_wrong_type(pipe.execute(raise_on_error=False))
        meta, config, *rest = [
            texts(reply, "replace") if isinstance(reply, dict) else None for reply in found
        ]
        return meta, config, rest[0] if rest else None

    def heartbeat(
        self, keys_list: Sequence[Keys], consumer: str, ttl_ms: int, info: Mapping[str, str | int]
    ) -> None:
        """Say ``consumer`` is alive, per serving, and refresh its registry record."""
        now_ms = int(time.time() * 1000)
        record = worker_key(keys_list[0].prefix, consumer)
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            fields: dict[Any, Any] = {**info, "heartbeat_ms": now_ms}
            pipe.hset(record, mapping=fields)
            pipe.pexpire(record, ttl_ms)
            for keys in keys_list:
                pipe.zadd(keys.workers, {consumer: now_ms})
                pipe.zremrangebyscore(keys.workers, "-inf", now_ms - ttl_ms)
                pipe.pexpire(keys.workers, ttl_ms)
            # The servings registry rides along: the listings read it, never a SCAN
            self._registered(pipe, keys_list, 2 + 3 * len(keys_list))

    def leave(self, keys_list: Sequence[Keys], consumer: str) -> None:
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(worker_key(keys_list[0].prefix, consumer))
            for keys in keys_list:
                pipe.zrem(keys.workers, consumer)
            pipe.execute()

    def subscribers(self, channels: Sequence[str]) -> dict[str, int]:
        """Subscribers of each pub/sub channel (PUBSUB NUMSUB). On a cluster a subscription
        lives on one node and NUMSUB counts only its own node's, so every node is asked and
        the counts summed (redis-py's cluster client asks one node: a caller subscribed
        elsewhere was counted 0, and a step serving took it for gone)."""
        if not channels:
            return {}
        with redis_errors(self.url):
            if not is_cluster(self.redis):
                pairs = self.redis.pubsub_numsub(*channels)
                return {text(channel): int(count) for channel, count in pairs}
            cluster: Any = self.redis
            counts = dict.fromkeys(channels, 0)
            for node in cluster.get_nodes():
                for channel, count in cluster.get_redis_connection(node).pubsub_numsub(*channels):
                    counts[text(channel)] += int(count)
            return counts

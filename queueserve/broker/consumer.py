"""The consumer side: what a worker does with Redis. Reads (broker/reads.py) and replies
(broker/replies.py) are its hot path, dead letters (broker/dead_letters.py) its refusals, and
declarations (broker/declarations.py) its servings' options and heartbeat, each a part
``Consumer`` holds; here the rest: claims, pack splits, subscriptions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import redis

from queueserve.broker.channels import SharedSubscriptions
from queueserve.broker.common import consumer_name, text
from queueserve.broker.connect import is_cluster
from queueserve.broker.core import BrokerCore, Subscription, no_group
from queueserve.broker.dead_letters import DeadLetterWriter
from queueserve.broker.declarations import Declarations
from queueserve.broker.reads import Reads
from queueserve.broker.redis_errors import error_code, redis_errors
from queueserve.broker.replies import Replies
from queueserve.wire.keys import GROUP, Keys
from queueserve.wire.priority import PRIORITY_AGE_MS
from queueserve.wire.protocol import MAX_PACK_REQUESTS


class Consumer(BrokerCore):
    """The stream operations of a worker: claims and pack splits here; its reads (``reads``),
    replies (``replies``), dead letters (``letters``), and declarations and heartbeat
    (``declared``) are parts it holds, over its connection."""

    # The shared pub/sub connection and the wake watch's (size_pool).
    OWN_CONNECTIONS = 2

    def __init__(
        self, url: str, *, client: redis.Redis | None = None, owner: str | None = None
    ) -> None:
        super().__init__(url, client=client, owner=owner)
        self._channels = SharedSubscriptions(self.redis, url)
        self.reads = reads = Reads(self)
        self.replies = Replies(self, reads)
        self.letters = letters = DeadLetterWriter(self)
        self.declared = declared = Declarations(self)
        # What the worker calls of the parts, bound once (no call layer on its hot path)
        self.ensure_group, self.adopt_legacy_keys = reads.ensure_group, reads.adopt_legacy_keys
        self.read_ready, self.wait_then_read = reads.read_ready, reads.wait_then_read
        self.sweep, self.active_streams = reads.sweep, reads.active_streams
        self.pending_by_stream = reads.pending_by_stream
        self.reply_and_ack = self.replies.reply_and_ack
        self.dead_letter, self.write_dead_letters = letters.dead_letter, letters.write_dead_letters
        self.declare, self.redeclare = declared.declare, declared.redeclare
        self.declarations = declared.declarations
        self.heartbeat, self.leave = declared.heartbeat, declared.leave
        self.clear_junk_bookkeeping = declared.clear_junk_bookkeeping

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

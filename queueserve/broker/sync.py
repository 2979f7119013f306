"""The broker seam: the few Redis operations the client and worker need, and nothing else.

Every redis-py error is turned into a queueserve error here, at one boundary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from queueserve.broker import raw
from queueserve.broker.common import (
    Enqueued,
    Request,
    cancel_arguments,
    enqueue_arguments,
    enqueued,
    inbox_command,
    inbox_messages,
    load_script,
    names,
    not_replicated_message,
    pubsub_data,
    since_ms,
    text,
    texts,
)
from queueserve.broker.connect import close, connect, is_cluster
from queueserve.broker.errors import error_code, redis_errors
from queueserve.broker.retry import Outage
from queueserve.broker.urls import redact_url
from queueserve.errors import NotReplicated, RedisUnavailable
from queueserve.wire.protocol import (
    GROUP,
    MAX_PACK_REQUESTS,
    MAX_PRIORITY,
    PRIORITY_AGE_MS,
    Keys,
    check_shards,
    worker_key,
)
from queueserve.wire.timing import DURABLE_WAIT_MS

log = logging.getLogger(__name__)

# Known batch keys one sweep call looks at: a sweep's cost per call is bounded whatever the
# number of keys, and a pass over n keys takes n / SWEEP_KEYS calls (one a second per reader).
SWEEP_KEYS = 200
# Streams of the active set one sweep call looks at: ack.lua takes out most streams left with
# nothing pending; the sweep takes out the rest (cancels, dead letters, a Redis restart).
SWEEP_STREAMS = 1000
# Idle batch keys `queueserve stats` shows, the last enqueued to; keys with work are all shown.
STATS_RECENT_KEYS = 20

StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]


class ReadOutcome:
    """What one read of the ready streams gave."""

    __slots__ = ("entries", "left", "more", "skipped", "wake_id")

    def __init__(
        self, wake_id: bytes, skipped: int, more: bool, left: int,
        entries: list[tuple[str, StreamEntries]],
    ) -> None:
        self.wake_id = wake_id  # block on the wake stream after this id when nothing came
        self.skipped = skipped  # ready streams of keys the worker said were full
        self.more = more  # the room ran out before every ready stream was looked at
        self.left = left  # streams read from that still hold unread entries
        self.entries = entries

    @property
    def drained(self) -> bool:
        """Nothing this consumer may read is left: the next read would find only what comes
        after it, so it can block on the wake stream straight away."""
        return not (self.skipped or self.more or self.left)


@dataclass(frozen=True)
class WakeRead:
    """A blocking read of the ready streams (``wait_then_read``'s arguments), to be sent
    right behind a reply: ``reply_and_ack(then_read=...)``."""

    after: bytes
    block_ms: int
    consumer: str
    budget: int
    per_key: int
    full: Sequence[str]


class PendingRead:
    """A wake read sent behind a reply (``reply_and_ack(then_read=...)``): ``result`` blocks
    until it comes back; ``abandon`` drops its connection when it will never be read."""

    __slots__ = ("_broker", "_keys", "_read", "_sent")

    def __init__(self, broker: RedisBroker, keys: Keys, read: WakeRead, sent: raw.Sent) -> None:
        self._broker = broker
        self._keys = keys
        self._read = read
        self._sent = sent

    def result(self) -> ReadOutcome:
        with redis_errors(self._broker.url):
            _, out = self._sent.read(2)
            return self._broker._wake_read_outcome(self._keys, self._read, out)

    def abandon(self) -> None:
        self._sent.abandon()


def _no_group(error: redis.ResponseError) -> bool:
    return error_code(error) == "NOGROUP"


class Subscription:
    """Pub/sub channels, read with ``get``; resubscribes by itself after a reconnect.

    After a failure the pub/sub connection is made anew: a cluster's pub/sub client stays
    bound to the node it picked, which may be the one that died."""

    def __init__(self, client: redis.Redis | redis.RedisCluster, url: str,
                 *channels: str) -> None:
        self.url = url
        self.channels = channels
        self.confirmed = False  # Redis confirmed the subscription at least once
        self._client = client
        self._pubsub: Any = None

    def _subscribed(self) -> Any:
        if self._pubsub is None:
            self._pubsub = self._client.pubsub(  # type: ignore[no-untyped-call]
                ignore_subscribe_messages=False)
        if not self._pubsub.subscribed:
            self._pubsub.subscribe(*self.channels)
        return self._pubsub

    def open(self) -> None:
        """Subscribe now (``get`` would subscribe on first use)."""
        with self._renewed_on_failure():
            self._subscribed()

    def get(self, timeout: float) -> bytes | None:
        """The next message published, or None after ``timeout`` seconds (or a confirmation)."""
        with self._renewed_on_failure():
            confirmation, data = pubsub_data(self._subscribed().get_message(timeout=timeout))
        self.confirmed = self.confirmed or confirmation
        return data

    @contextlib.contextmanager
    def _renewed_on_failure(self) -> Iterator[None]:
        try:
            with redis_errors(self.url):
                yield
        except RedisUnavailable:
            self.close()
            raise
        except (TypeError, AttributeError, OSError) as e:
            # redis-py reading a pub/sub connection it has just dropped (its socket gone):
            # a broken connection like any other, made anew by the next get.
            self.close()
            raise RedisUnavailable(
                f"the pub/sub connection to Redis at {redact_url(self.url)} broke ({e!r})"
            ) from None

    def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                pubsub.close()


def _fields(flat: list[bytes]) -> dict[bytes, bytes]:
    if len(flat) == 6:  # an entry as enqueue.lua writes it (h, p, a): no slicing
        return {flat[0]: flat[1], flat[2]: flat[3], flat[4]: flat[5]}
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _pushes(replies: Mapping[str, list[bytes]], inbox_ttl_ms: int) -> list[tuple[Any, ...]]:
    commands: list[tuple[Any, ...]] = []
    for inbox, messages in replies.items():
        # One command each: a command's size is bounded too.
        commands += [("RPUSH", inbox, message) for message in messages]
        commands.append(("PEXPIRE", inbox, inbox_ttl_ms))
    return commands


def _push(pipe: Any, replies: Mapping[str, list[bytes]], inbox_ttl_ms: int) -> None:
    for command in _pushes(replies, inbox_ttl_ms):
        pipe.execute_command(*command)


def _drop_undeliverable(failures: list[Exception]) -> None:
    for failure in failures:
        if not str(failure).startswith("WRONGTYPE"):
            raise failure
        # Someone made an inbox key another type: that caller cannot be answered, and
        # retrying would hold every later reply behind it.
        log.warning("a reply could not be delivered and was dropped: %s", failure)


def _streams_with_work(
    keys: Keys, ready: Sequence[bytes], active: Sequence[bytes]
) -> list[tuple[str, str]]:
    """(batch key, stream) of the streams named by a shard's ready members (``<N><K>``) and
    active set, in name order; members anyone could have written that name no request
    stream of this shard are left out."""
    names = {keys.stream(m[1:], int(m[0])) for m in (text(r, "replace") for r in ready)
             if m[:1].isascii() and m[:1].isdigit()}
    names.update(text(a, "replace") for a in active)
    found = []
    for name in sorted(names):
        try:
            if keys.shard_of(name) is keys:
                found.append((keys.batch_key_of(name), name))
        except ValueError:
            continue
    return found


Unnamed = list[tuple[bytes, StreamEntries]]


def _read_outcome(out: list[Any]) -> tuple[ReadOutcome, Unnamed]:
    """read.lua's reply, and apart the entries of streams whose names are not UTF-8."""
    entries: list[tuple[str, StreamEntries]] = []
    unnamed: Unnamed = []
    for i in range(4, len(out), 2):
        read = [(e[0], _fields(e[1])) for e in out[i + 1]]
        try:
            entries.append((text(out[i]), read))
        except UnicodeDecodeError:
            unnamed.append((out[i], read))
    return ReadOutcome(out[0], int(out[1]), bool(out[2]), int(out[3]), entries), unnamed


@dataclass(slots=True)
class KeyStats:
    key: str
    queued_items: int
    last_seen_ms: int
    waiting: int = 0  # entries not read by any worker
    pending: int = 0  # entries read and not acked
    oldest_age_ms: int = 0  # of the oldest entry still in its streams; 0 = none
    read: int = 0  # entries the consumer group read so far


def _ms(score: float | None) -> int:
    """A unix-ms score read from a sorted set anyone may write: 0 unless finite."""
    return int(score) if score is not None and math.isfinite(score) else 0


def _count(raw: str) -> int:
    """An item count read from a hash anyone may write: 0 unless a non-negative int (ASCII
    digits: str.isdigit takes '²', which int() refuses, and past 4,300 digits int() refuses
    any)."""
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else 0


def _add_stream(row: KeyStats, length: Any, groups: Any, first: Any, now_ms: int) -> None:
    """Add one priority stream's XLEN, XINFO GROUPS and first entry to a key's row."""
    if not isinstance(length, int) or not length:
        return
    group = next((g for g in groups if text(g["name"], "replace") == GROUP), None) if (
        isinstance(groups, list)) else None
    pending = int(group["pending"]) if group else 0
    row.pending += pending
    row.waiting += length - pending
    row.read += int(group.get("entries-read") or 0) if group else 0
    if isinstance(first, list) and first:
        born = int(text(first[0][0]).split("-")[0])
        row.oldest_age_ms = max(row.oldest_age_ms, now_ms - born)


class RedisBroker:
    """Stream operations of one Redis deployment."""

    def __init__(
        self, url: str, *, client: redis.Redis | None = None, owner: str | None = None
    ) -> None:
        self.url = url
        self.redis = client if client is not None else connect(url)
        # The loops of whoever uses this broker log an outage of it once, under this name.
        self.outage = Outage(owner or f"Redis at {redact_url(url)}")
        self._enqueue: Script = self.redis.register_script(load_script("enqueue.lua"))
        self._ack: Script = self.redis.register_script(load_script("ack.lua"))
        self._cancel: Script = self.redis.register_script(load_script("cancel.lua"))
        self._read: Script = self.redis.register_script(load_script("read.lua"))
        self._sweep: Script = self.redis.register_script(load_script("sweep.lua"))
        self._replay: Script = self.redis.register_script(load_script("replay.lua"))
        self._split: Script = self.redis.register_script(load_script("split.lua"))
        self._loaded_on: set[int] = set()  # connections enqueue.lua was loaded on (durable)
        # The hot path's round trips go straight onto a pooled connection (broker/raw.py),
        # except on a cluster, whose client routes each command to its slot's master.
        plain = not is_cluster(self.redis)
        self._raw = (raw.Connections(cast(redis.Redis, self.redis).connection_pool)
                      if plain else None)

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
        close(self.redis)

    # -- producers --------------------------------------------------------------------------
    def enqueue(
        self, keys: Keys, requests: Sequence[Request], max_queue: int, *, durable: bool = False
    ) -> Enqueued:
        """Admit requests ``(batch_key, n_items, header, payload, priority)`` atomically.

        Returns the limit in force, the queued item count after admission, and per request its
        stream entry id, or 0 when it was rejected for max_queue. ``durable`` waits until a
        replica holds them too (NotReplicated when none did within DURABLE_WAIT_MS).
        """
        script_keys, args = enqueue_arguments(keys, requests, max_queue)
        with redis_errors(self.url):
            if not durable:
                return enqueued(self._evalsha(self._enqueue, script_keys, args))
            reply, replicas = self._enqueue_and_wait(script_keys, args)
        if replicas < 1:
            raise NotReplicated(not_replicated_message(keys, self.url))
        return enqueued(reply)

    def _evalsha(self, script: Script, script_keys: list[str], args: list[Any]) -> Any:
        """Run ``script`` (one round trip; on a server that lost its scripts, loaded first)."""
        if self._raw is None:
            return script(keys=script_keys, args=args)
        command = ("EVALSHA", script.sha, len(script_keys), *script_keys, *args)
        (reply,) = raw.run(self._raw, [command])
        if isinstance(reply, NoScriptError):  # Redis restarted or flushed its scripts
            (reply,) = raw.run(self._raw, [("SCRIPT", "LOAD", script.script), command])[1:]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _load(self, script: Script) -> None:
        """Load ``script`` on the server the hot path's commands go to (after a failover,
        redis-py's pool may still hold a connection to the old master, now a replica, which
        would take the script without complaint)."""
        if self._raw is None:
            self.redis.script_load(script.script)
        else:
            (reply,) = raw.run(self._raw, [("SCRIPT", "LOAD", script.script)])
            if isinstance(reply, Exception):
                raise reply

    def _node(self, key: str) -> Any:
        """A plain client of the master serving ``key``: on a cluster, commands sent through it
        skip the cluster client's routing. redis-py asks ``COMMAND GETKEYS`` of its default
        node (always the same master) before every command whose keys it cannot place itself
        (BLMPOP, XREAD): one more round trip per call, and that master's CPU. Not a cluster:
        the client itself."""
        client: Any = self.redis
        if is_cluster(client):
            return client.get_redis_connection(client.get_node_from_key(key))
        return client

    def _target(self, key: str) -> dict[str, Any]:
        """Options naming the node of ``key`` for a command in a cluster pipeline."""
        if is_cluster(self.redis):
            return {"target_nodes": self.redis.get_node_from_key(key)}  # type: ignore[union-attr]
        return {}

    def _moved(self, key: str, reply: object) -> None:
        """Raise a transient error for a MOVED/ASK ``reply`` of a command sent through
        ``_node`` (a failover or resharding moved the slot), after reloading the slot map;
        the retry helper then sends it again, to the new master."""
        if isinstance(reply, redis.ResponseError) and error_code(reply) in ("MOVED", "ASK"):
            self._refresh_slots()
            raise redis.ConnectionError(f"the slot of {key} moved: {reply}")

    @contextlib.contextmanager
    def _routed(self, key: str) -> Iterator[None]:
        """Around commands sent through ``_node(key)``: a MOVED, or a master that cannot be
        reached, reloads the slot map before the error goes on."""
        try:
            yield
        except redis.ResponseError as e:
            self._moved(key, e)
            raise
        except redis.ConnectionError:
            self._refresh_slots()
            raise

    def _enqueue_and_wait(self, script_keys: list[str], args: list[Any]) -> tuple[Any, int]:
        """enqueue.lua then ``WAIT 1``, on one connection: WAIT counts the replicas that hold
        this connection's writes. On a cluster, that is a connection to the shard's master."""
        client = self._node(script_keys[0])
        if id(client) not in self._loaded_on:
            # Loaded first: after a NOSCRIPT the WAIT behind it would still wait its full time.
            client.script_load(self._enqueue.script)
            self._loaded_on.add(id(client))
        for attempt in (0, 1):
            pipe = client.pipeline(transaction=False)
            pipe.evalsha(self._enqueue.sha, len(script_keys), *script_keys, *args)
            pipe.execute_command("WAIT", 1, DURABLE_WAIT_MS)
            try:
                reply, replicas = pipe.execute(raise_on_error=False)
            except redis.ConnectionError:
                self._refresh_slots()
                raise
            if isinstance(reply, NoScriptError) and attempt == 0:
                client.script_load(self._enqueue.script)
                continue
            if isinstance(reply, redis.ResponseError):
                self._moved(script_keys[0], reply)  # failover or resharding: sent again
                raise reply
            if isinstance(replicas, redis.ResponseError):
                # UNBLOCKED: the master turned replica while WAIT waited (a failover took
                # its slot or service): transient, so the send is retried on the new master
                # (the entry went with the old master's writes, or it runs twice and its
                # caller keeps one answer). Never int() of it: that killed the sender thread,
                # and its callers waited for their timeout.
                raise replicas
            break
        return reply, int(replicas)

    def _refresh_slots(self) -> None:
        if is_cluster(self.redis):
            with contextlib.suppress(redis.RedisError):
                self.redis.nodes_manager.initialize()  # type: ignore[union-attr]

    def cancel(self, keys: Keys, stream: str, entry_id: bytes, n: int) -> bool:
        script_keys, args = cancel_arguments(keys, stream, entry_id, n)
        with redis_errors(self.url):
            return bool(self._cancel(keys=script_keys, args=args))

    def read_inbox(self, inbox: str, timeout: float) -> list[bytes]:
        """Replies waiting in ``inbox`` (BLMPOP), sent straight to the inbox's master."""
        with redis_errors(self.url):
            if self._raw is not None:
                (reply,) = raw.run(self._raw, [inbox_command(inbox, timeout)])
                if isinstance(reply, Exception):
                    raise reply
                return inbox_messages(reply)
            with self._routed(inbox):
                return inbox_messages(
                    self._node(inbox).execute_command(*inbox_command(inbox, timeout))
                )

    def wake_inbox(self, inbox: str) -> None:
        """Make a blocked ``read_inbox`` return (an empty message, which readers skip)."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(inbox, b"")
            pipe.pexpire(inbox, 1000)
            pipe.execute()

    def subscribe(self, *channels: str) -> Subscription:
        return Subscription(self.redis, self.url, *channels)

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

    def alive_workers(self, keys: Keys, within: float) -> int:
        with redis_errors(self.url):
            return int(self.redis.zcount(keys.workers, since_ms(within), "+inf"))

    def meta(self, keys: Keys) -> dict[str, str]:
        with redis_errors(self.url):
            return texts(self.redis.hgetall(keys.meta), "replace")

    # -- consumers --------------------------------------------------------------------------
    def ensure_group(self, stream: str) -> None:
        """Create the consumer group at the start of the stream, so nothing queued is missed."""
        with redis_errors(self.url):
            try:
                self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def adopt_legacy_keys(self, keys: Keys) -> None:
        """Move batch keys from the set older versions kept (never forgotten) into ``seen``,
        as seen now: they are forgotten in their turn if they stay idle."""
        with redis_errors(self.url):
            old = cast(set[bytes], self.redis.smembers(keys.keys))
            if old:
                now_ms = int(time.time() * 1000)
                pipe = self.redis.pipeline(transaction=False)
                pipe.zadd(keys.seen, dict.fromkeys(old, now_ms), nx=True)
                pipe.delete(keys.keys)
                pipe.execute()

    def read_ready(
        self, keys: Keys, consumer: str, budget: int, per_key: int, full: Sequence[str]
    ) -> ReadOutcome:
        """New entries for ``consumer`` from the streams that have unread work, most urgent
        first (read.lua): about ``budget`` items, ``per_key`` per batch key, none of the
        batch keys in ``full``. Idle keys are not touched."""
        keys_, args = self._read_arguments(keys, consumer, budget, per_key, full)
        with redis_errors(self.url):
            out = self._evalsha(self._read, keys_, args)
        return self._outcome(keys, out)

    def wait_then_read(self, keys: Keys, read: WakeRead) -> ReadOutcome:
        """Block until a stream of the serving becomes ready after wake id ``read.after`` (or
        ``read.block_ms`` passed), then ``read_ready``: one round trip. Redis runs a
        connection's next command only once its blocking command returned, so the read starts
        the moment work arrives, and an idle worker's answer costs one wake-up instead of a
        wake-up and another round trip."""
        commands = self._wake_read_commands(keys, read)
        with redis_errors(self.url):
            if self._raw is not None:
                woke, out = raw.run(self._raw, commands)
            else:
                # On the shard's master directly: a cluster pipeline refuses evalsha() by
                # name, and would ask COMMAND GETKEYS of its default node for the XREAD.
                with self._routed(keys.wake):
                    pipe = self._node(keys.wake).pipeline(transaction=False)
                    for command in commands:
                        pipe.execute_command(*command)
                    woke, out = pipe.execute(raise_on_error=False)
                self._moved(keys.wake, woke)
            return self._wake_read_outcome(keys, read, out)

    def _wake_read_commands(self, keys: Keys, read: WakeRead) -> list[tuple[Any, ...]]:
        keys_, args = self._read_arguments(
            keys, read.consumer, read.budget, read.per_key, read.full
        )
        return [("XREAD", "COUNT", 1, "BLOCK", read.block_ms, "STREAMS", keys.wake, read.after),
                ("EVALSHA", self._read.sha, len(keys_), *keys_, *args)]

    def _wake_read_outcome(self, keys: Keys, read: WakeRead, out: Any) -> ReadOutcome:
        """read.lua's reply to a wake read (the caller maps redis-py's errors)."""
        if isinstance(out, NoScriptError):  # Redis restarted or flushed its scripts
            keys_, args = self._read_arguments(
                keys, read.consumer, read.budget, read.per_key, read.full
            )
            out = self._evalsha(self._read, keys_, args)
        elif isinstance(out, Exception):
            self._moved(keys.wake, out)
            raise out
        return self._outcome(keys, out)

    def _outcome(self, keys: Keys, out: list[Any]) -> ReadOutcome:
        """read.lua's reply. Entries of a stream whose name is not UTF-8 go to the dead-letter
        stream, acked and deleted: no client writes such a batch key (anyone may XADD one),
        and the worker could not name the stream to answer or ack them."""
        outcome, unnamed = _read_outcome(out)
        if not unnamed:
            return outcome
        reason = "the name of its stream is not UTF-8: no queueserve client writes such a key"
        now_ms = int(time.time() * 1000)
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for stream, entries in unnamed:
                for entry_id, fields in entries:
                    record: dict[Any, Any] = {"stream": stream, "entry_id": entry_id,
                                              "at_ms": now_ms, "reason": reason}
                    record.update((b"field:" + name, value) for name, value in fields.items())
                    pipe.xadd(keys.dead, record)
                pipe.xack(stream, GROUP, *(e[0] for e in entries))
                pipe.xdel(stream, *(e[0] for e in entries))
            pipe.execute()
        log.warning("serving %s: dead-lettered %d entries: %s", keys.name,
                    sum(len(e) for _, e in unnamed), reason)
        return outcome

    @staticmethod
    def _read_arguments(
        keys: Keys, consumer: str, budget: int, per_key: int, full: Sequence[str]
    ) -> tuple[list[str], list[Any]]:
        stream_prefix, priority_prefix = keys.stream_prefixes
        return [keys.ready, keys.active, keys.wake], [
            GROUP, consumer, PRIORITY_AGE_MS, budget, per_key, stream_prefix, priority_prefix,
            *full,
        ]

    def sweep(
        self, keys: Keys, idle_ttl_ms: int, declared: Sequence[str], start: int = 0,
        chunk: int = SWEEP_KEYS,
    ) -> tuple[int, int, int]:
        """One step of the pass over the known batch keys (sweep.lua): the ``chunk`` keys from
        rank ``start`` and the ``declared`` ones have streams with unread entries marked ready,
        and those idle past ``idle_ttl_ms`` holding nothing are forgotten; of up to
        SWEEP_STREAMS streams of the active set, those holding no pending entry leave it. One
        call costs the same with 10 known keys or 100,000: a pass over n keys takes n / chunk
        calls.
        Returns (keys forgotten, streams marked ready, where the next call starts: 0 once the
        pass is complete)."""
        stream_prefix, priority_prefix = keys.stream_prefixes
        with redis_errors(self.url):
            looked, gone, marked = self._sweep(
                keys=[keys.seen, keys.ready, keys.active, keys.depth, keys.wake],
                args=[GROUP, PRIORITY_AGE_MS, idle_ttl_ms, stream_prefix, priority_prefix,
                      start, chunk, SWEEP_STREAMS, *declared],
            )
        after = 0 if int(looked) < chunk else start + int(looked) - int(gone)
        return int(gone), int(marked), after

    def active_streams(self, keys: Keys) -> list[str]:
        """Streams read from lately: the only ones that may hold pending entries."""
        with redis_errors(self.url):
            return names(cast(list[bytes], self.redis.zrange(keys.active, 0, -1)))

    def pending_by_stream(self, streams: Sequence[str]) -> dict[str, list[tuple[str, int]]]:
        """Per stream, the consumers holding unacked entries and how many: one round trip."""
        if not streams:
            return {}
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for stream in streams:
                pipe.xpending(stream, GROUP)
            out = pipe.execute(raise_on_error=False)
        return {
            stream: [(text(c["name"]), int(c["pending"])) for c in summary.get("consumers") or []]
            for stream, summary in zip(streams, out, strict=True)
            if isinstance(summary, dict)
        }

    def read(
        self, consumer: str, streams: Sequence[str], count: int, block_ms: int
    ) -> list[tuple[bytes, StreamEntries]]:
        """New entries for ``consumer`` from ``streams``, blocking up to ``block_ms``.

        A Redis that came back without its data (no persistence, a failover to an empty
        replica, a deleted stream) has lost the consumer groups: they are made again."""
        with redis_errors(self.url):
            try:
                out = self.redis.xreadgroup(
                    GROUP, consumer, dict.fromkeys(streams, ">"), count=count, block=block_ms
                )
            except redis.ResponseError as e:
                if not _no_group(e):
                    raise
                log.warning("consumer group missing on %s (%s): creating it again",
                            redact_url(self.url), e)
                for stream in streams:
                    self.ensure_group(stream)
                return []
        return cast(list[tuple[bytes, StreamEntries]], out or [])

    def reply_and_ack(
        self,
        keys: Keys,
        replies: Mapping[str, list[bytes]],
        acks: Mapping[str, Mapping[int, list[bytes]]],
        inbox_ttl_ms: int,
        events: Sequence[tuple[str, bytes]] = (),
        *,
        durable: bool = False,
        then_read: WakeRead | None = None,
    ) -> PendingRead | None:
        """Publish streamed events, push replies to client inboxes, then ack finished entries:
        one round trip, in that order (a batch's events precede its replies).

        ``then_read``: a worker that will block on the wake stream next sends that read in
        the same write, and gets it back as a ``PendingRead`` (None where it cannot: a
        cluster, or replies pushed apart for ``durable``). Redis then starts the read the
        moment the next request arrives, while the worker is still busy after this reply.

        Replies go before acks: a worker dying between the two re-runs the request, and the
        client drops the duplicate answer. On one server (Sentinel too) that order is also
        the replication order, so a failover that keeps an ack keeps its reply, and one that
        loses both leaves the entry pending for this worker, which serves it again
        (``_forgotten`` in the worker's intake). On a cluster an inbox lives on another master
        than the stream: ``durable`` (the serving's option) then pushes the replies and waits
        for a replica of each inbox's master (``WAIT 1``) before any ack is sent, so a reply
        whose request was acked survives the loss of its master. When no replica acknowledged
        within DURABLE_WAIT_MS the acks are held (RedisUnavailable, retried: the replies go
        again and the clients keep the first of each).
        """
        durable_replies = durable and bool(replies) and is_cluster(self.redis)
        if durable_replies:
            self._push_replicated(replies, inbox_ttl_ms)
            replies = {}

        commands: list[tuple[Any, ...]] = [("PUBLISH", channel, message)
                                           for channel, message in events]
        commands += _pushes(replies, inbox_ttl_ms)
        scripted = len(commands)
        commands += self._ack_commands(keys, acks)
        fused = then_read is not None and self._raw is not None and not durable_replies
        sent: raw.Sent | None = None

        def send() -> list[Exception]:
            nonlocal sent
            if fused and sent is None:
                assert self._raw is not None and then_read is not None
                sent = raw.send(self._raw, commands + self._wake_read_commands(keys, then_read))
                out = sent.read(len(commands))
            else:
                out = self._send_commands(commands, scripted)
            failures = [r for r in out if isinstance(r, Exception)]
            for failure in failures:
                self._moved(next(iter(acks), ""), failure)
            return failures

        try:
            with redis_errors(self.url):
                failures = send()
                if any(isinstance(f, NoScriptError) for f in failures):
                    # Redis restarted or flushed its scripts: load, send again; the replies
                    # go twice and the clients keep the first of each.
                    self._load(self._ack)
                    failures = send()
                _drop_undeliverable(failures)
        except BaseException:
            if sent is not None:
                sent.abandon()
            raise
        if sent is None or then_read is None:
            return None
        return PendingRead(self, keys, then_read, sent)

    def _ack_commands(
        self, keys: Keys, acks: Mapping[str, Mapping[int, list[bytes]]]
    ) -> list[tuple[Any, ...]]:
        # EVALSHA directly: redis-py's Script in a pipeline asks SCRIPT EXISTS on every
        # execute, one more round trip per batch. As a plain command: a cluster pipeline
        # refuses evalsha() by name; and with its node named, or the cluster pipeline would
        # ask its default node COMMAND GETKEYS for each one (one more round trip, and that
        # one master's CPU).
        commands: list[tuple[Any, ...]] = []
        for stream, runs in acks.items():
            shard = keys.shard_of(stream)
            args: list[Any] = [GROUP, shard.batch_key_of(stream)]
            for admitted, ids in runs.items():  # entries admitted with the same count
                args += (admitted, len(ids), *ids)
            commands.append(("EVALSHA", self._ack.sha, 4, stream, shard.queued, shard.depth,
                             shard.active, *args))
        return commands

    def _send_commands(self, commands: list[tuple[Any, ...]], scripted: int) -> list[Any]:
        """Replies and acks in one round trip; commands from ``scripted`` on are ack scripts,
        sent to the node of their stream on a cluster."""
        if self._raw is not None:
            return raw.run(self._raw, commands)
        pipe = self.redis.pipeline(transaction=False)
        for i, command in enumerate(commands):
            target = self._target(command[3]) if i >= scripted else {}
            pipe.execute_command(*command, **target)
        return cast(list[Any], pipe.execute(raise_on_error=False))

    def _push_replicated(self, replies: Mapping[str, list[bytes]], inbox_ttl_ms: int) -> None:
        """Push ``replies`` on each inbox's master, each push followed by ``WAIT 1`` on the
        same connection; return once a replica of every one of them holds its replies."""
        by_node: dict[str, dict[str, list[bytes]]] = {}
        for inbox, messages in replies.items():
            node = self.redis.get_node_from_key(inbox)  # type: ignore[union-attr]
            by_node.setdefault(node.name, {})[inbox] = messages
        with redis_errors(self.url):
            for inboxes in by_node.values():
                first = next(iter(inboxes))
                with self._routed(first):
                    pipe = self._node(first).pipeline(transaction=False)
                    _push(pipe, inboxes, inbox_ttl_ms)
                    pipe.execute_command("WAIT", 1, DURABLE_WAIT_MS)
                    *out, replicas = pipe.execute(raise_on_error=False)
                    for result in out:
                        self._moved(first, result)
                    _drop_undeliverable([r for r in out if isinstance(r, Exception)])
                if isinstance(replicas, Exception) or int(replicas) < 1:
                    raise RedisUnavailable(
                        f"no replica of the master holding {first} on {redact_url(self.url)} "
                        f"acknowledged a durable serving's replies within {DURABLE_WAIT_MS} ms "
                        f"({replicas!r}); the requests stay unacked and the replies are sent "
                        "again: check that master's replicas (INFO replication)"
                    )

    def alive_consumers(self, keys: Keys, within: float) -> set[str]:
        with redis_errors(self.url):
            raw = self.redis.zrangebyscore(keys.workers, since_ms(within), "+inf")
        return set(names(cast(list[bytes], raw)))

    def pending_consumers(self, stream: str) -> list[tuple[str, int]]:
        """Consumers of ``stream`` holding unacked entries, with how many. A group lost with
        Redis's data is made again: nothing is pending in it."""
        with redis_errors(self.url):
            try:
                summary = self.redis.xpending(stream, GROUP)
            except redis.ResponseError as e:
                if not _no_group(e):
                    raise
                self.ensure_group(stream)
                return []
        return [(text(c["name"]), int(c["pending"])) for c in summary.get("consumers") or []]

    def claim(
        self, stream: str, owner: str, claimer: str, min_idle_ms: int, count: int,
        skip: AbstractSet[bytes] = frozenset(),
    ) -> list[tuple[bytes, dict[bytes, bytes], int]]:
        """Move up to ``count`` of ``owner``'s entries idle for ``min_idle_ms`` to ``claimer``.

        Returns (entry id, fields, times delivered so far). The claim does not count as a
        delivery (JUSTID): only running a redelivered entry does (``count_delivery``), so
        requests that merely sat beside a crasher are not blamed for its crashes. Entries
        deleted meanwhile (cancelled) leave the pending list without being returned. Two
        claimers racing never both get an entry: the claim resets its idle time.
        """
        with redis_errors(self.url):
            try:
                pending = self.redis.xpending_range(
                    stream, GROUP, min="-", max="+", count=count, consumername=owner,
                    idle=min_idle_ms,
                )
            except redis.ResponseError as e:
                if not _no_group(e):
                    raise
                return []  # the group went with Redis's data: nobody holds anything
            if not pending:
                return []
            deliveries = {
                p["message_id"]: int(p["times_delivered"])
                for p in pending
                if p["message_id"] not in skip
            }
            if not deliveries:
                return []
            claimed = cast(list[bytes], self.redis.xclaim(
                stream, GROUP, claimer, min_idle_ms, list(deliveries), justid=True
            ))
            pipe = self.redis.pipeline(transaction=False)
            for entry_id in claimed:
                pipe.xrange(stream, entry_id, entry_id)
            found = pipe.execute()
        return [
            (entry[0][0], entry[0][1], deliveries.get(entry[0][0], 1))
            for entry in found
            if entry
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
            return int(self._split(
                keys=[stream, shard.ready, shard.wake],
                args=[GROUP, entry_id, f"{priority}{batch_key}", score, MAX_PACK_REQUESTS],
            ))

    def count_delivery(self, stream: str, consumer: str, entry_id: bytes) -> None:
        """Count one more delivery of an entry this consumer is about to run."""
        with redis_errors(self.url):
            try:
                self.redis.xclaim(stream, GROUP, consumer, 0, [entry_id])
            except redis.ResponseError as e:
                if not _no_group(e):  # no group, no count: the entry is gone with it
                    raise

    def consumers(self, stream: str) -> list[tuple[str, int, int]]:
        """(name, pending, idle ms) of every consumer in the stream's group."""
        with redis_errors(self.url):
            try:
                info = self.redis.xinfo_consumers(stream, GROUP)
            except redis.ResponseError as e:
                if not _no_group(e):
                    raise
                return []
        return [(text(c["name"]), int(c["pending"]), int(c["idle"])) for c in info]

    def forget_consumer(self, stream: str, consumer: str) -> None:
        with redis_errors(self.url):
            self.redis.xgroup_delconsumer(stream, GROUP, consumer)

    def queue_depths(self, keys_list: Sequence[Keys]) -> list[tuple[Keys, str, int, int]]:
        """(serving keys, batch key, stream length, pending) for every batch key whose streams
        hold entries: those in the ready set (unread entries) or the active set (pending ones).
        What it reads grows with the streams that hold work, never with the keys ever seen.

        Acked entries are deleted, so length - pending is what waits to be read."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for keys in keys_list:
                pipe.zrange(keys.ready, 0, -1)
                pipe.zrange(keys.active, 0, -1)
            marks = pipe.execute()
            streams = [
                (keys, key, stream)
                for i, keys in enumerate(keys_list)
                for key, stream in _streams_with_work(keys, marks[2 * i], marks[2 * i + 1])
            ]
            pipe = self.redis.pipeline(transaction=False)
            for _, _, stream in streams:
                pipe.xlen(stream)
                pipe.xpending(stream, GROUP)
            out = pipe.execute(raise_on_error=False)
        rows: dict[tuple[Keys, str], list[int]] = {}
        for i, (keys, key, _) in enumerate(streams):
            length, summary = out[2 * i], out[2 * i + 1]
            row = rows.setdefault((keys, key), [0, 0])
            row[0] += length if isinstance(length, int) else 0
            row[1] += int(summary["pending"]) if isinstance(summary, dict) else 0
        return [(keys, key, length, held) for (keys, key), (length, held) in rows.items()]

    def servings(self, prefix: str) -> list[str]:
        """Names of the servings any worker ever declared under ``prefix``."""
        names = set()
        with redis_errors(self.url):
            for key in self.redis.scan_iter(match=f"{prefix}:{{*}}:meta", count=500):
                name = text(key, "replace")
                names.add(name[name.index("{") + 1 : name.rindex("}")])
        # S#i: the meta hash of a shard (names never hold '#'), where workers confirm `shards`
        return sorted(name for name in names if "#" not in name)

    def key_stats(self, keys: Keys, recent: int = STATS_RECENT_KEYS) -> list[KeyStats]:
        """Per batch key with work (streams in the ready or active set, items admitted) and
        per key among the ``recent`` last enqueued to: items queued, entries waiting and
        pending, the oldest entry's age, when it was last enqueued to, and entries its group
        has read (all priorities). Other known keys are idle and not read (``known_keys``
        counts them), so what this reads grows with the keys that have work."""
        levels = MAX_PRIORITY + 1
        now_ms = int(time.time() * 1000)
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrange(keys.ready, 0, -1)
            pipe.zrange(keys.active, 0, -1)
            pipe.hgetall(keys.depth)
            pipe.zrange(keys.seen, -max(1, recent), -1, withscores=True)
            ready, active, depth_raw, latest = pipe.execute()
            depth = {k: _count(v) for k, v in texts(depth_raw, "replace").items()}
            seen = {text(k, "replace"): _ms(v) for k, v in latest}
            working = {key for key, _ in _streams_with_work(keys, ready, active)} | set(depth)
            others = sorted(working - set(seen))
            if others:
                scores = self.redis.zmscore(keys.seen, others)
                seen.update((k, _ms(v)) for k, v in zip(others, scores, strict=True))
            names = sorted(seen, key=lambda k: (seen[k], k))
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                for stream in keys.streams(name):
                    pipe.xlen(stream)
                    pipe.xinfo_groups(stream)
                    pipe.xrange(stream, "-", "+", count=1)
            out = pipe.execute(raise_on_error=False)
        stats = []
        for i, name in enumerate(names):
            row = KeyStats(name, depth.get(name, 0), last_seen_ms=seen[name])
            for j in range(3 * levels * i, 3 * levels * (i + 1), 3):
                _add_stream(row, out[j], out[j + 1], out[j + 2], now_ms)
            stats.append(row)
        return stats

    def known_keys(self, keys: Keys) -> int:
        """How many batch keys the serving shard knows (work or idle)."""
        with redis_errors(self.url):
            return int(self.redis.zcard(keys.seen))

    def shards(self, keys: Keys) -> list[Keys]:
        """Every shard of a serving, shard 0 first, as its workers declared (``shards`` in its
        meta hash, confirmed by the last shard's; shard 0 alone when none did, or when the
        field is not a valid count)."""
        with redis_errors(self.url):
            raw = self.redis.hget(keys.meta, "shards")
        try:
            count = check_shards(int(text(raw))) if raw else 1
        except ValueError:
            count = 0
        if count > 1:
            with redis_errors(self.url):
                confirmed = self.redis.hget(keys.last_shard(count).meta, "shards") == raw
            count = count if confirmed else 0
        if count == 0:
            log.warning("serving %s: ignored shards=%r in its meta hash (not a count its "
                        "workers declared)", keys.name, raw)
        return keys.sharded(max(1, count))

    def summed_key_stats(self, shards: Sequence[Keys]) -> list[KeyStats]:
        """``key_stats`` of every shard, summed per batch key (ages: the oldest, last seen:
        the latest)."""
        rows: dict[str, KeyStats] = {}
        for keys in shards:
            for row in self.key_stats(keys):
                total = rows.setdefault(row.key, KeyStats(row.key, 0, 0))
                total.queued_items += row.queued_items
                total.last_seen_ms = max(total.last_seen_ms, row.last_seen_ms)
                total.waiting += row.waiting
                total.pending += row.pending
                total.oldest_age_ms = max(total.oldest_age_ms, row.oldest_age_ms)
                total.read += row.read
        return list(rows.values())

    def dead_letter_depths(self, keys_list: Sequence[Keys]) -> list[tuple[Keys, int]]:
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for keys in keys_list:
                pipe.xlen(keys.dead)
            return list(zip(keys_list, (int(n) for n in pipe.execute()), strict=True))

    def ping(self) -> bool:
        try:
            with redis_errors(self.url):
                return bool(self.redis.ping())
        except RedisUnavailable:
            return False

    def dead_letter(
        self, keys: Keys, stream: str, entry_id: bytes, *records: Mapping[str, Any],
        ack_now: bool,
    ) -> None:
        """Copy an entry to the dead-letter stream of its shard with why (each of ``records``:
        one for an entry, one per request of a pack that fails), in one round trip however
        many records there are.

        ``ack_now`` acks and deletes the entry here, for entries nobody can be answered for;
        otherwise the replier acks it after telling the caller.
        """
        dead = keys.shard_of(stream).dead  # the stream's shard: one slot
        at_ms = int(time.time() * 1000)
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for record in records:
                fields: dict[Any, Any] = {"stream": stream, "entry_id": entry_id,
                                          "at_ms": at_ms, **record}
                pipe.xadd(dead, fields)
            if ack_now:
                pipe.xack(stream, GROUP, entry_id)
                pipe.xdel(stream, entry_id)
            pipe.execute()

    def dead_letters(
        self, keys: Keys, start: str, end: str, limit: int
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Records of the serving's dead-letter stream from ``start`` to ``end`` (ids)."""
        with redis_errors(self.url):
            raw = self.redis.xrange(keys.dead, start, end, count=limit)
        return cast(list[tuple[bytes, dict[bytes, bytes]]], raw or [])

    def newest_dead_letter(self, keys: Keys) -> str | None:
        """The id of the serving shard's newest dead letter, None when it has none."""
        with redis_errors(self.url):
            raw = cast(StreamEntries, self.redis.xrevrange(keys.dead, "+", "-", count=1))
        return text(raw[0][0]) if raw else None

    def replay_dead_letter(
        self, keys: Keys, dead_id: str, stream: str, requests: Sequence[tuple[bytes, bytes, int]]
    ) -> list[str] | None:
        """Queue a dead letter's requests (header, payload, items) again, one entry each, and
        drop the record, atomically (replay.lua); returns the new entry ids, or None when the
        record is gone (replayed or dropped meanwhile) or names another stream by now.

        ``stream`` must be a request stream of ``keys``' shard, and each item count an int
        from 1 to its payload's length: the caller checked both (ops/deadletter.py)."""
        batch_key, priority = keys.parse_stream(stream)
        args: list[Any] = [dead_id, GROUP, batch_key, priority, PRIORITY_AGE_MS]
        for header, payload, n in requests:
            args += [header, payload, n]
        script_keys = [keys.dead, stream, keys.queued, keys.seen, keys.ready, keys.wake,
                       keys.depth]
        with redis_errors(self.url):
            new_ids = self._replay(keys=script_keys, args=args)
        return [text(i) for i in new_ids] if new_ids else None

    def drop_dead_letter(self, keys: Keys, dead_id: str) -> bool:
        with redis_errors(self.url):
            return bool(self.redis.xdel(keys.dead, dead_id))

    def config(self, keys: Keys) -> dict[str, str]:
        with redis_errors(self.url):
            return texts(self.redis.hgetall(keys.config), "replace")

    def set_config(self, keys: Keys, options: Mapping[str, Any]) -> None:
        """Store run-time overrides, and show them in the declared options at once."""
        fields: dict[Any, Any] = {k: str(v) for k, v in options.items()}
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(keys.config, mapping=fields)
            pipe.hset(keys.meta, mapping=fields)
            pipe.execute()

    def declare(self, keys: Keys, options: Mapping[str, Any]) -> None:
        """Publish a serving's options (clients read codec and max_queue from them)."""
        with redis_errors(self.url):
            self.redis.hset(keys.meta, mapping={k: str(v) for k, v in options.items()})

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
            pipe.execute()

    def leave(self, keys_list: Sequence[Keys], consumer: str) -> None:
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(worker_key(keys_list[0].prefix, consumer))
            for keys in keys_list:
                pipe.zrem(keys.workers, consumer)
            pipe.execute()

"""The consumer side's writes of a finished batch: events, replies and acks in one round trip
(``reply_and_ack``), with the next wake read sent behind them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

from redis.exceptions import NoScriptError

from queueserve.broker import raw
from queueserve.broker.common import ack_arguments
from queueserve.broker.connect import is_cluster
from queueserve.broker.core import BrokerCore
from queueserve.broker.reads import PendingRead, Reads, WakeRead
from queueserve.broker.redis_errors import redis_errors
from queueserve.broker.urls import redact_url
from queueserve.errors import RedisUnavailable
from queueserve.wire.cache import STATS_TTL_MS
from queueserve.wire.job_record import MAX_JOB_BYTES
from queueserve.wire.keys import Keys
from queueserve.wire.timing import DURABLE_WAIT_MS

log = logging.getLogger(__name__)


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


def _drop_job_failures(out: list[Any], job_writes: range) -> None:
    """A job write Redis refused (other than for a missing script, which is loaded and sent
    again) is dropped with a warning: its callers have their answers in their inboxes, and
    holding the acks behind it would retry for ever."""
    for i in job_writes:
        failure = out[i]
        if isinstance(failure, Exception) and not isinstance(failure, NoScriptError):
            log.warning("a job's answer could not be kept in its record: %s", failure)
            out[i] = None


# What one round trip keeps of one record group's jobs: the group's key and job.lua's
# arguments for it after the limit (wire/job_record.py's job_writes).
GroupWrite = tuple[str, tuple[bytes, str, str]]


def _job_commands(sha: str, groups: Sequence[GroupWrite]) -> list[tuple[Any, ...]]:
    """job.lua calls, one per record group (each its own key: on a cluster, its own slot)."""
    return [("EVALSHA", sha, 1, key, MAX_JOB_BYTES, *writes) for key, writes in groups]


class CacheWrites(NamedTuple):
    """Results to cache (wire/cache.py): (stream, digest, value) each, the streams of the
    results too big to cache, and the entries' TTL (ms)."""

    entries: Sequence[tuple[str, bytes, bytes]] = ()
    too_big: Sequence[str] = ()
    ttl_ms: int = 0


NO_CACHE_WRITES = CacheWrites()


def _cache_commands(keys: Keys, cache: CacheWrites) -> list[tuple[Any, ...]]:
    """A SET of each entry (in its stream's slot, with its TTL), and the stats of each shard
    written to: entries stored, their bytes, results too big. None without entries."""
    if not (cache.entries or cache.too_big):
        return []
    counts: dict[str, list[int]] = {}  # stats hash -> [stored, bytes, too big]
    values: dict[str, bytes] = {}  # an item run twice in the round trip is written once
    for stream, digest, value in cache.entries:
        shard = keys.shard_of(stream)
        key = shard.cached(digest.hex())
        if key not in values:
            values[key] = value
            count = counts.setdefault(shard.cache_stats(), [0, 0, 0])
            count[0] += 1
            count[1] += len(value)
    for stream in cache.too_big:
        counts.setdefault(keys.shard_of(stream).cache_stats(), [0, 0, 0])[2] += 1
    ttl = max(1, cache.ttl_ms)
    commands: list[tuple[Any, ...]] = [("SET", k, v, "PX", ttl) for k, v in values.items()]
    for stats, (stored, size, too_big) in counts.items():
        for name, n in (("stored", stored), ("bytes", size), ("too_big", too_big)):
            if n:
                commands.append(("HINCRBY", stats, name, n))
        commands.append(("PEXPIRE", stats, STATS_TTL_MS))
    return commands


def _drop_cache_failures(out: list[Any], writes: range) -> None:
    """A cache write Redis refused (out of memory, a stats hash someone made another type, a
    forged count) is dropped: the answers went to their callers; the result is not cached."""
    for i in writes:
        if isinstance(out[i], Exception):
            log.warning("a result could not be cached: %s", out[i])
            out[i] = None


class Replies:
    """Replies and acks of finished entries: a part of the worker's ``Consumer``
    (``consumer.replies``), over the consumer's connection; a wake read sent behind a reply
    is its ``Reads``'s."""

    def __init__(self, core: BrokerCore, reads: Reads) -> None:
        self.url, self.redis, self._raw = core.url, core.redis, core._raw
        self._ack, self._job, self._load = core._ack, core._job, core._load
        self._moved, self._routed, self._node, self._target = (
            core._moved,
            core._routed,
            core._node,
            core._target,
        )
        self._reads = reads

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
        jobs: Sequence[GroupWrite] = (),
        cache: CacheWrites = NO_CACHE_WRITES,
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
        (the worker's ``Reclaims._forgotten``). On a cluster an inbox lives on another master
        than the stream: ``durable`` (the serving's option) then pushes the replies and waits
        for a replica of each inbox's master (``WAIT 1``) before any ack is sent, so a reply
        whose request was acked survives the loss of its master. When no replica acknowledged
        within DURABLE_WAIT_MS the acks are held (RedisUnavailable, retried: the replies go
        again and the clients keep the first of each).

        ``jobs``: answers kept in job record groups (job.lua), after the replies and before
        the acks, in the same round trip: an acked job's record holds its answer, and a job
        run again takes only its first answer (job.lua keeps nothing for a job that ended).
        ``cache``: results to cache, written after the replies in the same round trip.
        """
        durable_replies = durable and bool(replies) and is_cluster(self.redis)
        if durable_replies:
            self._push_replicated(replies, inbox_ttl_ms)
            replies = {}

        commands: list[tuple[Any, ...]] = [
            ("PUBLISH", channel, message) for channel, message in events
        ]
        commands += _pushes(replies, inbox_ttl_ms)
        cached = len(commands)
        commands += _cache_commands(keys, cache)
        cache_writes = range(cached, len(commands))
        scripted = len(commands)
        if jobs:
            commands += _job_commands(self._job.sha, jobs)
        job_writes = range(scripted, len(commands))
        commands += self._ack_commands(keys, acks)
        fused = then_read is not None and self._raw is not None and not durable_replies
        sent: raw.Sent | None = None

        def send() -> list[Exception]:
            nonlocal sent
            if fused and sent is None:
                assert self._raw is not None and then_read is not None
                sent = raw.send(
                    self._raw, commands + self._reads._wake_read_commands(keys, then_read)
                )
                out = sent.read(len(commands))
            else:
                out = self._send_commands(commands, scripted)
            _drop_job_failures(out, job_writes)
            _drop_cache_failures(out, cache_writes)
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
                    self._load(self._job)
                    failures = send()
                _drop_undeliverable(failures)
        except BaseException:
            if sent is not None:
                sent.abandon()
            raise
        if sent is None or then_read is None:
            return None
        return PendingRead(self._reads, keys, then_read, sent)

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
            script_keys, args = ack_arguments(keys.shard_of(stream), stream, runs)
            commands.append(("EVALSHA", self._ack.sha, len(script_keys), *script_keys, *args))
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

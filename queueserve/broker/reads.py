"""The consumer side's reads: ready streams (read.lua), the wake read fused behind a reply,
and the sweep that marks streams ready and forgets idle batch keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.exceptions import NoScriptError

from queueserve.broker import raw
from queueserve.broker.common import StreamEntries, names, text
from queueserve.broker.core import BrokerCore
from queueserve.broker.redis_errors import redis_errors
from queueserve.broker.wakes import IDLE_ROUNDS, WakeWatch
from queueserve.wire.keys import GROUP, Keys
from queueserve.wire.priority import PRIORITY_AGE_MS

log = logging.getLogger(__name__)

# Known batch keys one sweep call looks at: a sweep's cost per call is bounded whatever the
# number of keys, and a pass over n keys takes n / SWEEP_KEYS calls (one a second per reader).
SWEEP_KEYS = 200
# Streams of the active set one sweep call looks at: ack.lua takes out most streams left with
# nothing pending; the sweep takes out the rest (cancels, dead letters, a Redis restart).
SWEEP_STREAMS = 1000


class ReadOutcome:
    """What one read of the ready streams gave."""

    __slots__ = ("entries", "leads", "left", "more", "skipped", "wake_id")

    def __init__(
        self,
        wake_id: bytes,
        skipped: int,
        more: bool,
        left: int,
        entries: list[tuple[str, StreamEntries]],
        leads: frozenset[str] = frozenset(),
    ) -> None:
        self.wake_id = wake_id  # block on the wake stream after this id when nothing came
        self.skipped = skipped  # ready streams of keys the worker said were full
        self.more = more  # the room ran out before every ready stream was looked at
        self.left = left  # streams read from that still hold unread entries
        self.entries = entries
        # streams read with a lead (a quiet key's): their batch goes first
        self.leads = leads

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
    marks: Sequence[str]
    age_ms: int = PRIORITY_AGE_MS


class PendingRead:
    """A wake read sent behind a reply (``reply_and_ack(then_read=...)``): ``result`` blocks
    until it comes back; ``abandon`` drops its connection when it will never be read."""

    __slots__ = ("_broker", "_keys", "_read", "_sent")

    def __init__(self, broker: Reads, keys: Keys, read: WakeRead, sent: raw.Sent) -> None:
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


def _fields(flat: list[bytes]) -> dict[bytes, bytes]:
    if len(flat) == 6:  # an entry as enqueue.lua writes it (h, p, a): no slicing
        return {flat[0]: flat[1], flat[2]: flat[3], flat[4]: flat[5]}
    return dict(zip(flat[::2], flat[1::2], strict=True))


Unnamed = list[tuple[bytes, StreamEntries]]


def _read_outcome(out: list[Any]) -> tuple[ReadOutcome, Unnamed]:
    """read.lua's reply, and apart the entries of streams whose names are not UTF-8."""
    entries: list[tuple[str, StreamEntries]] = []
    unnamed: Unnamed = []
    for i in range(5, len(out), 2):
        read = [(e[0], _fields(e[1])) for e in out[i + 1]]
        try:
            entries.append((text(out[i]), read))
        except UnicodeDecodeError:
            unnamed.append((out[i], read))
    leads = frozenset(text(s, "replace") for s in out[4])
    return ReadOutcome(out[0], int(out[1]), bool(out[2]), int(out[3]), entries, leads), unnamed


class Reads:
    """Reading the ready streams, and keeping the group and the ready set in order: a part of
    the worker's ``Consumer`` (``consumer.reads``), over the consumer's connection."""

    def __init__(self, core: BrokerCore) -> None:
        self.url, self.redis, self.outage = core.url, core.redis, core.outage
        self._raw = core._raw
        # The scripts and the cluster routing of the connection read through
        self._read, self._sweep = core._read, core._sweep
        self._evalsha, self._moved, self._routed, self._node = (
            core._evalsha,
            core._moved,
            core._routed,
            core._node,
        )
        # Idle servings block together (broker/wakes.py): per wake stream, the blocking
        # reads in a row that came back empty. No watch on a cluster (one XREAD, one slot).
        self._idle_rounds: dict[str, int] = {}
        self._watch = None if self._raw is None else WakeWatch(self._raw, self.outage, self.url)

    def close(self) -> None:
        """Stop the wake watch (the consumer closes the connection)."""
        if self._watch is not None:
            self._watch.close()

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
        self,
        keys: Keys,
        consumer: str,
        budget: int,
        per_key: int,
        marks: Sequence[str],
        age_ms: int = PRIORITY_AGE_MS,
    ) -> ReadOutcome:
        """New entries for ``consumer`` from the streams that have unread work, most urgent
        first (read.lua, each priority level worth ``age_ms`` of waiting): about ``budget``
        items, ``per_key`` per batch key, none of the streams a full mark of ``marks`` names
        (``<priority><key>``: that key's at that priority and below), and keys that a
        ``-<key>`` mark names (held in part) after the others. Idle keys are not touched."""
        keys_, args = self._read_arguments(keys, consumer, budget, per_key, marks, age_ms)
        with redis_errors(self.url):
            out = self._evalsha(self._read, keys_, args)
        return self._outcome(keys, out)

    def wait_then_read(self, keys: Keys, read: WakeRead) -> ReadOutcome:
        """Block until a stream of the serving becomes ready after wake id ``read.after`` (or
        ``read.block_ms`` passed), then ``read_ready``: one round trip. Redis runs a
        connection's next command only once its blocking command returned, so the read starts
        the moment work arrives, and an idle worker's answer costs one wake-up instead of a
        wake-up and another round trip.

        A serving with no work since it started, or none in its last IDLE_ROUNDS reads, blocks
        instead with every other idle serving of this broker, on one connection
        (broker/wakes.py), and reads once woken; a wait that times out found nothing ready,
        and reads nothing."""
        watch = self._watch
        if watch is not None and self._idle_rounds.get(keys.wake, IDLE_ROUNDS) >= IDLE_ROUNDS:
            woke = watch.wait(keys.wake, keys.ready, read.after, read.block_ms / 1000)
            if woke is False:
                return ReadOutcome(read.after, 0, False, 0, [])
            if woke:  # (None: no watch covers the stream yet: block here)
                outcome = self.read_ready(
                    keys, read.consumer, read.budget, read.per_key, read.marks, read.age_ms
                )
                self._count_round(keys, outcome)
                return outcome
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
            keys, read.consumer, read.budget, read.per_key, read.marks, read.age_ms
        )
        return [
            ("XREAD", "COUNT", 1, "BLOCK", read.block_ms, "STREAMS", keys.wake, read.after),
            ("EVALSHA", self._read.sha, len(keys_), *keys_, *args),
        ]

    def _wake_read_outcome(self, keys: Keys, read: WakeRead, out: Any) -> ReadOutcome:
        """read.lua's reply to a wake read (the caller maps redis-py's errors)."""
        if isinstance(out, NoScriptError):  # Redis restarted or flushed its scripts
            keys_, args = self._read_arguments(
                keys, read.consumer, read.budget, read.per_key, read.marks, read.age_ms
            )
            out = self._evalsha(self._read, keys_, args)
        elif isinstance(out, Exception):
            self._moved(keys.wake, out)
            raise out
        outcome = self._outcome(keys, out)
        self._count_round(keys, outcome)
        return outcome

    def _count_round(self, keys: Keys, outcome: ReadOutcome) -> None:
        """Count a blocking read that found nothing; one that found work ends the count, and
        the serving blocks on its own again (one dict update a blocking read)."""
        rounds = self._idle_rounds.get(keys.wake, IDLE_ROUNDS)  # none yet: idle since start
        if outcome.entries or not outcome.drained:
            self._idle_rounds[keys.wake] = 0
            if rounds >= IDLE_ROUNDS and self._watch is not None:
                self._watch.forget(keys.wake)
        else:
            self._idle_rounds[keys.wake] = rounds + 1

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
                    record: dict[Any, Any] = {
                        "stream": stream,
                        "entry_id": entry_id,
                        "at_ms": now_ms,
                        "reason": reason,
                    }
                    record.update((b"field:" + name, value) for name, value in fields.items())
                    pipe.xadd(keys.dead, record)
                pipe.xack(stream, GROUP, *(e[0] for e in entries))
                pipe.xdel(stream, *(e[0] for e in entries))
            pipe.execute()
        log.warning(
            "serving %s: dead-lettered %d entries: %s",
            keys.name,
            sum(len(e) for _, e in unnamed),
            reason,
        )
        return outcome

    @staticmethod
    def _read_arguments(
        keys: Keys, consumer: str, budget: int, per_key: int, marks: Sequence[str], age_ms: int
    ) -> tuple[list[str], list[Any]]:
        stream_prefix, priority_prefix = keys.stream_prefixes
        return [keys.ready, keys.active, keys.wake, keys.withdrawn], [
            GROUP,
            consumer,
            age_ms,
            budget,
            per_key,
            stream_prefix,
            priority_prefix,
            *marks,
        ]

    def sweep(
        self,
        keys: Keys,
        idle_ttl_ms: int,
        declared: Sequence[str],
        start: int = 0,
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
                args=[
                    GROUP,
                    PRIORITY_AGE_MS,
                    idle_ttl_ms,
                    stream_prefix,
                    priority_prefix,
                    start,
                    chunk,
                    SWEEP_STREAMS,
                    *declared,
                ],
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
            stream: [
                (text(c["name"], "surrogateescape"), int(c["pending"]))
                for c in summary.get("consumers") or []
            ]
            for stream, summary in zip(streams, out, strict=True)
            if isinstance(summary, dict)
        }

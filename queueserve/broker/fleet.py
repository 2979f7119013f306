"""What the dashboard reads besides what it asks of the Admin it holds: a serving's workers
with their heartbeats, their registry records (host, pid, partition, device, and the batches
and items they ran), and a page of its queues (``top_queues``) that costs the same whatever
the number of batch keys."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from queueserve.broker.admin import Admin, StreamDepth, _entry_ms, _streams_with_work, hash_count
from queueserve.broker.common import names, text
from queueserve.broker.redis_errors import raise_but_wrong_type, redis_errors
from queueserve.wire.keys import GROUP, Keys, worker_key
from queueserve.wire.shards import check_shards
from queueserve.wire.timing import ALIVE_WITHIN_S

MAX_WORKERS = 200  # shown per serving: the most recent heartbeats
# Fields of a shard's depth hash (batch key -> items) read to rank its keys by items: one
# HSCAN call of this COUNT, so with more keys with work than this the ranking is among those
# read (Queues.ranked says how many), and what a page costs stays the same.
DEPTH_RANKED = 1000
BULK = 1000  # commands per round trip of ``backlogs``


@dataclass(slots=True)
class Queues:
    """A page of a serving's queues: the streams read (``streams``), the items admitted of
    their batch keys (``items``), and counts of everything, shown or not."""

    streams: list[StreamDepth] = field(default_factory=list)
    items: dict[str, int] = field(default_factory=dict)  # batch key -> items (every priority)
    keys_with_work: int = 0  # batch keys holding items admitted and not answered
    streams_waiting: int = 0  # streams holding entries no worker read yet
    streams_pending: int = 0  # streams that may hold entries read and not acked
    known_keys: int = 0  # batch keys ever enqueued to and not yet forgotten
    ranked: int = 0  # batch keys the ranking by items saw

    def counts(self) -> dict[str, int]:
        return {
            "keys_with_work": self.keys_with_work,
            "streams_waiting": self.streams_waiting,
            "streams_pending": self.streams_pending,
            "known_keys": self.known_keys,
            "ranked_by_items": self.ranked,
            "streams_shown": sum(1 for s in self.streams if s.length or s.pending),
        }


@dataclass(slots=True)
class Backlog:
    """A serving's backlog as Redis holds it, every shard summed: no worker needed."""

    name: str
    queued: int  # items admitted and not yet answered (the admission counters)
    live_workers: int  # consumers whose heartbeat is at most ALIVE_WITHIN_S old
    dead_letters: int


class Fleet:
    """The dashboard's reads: its own (workers, their records, a page of queues, backlogs),
    and those of the ``Admin`` it holds (``admin``: listings, shards, dead letters, options),
    over the admin's connection."""

    def __init__(
        self, url: str, *, client: redis.Redis | None = None, owner: str | None = None
    ) -> None:
        self.admin = admin = Admin(url, client=client, owner=owner)
        self.url, self.redis, self.close = admin.url, admin.redis, admin.close
        # What the dashboard asks of the admin, bound once
        self.meta, self.config, self.set_config = admin.meta, admin.config, admin.set_config
        self.listing, self.shards = admin.listing, admin.shards
        self.priority_items, self.dead_letter_depths = (
            admin.priority_items,
            admin.dead_letter_depths,
        )
        self.known_keys = admin.known_keys

    def backlogs(self, prefix: str, servings: Sequence[str]) -> list[Backlog]:
        """The backlog of each of ``servings``: a few commands per serving (per shard), in
        round trips of at most BULK commands, whatever the number of batch keys."""
        shards = self._bulk([("hget", Keys(prefix, s).meta, "shards") for s in servings])
        counts = [_shard_count(raw) for raw in shards]
        sharded = [(i, n) for i, n in enumerate(counts) if n > 1]
        confirmed = self._bulk(
            [("hget", Keys(prefix, servings[i]).last_shard(n).meta, "shards") for i, n in sharded]
        )
        for (i, _), raw in zip(sharded, confirmed, strict=True):
            if raw != shards[i]:  # the count both declare, or shard 0 alone (Admin.shards)
                counts[i] = 1
        now_ms = int(time.time() * 1000)
        commands: list[tuple[Any, ...]] = []
        for name, count in zip(servings, counts, strict=True):
            keys = Keys(prefix, name)
            commands.append(("zcount", keys.workers, now_ms - ALIVE_WITHIN_S * 1000, "+inf"))
            for shard in keys.sharded(count):
                commands += [("get", shard.queued), ("xlen", shard.dead)]
        replies = iter(self._bulk(commands))
        out = []
        for name, count in zip(servings, counts, strict=True):
            live = _int(next(replies))
            queued = dead = 0
            for _ in range(count):
                raw = next(replies)
                queued += hash_count(text(raw, "replace")) if isinstance(raw, bytes) else 0
                dead += _int(next(replies))
            out.append(Backlog(name, queued, live, dead))
        return out

    def _bulk(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Each command's reply, an error for a key of another type (anyone may write one)
        as None, in pipelines of at most BULK commands."""
        out: list[Any] = []
        for start in range(0, len(commands), BULK):
            with redis_errors(self.url):
                pipe = self.redis.pipeline(transaction=False)
                for name, *args in commands[start : start + BULK]:
                    getattr(pipe, name)(*args)
                replies = raise_but_wrong_type(pipe.execute(raise_on_error=False))
            out += [None if isinstance(r, Exception) else r for r in replies]
        return out

    def workers(self, keys: Keys) -> list[tuple[str, int]]:
        """(consumer, last heartbeat in unix ms) of a serving's workers, newest first."""
        with redis_errors(self.url):
            raw = self.redis.zrevrange(keys.workers, 0, MAX_WORKERS - 1, withscores=True)
        out = []
        for member, score in cast(list[tuple[bytes, float]], raw):
            for name in names([member]):  # a member that is not UTF-8 is nobody's: skipped
                out.append((name, int(score) if math.isfinite(score) else 0))
        return out

    def worker_records(
        self, prefix: str, consumers: Sequence[str], fields: Sequence[str]
    ) -> list[dict[str, str]]:
        """These ``fields`` of each consumer's registry record, in order (HMGET: a record
        holds a field per serving of its partition, and a page reads one serving's): those
        it holds, none once it expired or when its key holds another type (anyone may write
        one: it must not fail every serving's row)."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for consumer in consumers:
                pipe.hmget(worker_key(prefix, consumer), list(fields))
            replies = raise_but_wrong_type(pipe.execute(raise_on_error=False))
        return [
            {f: text(v, "replace") for f, v in zip(fields, raw, strict=True) if v is not None}
            if isinstance(raw, list)
            else {}
            for raw in replies
        ]

    def top_queues(self, shards: Sequence[Keys], top: int) -> Queues:
        """The streams of each shard worth showing, and counts of all: the ``top`` streams
        next in the workers' order (the ready set's first: waiting longest) and the ``top``
        read longest ago (the active set's first), and the streams of the ``top`` batch keys
        holding the most items (among DEPTH_RANKED keys of the depth hash). Three round trips
        per shard of at most a constant times ``top`` commands, whatever Redis holds."""
        out = Queues()
        for keys in shards:
            self._top_of_shard(keys, top, out)
        return out

    def _top_of_shard(self, keys: Keys, top: int, out: Queues) -> None:
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrange(keys.ready, 0, top - 1)
            pipe.zrange(keys.active, 0, top - 1)
            pipe.hlen(keys.depth)
            pipe.zcard(keys.ready)
            pipe.zcard(keys.active)
            pipe.zcard(keys.seen)
            pipe.hscan(keys.depth, 0, count=DEPTH_RANKED)
            ready, active, with_work, waiting, pending, known, scanned = raise_but_wrong_type(
                pipe.execute(raise_on_error=False)
            )
        out.keys_with_work += _int(with_work)
        out.streams_waiting += _int(waiting)
        out.streams_pending += _int(pending)
        out.known_keys = max(out.known_keys, _int(known))
        sample = _depths(scanned)
        out.ranked += len(sample)
        heavy = sorted(sample, key=lambda k: (-sample[k], k))[:top]
        marks = [m if isinstance(m, list) else [] for m in (ready, active)]
        streams = [s for _, s in _streams_with_work(keys, *marks)]
        streams += [s for k in heavy for s in keys.streams(k) if s not in streams]
        rows = self._stream_depths(keys, streams)
        out.streams += rows
        shown = sorted({d.key for d in rows})
        unknown = [k for k in shown if k not in sample]
        if unknown:  # keys shown for their age, not among those the ranking read
            with redis_errors(self.url):
                pipe = self.redis.pipeline(transaction=False)
                pipe.hmget(keys.depth, unknown)
                [values] = raise_but_wrong_type(pipe.execute(raise_on_error=False))
            for k, v in zip(unknown, values if isinstance(values, list) else [], strict=False):
                sample[k] = hash_count(text(v, "replace")) if v else 0
        for key in shown:
            out.items[key] = out.items.get(key, 0) + sample.get(key, 0)

    def _stream_depths(self, keys: Keys, streams: list[str]) -> list[StreamDepth]:
        """XLEN of each stream, then the pending count and first entry of those that hold
        entries (two round trips; a stream of another type holds none)."""
        if not streams:
            return []
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for stream in streams:
                pipe.xlen(stream)
            lengths = pipe.execute(raise_on_error=False)
            held = [
                (s, n) for s, n in zip(streams, lengths, strict=True) if isinstance(n, int) and n
            ]
            pipe = self.redis.pipeline(transaction=False)
            for stream, _ in held:
                pipe.xpending(stream, GROUP)
                pipe.xrange(stream, count=1)
            out = pipe.execute(raise_on_error=False)
        rows = []
        for i, (stream, length) in enumerate(held):
            summary, first = out[2 * i : 2 * i + 2]
            key, priority = keys.parse_stream(stream)
            rows.append(
                StreamDepth(
                    keys,
                    key,
                    priority,
                    length,
                    int(summary["pending"]) if isinstance(summary, dict) else 0,
                    _entry_ms(first[0][0]) if isinstance(first, list) and first else 0,
                )
            )
        return rows


def _shard_count(raw: Any) -> int:
    """A meta hash's ``shards`` as Admin.shards takes it: 1 when none, or not a count."""
    try:
        return check_shards(int(text(raw))) if isinstance(raw, bytes) else 1
    except ValueError:
        return 1


def _int(reply: Any) -> int:
    return reply if isinstance(reply, int) and reply > 0 else 0


def _depths(scanned: Any) -> dict[str, int]:
    """Batch key -> items of an HSCAN reply of a depth hash (anyone may write one: a field
    that is not UTF-8 or a value that is not a count is skipped)."""
    if not isinstance(scanned, (list, tuple)) or len(scanned) != 2:
        return {}
    fields = scanned[1]
    found: dict[str, int] = {}
    for field_name, value in fields.items() if isinstance(fields, dict) else ():
        for name in names([field_name]):
            n = hash_count(text(value, "replace"))
            if n and len(name) <= 1000:
                found[name] = n
    return found

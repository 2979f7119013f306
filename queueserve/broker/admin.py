"""The admin side: what operators read and change (``queueserve stats``, ``config``,
``dead-letters``) and the worker's metrics: queue depths, key stats, shards, dead letters.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from queueserve.broker.common import (
    add_listing,
    declared_names,
    listing,
    register_servings,
    text,
    texts,
)
from queueserve.broker.core import BrokerCore
from queueserve.broker.dead_letters import DeadLetterShelf
from queueserve.broker.redis_errors import raise_but_wrong_type, redis_errors
from queueserve.options.serving_options import followers
from queueserve.wire.keys import (
    GROUP,
    MAX_LISTED_SERVINGS,
    Keys,
    is_serving_name,
    serving_of,
    tagged_pattern,
)
from queueserve.wire.priority import MAX_PRIORITY
from queueserve.wire.shards import check_shards

log = logging.getLogger(__name__)

_PRIORITY_FIELDS = [str(p) for p in range(MAX_PRIORITY + 1)]
# Idle batch keys `queueserve stats` shows, the last enqueued to; keys with work are all shown.
STATS_RECENT_KEYS = 20


def _streams_with_work(
    keys: Keys, ready: Sequence[bytes], active: Sequence[bytes]
) -> list[tuple[str, str]]:
    """(batch key, stream) of the streams named by a shard's ready members (``<N><K>``) and
    active set, in name order; members anyone could have written that name no request
    stream of this shard are left out."""
    names = {
        keys.stream(m[1:], int(m[0]))
        for m in (text(r, "replace") for r in ready)
        if m[:1].isascii() and m[:1].isdigit()
    }
    names.update(text(a, "replace") for a in active)
    found = []
    for name in sorted(names):
        try:
            if keys.shard_of(name) is keys:
                found.append((keys.batch_key_of(name), name))
        except ValueError:
            continue
    return found


@dataclass(slots=True)
class KeyStats:
    key: str
    queued_items: int
    last_seen_ms: int
    waiting: int = 0  # entries not read by any worker
    pending: int = 0  # entries read and not acked
    oldest_age_ms: int = 0  # of the oldest entry still in its streams; 0 = none
    read: int = 0  # entries the consumer group read so far


@dataclass(slots=True)
class StreamDepth:
    """One request stream of a serving's shard, as its metrics read it."""

    keys: Keys
    key: str  # batch key
    priority: int
    length: int  # entries in it: waiting and pending
    pending: int  # read and not acked
    first_ms: int  # when its oldest entry was enqueued (Redis's clock), unix ms; 0 = none


def by_priority(
    items: Sequence[tuple[Keys, int, dict[int, int]]], depths: Sequence[StreamDepth], now_ms: int
) -> dict[int, tuple[int, int | None]]:
    """Per priority holding work, over shards: items admitted and not answered (every batch
    key, from ``priority_items``) and the age in ms of its oldest request not answered (from
    ``queue_depths``; None when none of its streams holds an entry)."""
    counts: Counter[int] = Counter()
    for _, _, found in items:
        counts.update(found)
    oldest: dict[int, int] = {}
    for d in depths:
        if d.first_ms:
            oldest[d.priority] = max(oldest.get(d.priority, 0), max(0, now_ms - d.first_ms))
    return {p: (counts[p], oldest.get(p)) for p in sorted(set(counts) | set(oldest))}


def _entry_ms(entry_id: Any) -> int:
    """The milliseconds part of a stream entry id (XADD's, Redis's clock)."""
    ms = text(entry_id, "replace").partition("-")[0]
    return int(ms) if ms.isascii() and ms.isdigit() and len(ms) <= 15 else 0


def _ms(score: float | None) -> int:
    """A unix-ms score read from a sorted set anyone may write: 0 unless finite."""
    return int(score) if score is not None and math.isfinite(score) else 0


def hash_count(raw: str) -> int:
    """An item count read from a hash anyone may write: 0 unless a non-negative int (ASCII
    digits: str.isdigit takes '²', which int() refuses, and past 4,300 digits int() refuses
    any)."""
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else 0


def _add_stream(row: KeyStats, length: Any, groups: Any, first: Any, now_ms: int) -> None:
    """Add one priority stream's XLEN, XINFO GROUPS and first entry to a key's row."""
    if not isinstance(length, int) or not length:
        return
    group = (
        next((g for g in groups if text(g["name"], "replace") == GROUP), None)
        if (isinstance(groups, list))
        else None
    )
    pending = int(group["pending"]) if group else 0
    row.pending += pending
    row.waiting += length - pending
    row.read += int(group.get("entries-read") or 0) if group else 0
    if isinstance(first, list) and first:
        born = int(text(first[0][0]).split("-")[0])
        row.oldest_age_ms = max(row.oldest_age_ms, now_ms - born)


def summed(rows: Iterable[KeyStats]) -> list[KeyStats]:
    """Rows of the same batch key (of several shards) summed: ages the oldest, last seen the
    latest."""
    totals: dict[str, KeyStats] = {}
    for row in rows:
        total = totals.setdefault(row.key, KeyStats(row.key, 0, 0))
        total.queued_items += row.queued_items
        total.last_seen_ms = max(total.last_seen_ms, row.last_seen_ms)
        total.waiting += row.waiting
        total.pending += row.pending
        total.oldest_age_ms = max(total.oldest_age_ms, row.oldest_age_ms)
        total.read += row.read
    return list(totals.values())


class Admin(BrokerCore):
    """The operators' reads and changes of one Redis deployment; its dead letters are a part
    it holds (``shelf``, broker/dead_letters.py)."""

    def __init__(
        self, url: str, *, client: redis.Redis | None = None, owner: str | None = None
    ) -> None:
        super().__init__(url, client=client, owner=owner)
        self.shelf = shelf = DeadLetterShelf(self)
        # What ops/ and the dashboard call of it, bound once
        self.dead_letter_depths, self.dead_letters = shelf.dead_letter_depths, shelf.dead_letters
        self.newest_dead_letter = shelf.newest_dead_letter
        self.replay_dead_letter, self.drop_dead_letter = (
            shelf.replay_dead_letter,
            shelf.drop_dead_letter,
        )

    def queue_depths(self, keys_list: Sequence[Keys]) -> list[StreamDepth]:
        """A row for every stream holding entries: those in the ready set (unread entries) or
        the active set (pending ones). What it reads grows with the streams that hold work,
        never with the keys ever seen. Acked entries are deleted, so length - pending is what
        waits to be read, and the first entry is the oldest not answered."""
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
                pipe.xrange(stream, count=1)
            out = pipe.execute(raise_on_error=False)
        rows = []
        for i, (keys, key, stream) in enumerate(streams):
            length, summary, first = out[3 * i : 3 * i + 3]
            rows.append(
                StreamDepth(
                    keys,
                    key,
                    keys.parse_stream(stream)[1],
                    length if isinstance(length, int) else 0,
                    int(summary["pending"]) if isinstance(summary, dict) else 0,
                    _entry_ms(first[0][0]) if isinstance(first, list) and first else 0,
                )
            )
        return rows

    def priority_items(self, keys_list: Sequence[Keys]) -> list[tuple[Keys, int, dict[int, int]]]:
        """Each shard's admission counter (items admitted and not yet acked, of every key and
        priority: what ``max_queue`` bounds), and those items per priority as enqueue.lua
        counts them in the pdepth hash: priorities holding none are left out. Each is clamped
        to the shard's counter: the hash may hold drift (producers or workers that predate
        it, forged fields) until that counter next reaches 0. A key of another type holds
        none."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for keys in keys_list:
                pipe.get(keys.queued)
                # the ten fields a count can be in, not HGETALL: anyone may add a million
                pipe.hmget(keys.pdepth, _PRIORITY_FIELDS)
            raw = raise_but_wrong_type(pipe.execute(raise_on_error=False))
        out = []
        for i, keys in enumerate(keys_list):
            queued, fields = raw[2 * i : 2 * i + 2]
            total = hash_count(text(queued, "replace")) if isinstance(queued, bytes) else 0
            found: dict[int, int] = {}
            if isinstance(fields, list):  # else WRONGTYPE: a key of another type holds none
                for priority, value in enumerate(fields):
                    n = min(hash_count(text(value, "replace")), total) if value else 0
                    if n:
                        found[priority] = n
            out.append((keys, total, found))
        return out

    def servings(self, prefix: str) -> list[str]:
        """Names of the servings workers list under ``prefix`` (``listing``), by name."""
        return sorted(self.listing(prefix)[0])

    def listing(self, prefix: str, limit: int = MAX_LISTED_SERVINGS) -> tuple[dict[str, int], int]:
        """(serving -> when a worker last declared it or beat for it, unix ms; how many the
        registry lists) of the servings registry P:servings: at most ``limit``, the most
        recently refreshed, in two commands whatever Redis holds (never a SCAN)."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            add_listing(pipe, prefix, int(time.time() * 1000), limit)
            return listing(raise_but_wrong_type(pipe.execute(raise_on_error=False)))

    def declared(self, keys_list: Sequence[Keys]) -> list[bool]:
        """Whether a worker declared each serving (its meta hash exists: what the listings
        found by a SCAN before the registry), in one round trip: a serving is named without
        listing them all."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for keys in keys_list:
                pipe.exists(keys.meta)
            found = pipe.execute()
        return [reply == 1 for reply in found]

    def rebuild_listing(self, prefix: str) -> list[str]:
        """List in the registry every serving whose meta hash a worker wrote under ``prefix``,
        found by a SCAN of the keyspace (once, for an operator: servings of workers that
        predate the registry), and return their names. Each is listed as refreshed now, and
        leaves the listings SERVINGS_FORGET_S later unless a worker refreshes it."""
        with redis_errors(self.url):
            scanned = self.redis.scan_iter(match=tagged_pattern(prefix, "meta"), count=1000)
            names = [n for n in declared_names(scanned) if is_serving_name(n)]
        declared = self.declared([Keys(prefix, n) for n in names])
        found = [n for n, ok in zip(names, declared, strict=True) if ok]
        if found:
            with redis_errors(self.url):
                pipe = self.redis.pipeline(transaction=False)
                register_servings(pipe, [Keys(prefix, n) for n in found], int(time.time() * 1000))
                pipe.execute()
        return found

    def undeclared_waiting(self, prefix: str, declared: Collection[str]) -> list[tuple[str, int]]:
        """(serving, items admitted) for each serving with requests waiting that no worker
        ever declared (clients with wait_for_worker=True, a typo among them); ``declared``:
        what ``servings`` found, so the meta keys are scanned once per command."""
        known = set(declared)
        candidates = []
        with redis_errors(self.url):
            for key in self.redis.scan_iter(match=tagged_pattern(prefix, "queued"), count=500):
                serving = serving_of(text(key, "replace"))
                if serving is not None and serving not in known:
                    candidates.append((serving, key))
            pipe = self.redis.pipeline(transaction=False)
            for _, key in candidates:
                pipe.get(key)
            counts = raise_but_wrong_type(pipe.execute(raise_on_error=False))
        found = [
            (serving, hash_count(text(items, "replace")) if isinstance(items, bytes) else 0)
            for (serving, _), items in zip(candidates, counts, strict=True)
        ]
        return sorted((serving, items) for serving, items in found if items > 0)

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
            depth = {k: hash_count(v) for k, v in texts(depth_raw, "replace").items()}
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
            log.warning(
                "serving %s: ignored shards=%r in its meta hash (not a count its workers declared)",
                keys.name,
                raw,
            )
        return keys.sharded(max(1, count))

    def summed_key_stats(self, shards: Sequence[Keys]) -> list[KeyStats]:
        """``key_stats`` of every shard, summed per batch key (``summed``)."""
        return summed(row for keys in shards for row in self.key_stats(keys))

    def set_config(self, keys: Keys, options: Mapping[str, Any]) -> None:
        """Store run-time overrides, and show them in the declared options at once, with the
        fields that follow from them as the workers will declare them (``pack_items`` from
        ``batch_size``): a worker that finds its new declaration already there writes nothing
        and logs nothing (worker/pipeline/declaration.py). A follower an operator deleted
        stays deleted (docs/operations.md, "Upgrading workers"): the meta hash is watched
        from the read of which followers it holds to the write."""
        fields: dict[Any, Any] = {k: str(v) for k, v in options.items()}
        follow = {k: str(v) for k, v in followers(options).items()}

        def write(pipe: Any) -> None:
            held = pipe.hmget(keys.meta, list(follow)) if follow else []
            kept = {
                k: v for (k, v), was in zip(follow.items(), held, strict=True) if was is not None
            }
            pipe.multi()
            pipe.hset(keys.config, mapping=fields)
            pipe.hset(keys.meta, mapping={**fields, **kept})

        with redis_errors(self.url):
            self.redis.transaction(write, keys.meta)

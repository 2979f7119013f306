"""What the dashboard shows, read from Redis (broker/fleet.py): one snapshot per poll, and
each serving's health (health.py): its throughput, batch sizes, error rate and latency of the
last minutes, from the figures of that serving each partition's heartbeat carries
(wire/figures.py), and a status from documented rules.

A snapshot holds one page of servings (MAX_SERVINGS, by name, those whose name holds the
filter), and says how many there are in all and how many match, so a wrong prefix (none) or
a big deployment (more than a page) is told, never shown as an empty or a whole one.

What a snapshot costs is bounded by what it shows, never by what Redis holds: the servings
come from the registry workers keep (P:servings: one read of at most MAX_LISTED_SERVINGS, no
SCAN), and each serving's queues are a page too, the TOP_KEYS batch keys with the most items
(ranked among DEPTH_RANKED keys with work read of its depth hash) and the TOP_KEYS streams
next in the workers' order (waiting longest) and read longest ago, with the counts of all of
them (broker/fleet.py, ``top_queues``). ``Snapshots`` shares one computation among the
callers of a second (docs/operations.md, "Dashboard").
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from queueserve.broker.admin import StreamDepth, by_priority
from queueserve.broker.fleet import Fleet
from queueserve.broker.urls import redact_url
from queueserve.dashboard.health import Histories, Sample, max_latency_of, status
from queueserve.errors import RedisCommandError
from queueserve.ops.deadletter import DeadLetters
from queueserve.options.serving_options import ServingOptions, StepOptions
from queueserve.wire.figures import HELD_FIELD, Figures, field_of, held_keys, parse
from queueserve.wire.keys import Keys
from queueserve.wire.timing import ALIVE_WITHIN_S

MAX_SERVINGS = 100
MAX_DEAD_LETTERS = 50
TOP_KEYS = 10  # per serving: batch keys shown by items, and streams shown by age
SNAPSHOT_TTL_S = 1.0  # an overview computed this recently answers every caller of that page
MAX_SNAPSHOTS = 32  # pages (offset, filter) kept at once
RECORD_FIELDS = ("host", "pid", "partition", "device")  # and the serving's figures field


def option_defaults() -> dict[str, str]:
    """Each option's default as a worker declares it in a meta hash (``str`` of the value):
    the page shows the options that differ from it first."""
    return {
        name: str(spec.get_default(call_default_factory=True))
        for model in (StepOptions, ServingOptions)
        for name, spec in model.model_fields.items()
    }


class Board:
    """The dashboard's reads of one prefix; safe to call from several threads."""

    def __init__(self, fleet: Fleet, prefix: str) -> None:
        self.fleet = fleet
        self.prefix = prefix
        self._histories = Histories()
        self._defaults = option_defaults()

    @property
    def redis(self) -> str:
        """The Redis URL read, its password hidden: the page shows it."""
        return redact_url(self.fleet.url)

    def overview(self, offset: int = 0, name_filter: str = "") -> dict[str, Any]:
        """A snapshot of the servings ``offset`` .. ``offset + MAX_SERVINGS`` by name of
        those whose name holds ``name_filter``; ``total``: how many servings there are,
        ``matched``: how many hold the filter."""
        now = time.time()
        listed, total = self.fleet.listing(self.prefix)
        every = sorted(listed)
        matched = [name for name in every if name_filter in name]
        page = matched[offset : offset + MAX_SERVINGS]
        return {
            "now_ms": int(now * 1000),
            "prefix": self.prefix,
            "redis": self.redis,
            "total": max(total, len(every)),
            "matched": len(matched),
            "offset": offset,
            "limit": MAX_SERVINGS,
            "filter": name_filter,
            "defaults": self._defaults,
            "servings": [self._readable(name, listed[name], now) for name in page],
        }

    def _readable(self, name: str, listed_ms: int, now: float) -> dict[str, Any]:
        """A serving's row. One whose keys Redis refuses to read (a key of another type under
        its name: anyone may write one) says why, empty, and the page shows the others."""
        try:
            row = self._serving(name, now)
        except RedisCommandError as e:
            row = {
                "name": name,
                "error": str(e),
                **{part: {} for part in ("options", "overrides", "queue_counts", "health")},
                **{part: [] for part in ("workers", "queues", "priorities", "history")},
                "dead_letters": 0,
            }
        # When a worker last declared it or beat for it (the registry's): a serving whose
        # workers are gone says so until it leaves the listing
        row["listed_age_ms"] = max(0, int(now * 1000) - listed_ms)
        return row

    def _serving(self, name: str, now: float) -> dict[str, Any]:
        keys = Keys(self.prefix, name)
        shards = self.fleet.shards(keys)
        workers = self.fleet.workers(keys)
        own = field_of(name)
        records = self.fleet.worker_records(
            self.prefix, [w for w, _ in workers], (*RECORD_FIELDS, own, HELD_FIELD + name)
        )
        now_ms = int(now * 1000)
        alive_ms = ALIVE_WITHIN_S * 1000
        rows = [
            _worker(w, beat, r, now_ms, own, HELD_FIELD + name)
            for (w, beat), r in zip(workers, records, strict=True)
        ]
        alive = {
            w: figures
            for (w, beat), r in zip(workers, records, strict=True)
            if now_ms - beat <= alive_ms and (figures := parse(r.get(own, ""))) is not None
        }
        queues = self.fleet.top_queues(shards, TOP_KEYS)
        depths = queues.streams
        options = self.fleet.meta(keys)
        priorities = self._priorities(shards, depths, now_ms)
        dead = sum(n for _, n in self.fleet.dead_letter_depths(shards))
        history, window = self._histories.sampled(name, Sample(now, alive, dead))
        window["status"] = status(
            window,
            queued=sum(p["items"] for p in priorities),
            workers_alive=sum(1 for w in rows if w["heartbeat_age_ms"] <= alive_ms),
            oldest_ms=max((p["age_ms"] for p in priorities), default=0),
            dead_letters=dead,
            max_latency_s=max_latency_of(options),
        )
        return {
            "name": name,
            "options": options,
            "overrides": self.fleet.config(keys),
            "workers": rows,
            "queues": [
                _queue(d, now_ms, queues.items)
                for d in sorted(depths, key=lambda d: (d.first_ms or now_ms, d.key, d.priority))
                if d.length or d.pending
            ],
            "queue_counts": queues.counts(),
            "priorities": priorities,
            "dead_letters": dead,
            "health": window,
            "history": history,
        }

    def _priorities(
        self, shards: list[Keys], depths: list[StreamDepth], now_ms: int
    ) -> list[dict[str, int]]:
        """Per priority holding work: items admitted and not answered (every batch key) and
        the age of the oldest request not answered of the streams read (``depths``)."""
        summary = by_priority(self.fleet.priority_items(shards), depths, now_ms)
        return [
            {"priority": p, "items": items, "age_ms": age or 0}
            for p, (items, age) in summary.items()
        ]

    def dead_letters(self, name: str) -> list[dict[str, Any]]:
        letters = DeadLetters(self.fleet.admin, self.prefix, name)
        return [
            {
                "id": r.id,
                "reason": r.reason[:500],
                "deliveries": r.deliveries,
                "at_ms": r.at_ms,
                "stream": r.stream[:200],
            }
            for r in letters.records(MAX_DEAD_LETTERS)
        ]


def _worker(
    consumer: str,
    beat: int,
    record: dict[str, str],
    now_ms: int,
    own: str = field_of("fuzz"),
    held: str = HELD_FIELD + "fuzz",
) -> dict[str, Any]:
    """A row of the workers table: ``own`` is the record's field of this serving's figures
    (its items, batches and failures, not its partition's other servings'), ``held`` the one
    of the batch keys whose state it holds (a serving with load_key)."""
    figures = parse(record.get(own, "")) or Figures()
    keys, held_count = held_keys(record.get(held, ""))
    return {
        "id": consumer,
        "heartbeat_age_ms": max(0, now_ms - beat),
        "host": record.get("host", "")[:100],
        "pid": record.get("pid", "")[:20],
        "partition": record.get("partition", "")[:10],
        "device": record.get("device", "")[:40],
        "batches": figures.batches,
        "items": figures.items,
        "failures": figures.failures,
        "keys_held": keys,
        "keys_held_count": held_count,
    }


def _queue(depth: StreamDepth, now_ms: int, items_by_key: dict[str, int]) -> dict[str, Any]:
    return {
        "key": depth.key,
        "priority": depth.priority,
        "entries": depth.length,
        "pending": depth.pending,
        "key_items": items_by_key.get(depth.key, 0),
        "age_ms": max(0, now_ms - depth.first_ms) if depth.first_ms else 0,
    }


Overview = dict[str, Any]


class Snapshots:
    """Overviews shared by concurrent callers (single-flight): one computation at a time in a
    thread, whose snapshot answers every caller of the same page (offset, filter) for
    ``ttl`` seconds; a caller that arrives while it runs waits for it instead of starting
    another. So N pollers cost Redis one overview a second per page, not N, and the
    dashboard holds one page's reading at a time."""

    def __init__(
        self,
        compute: Callable[[int, str], Overview],
        ttl: float = SNAPSHOT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._compute = compute
        self._ttl = ttl
        self._clock = clock
        self._lock: asyncio.Lock | None = None
        self._kept: OrderedDict[tuple[int, str], tuple[float, Overview]] = OrderedDict()
        self.computed = 0  # how many overviews were computed (the tests count them)

    def _fresh(self, page: tuple[int, str]) -> Overview | None:
        kept = self._kept.get(page)
        if kept is None or self._clock() - kept[0] > self._ttl:
            return None
        return kept[1]

    async def get(self, offset: int, name_filter: str) -> Overview:
        page = (offset, name_filter)
        found = self._fresh(page)
        if found is not None:
            return found
        if self._lock is None:  # made in the app's loop, on first use
            self._lock = asyncio.Lock()
        async with self._lock:
            found = self._fresh(page)  # computed while this caller waited
            if found is not None:
                return found
            snapshot = await asyncio.to_thread(self._compute, offset, name_filter)
            self.computed += 1
            self._kept[page] = (self._clock(), snapshot)
            self._kept.move_to_end(page)
            while len(self._kept) > MAX_SNAPSHOTS:
                self._kept.popitem(last=False)
            return snapshot

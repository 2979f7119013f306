"""What the dashboard shows, read from Redis (broker/fleet.py): one snapshot per poll, and
the throughput and batch sizes of the last minutes, from the counters workers' heartbeats
carry (items and batches run by each partition process since it started).

A snapshot holds one page of servings (MAX_SERVINGS, by name, those whose name holds the
filter), and says how many there are in all and how many match, so a wrong prefix (none) or
a big deployment (more than a page) is told, never shown as an empty or a whole one.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from queueserve.broker.admin import StreamDepth, by_priority, hash_count
from queueserve.broker.fleet import Fleet
from queueserve.broker.urls import redact_url
from queueserve.errors import RedisCommandError
from queueserve.ops.deadletter import DeadLetters
from queueserve.wire.protocol import Keys
from queueserve.wire.timing import ALIVE_WITHIN_S

SAMPLE_EVERY_S = 2.0
HISTORY_S = 600.0  # the throughput chart's span: the last ten minutes
MAX_SERVINGS = 100
MAX_DEAD_LETTERS = 50


@dataclass(slots=True)
class Sample:
    at: float  # unix seconds
    counters: dict[str, tuple[int, int]]  # consumer -> (items, batches) since it started


def rates(before: Sample, after: Sample) -> dict[str, float | None]:
    """Items per second and mean batch size between two samples, over the consumers in
    both whose counters did not go back (a restarted partition starts from 0)."""
    items = batches = 0
    for consumer, (n, b) in after.counters.items():
        old = before.counters.get(consumer)
        if old is not None and n >= old[0] and b >= old[1]:
            items, batches = items + n - old[0], batches + b - old[1]
    span = after.at - before.at
    return {
        "at": after.at,
        "items_per_s": items / span if span > 0 else 0.0,
        "batch_size": items / batches if batches else None,
    }


class Board:
    """The dashboard's reads of one prefix; safe to call from several threads."""

    def __init__(self, fleet: Fleet, prefix: str) -> None:
        self.fleet = fleet
        self.prefix = prefix
        self._lock = threading.Lock()
        self._history: dict[str, deque[Sample]] = {}

    @property
    def redis(self) -> str:
        """The Redis URL read, its password hidden: the page shows it."""
        return redact_url(self.fleet.url)

    def overview(self, offset: int = 0, name_filter: str = "") -> dict[str, Any]:
        """A snapshot of the servings ``offset`` .. ``offset + MAX_SERVINGS`` by name of
        those whose name holds ``name_filter``; ``total``: how many servings there are,
        ``matched``: how many hold the filter."""
        now = time.time()
        every = self.fleet.servings(self.prefix)
        matched = [name for name in every if name_filter in name]
        page = matched[offset : offset + MAX_SERVINGS]
        return {
            "now_ms": int(now * 1000),
            "prefix": self.prefix,
            "redis": self.redis,
            "total": len(every),
            "matched": len(matched),
            "offset": offset,
            "limit": MAX_SERVINGS,
            "filter": name_filter,
            "servings": [self._readable(name, now) for name in page],
        }

    def _readable(self, name: str, now: float) -> dict[str, Any]:
        """A serving's row. One whose keys Redis refuses to read (a key of another type under
        its name: anyone may write one) says why, empty, and the page shows the others."""
        try:
            return self._serving(name, now)
        except RedisCommandError as e:
            return {
                "name": name,
                "error": str(e),
                **{part: {} for part in ("options", "overrides")},
                **{part: [] for part in ("workers", "queues", "priorities", "history")},
                "dead_letters": 0,
            }

    def _serving(self, name: str, now: float) -> dict[str, Any]:
        keys = Keys(self.prefix, name)
        shards = self.fleet.shards(keys)
        workers = self.fleet.workers(keys)
        records = self.fleet.worker_records(self.prefix, [w for w, _ in workers])
        now_ms = int(now * 1000)
        alive_ms = ALIVE_WITHIN_S * 1000
        counters = {
            w: (hash_count(r.get("items", "")), hash_count(r.get("batches", "")))
            for (w, beat), r in zip(workers, records, strict=True)
            if now_ms - beat <= alive_ms
        }
        items_by_key = {row.key: row.queued_items for row in self.fleet.summed_key_stats(shards)}
        depths = self.fleet.queue_depths(shards)
        return {
            "name": name,
            "options": self.fleet.meta(keys),
            "overrides": self.fleet.config(keys),
            "workers": [
                _worker(w, beat, r, now_ms) for (w, beat), r in zip(workers, records, strict=True)
            ],
            "queues": [_queue(d, now_ms, items_by_key) for d in depths if d.length or d.pending],
            "priorities": self._priorities(shards, depths, now_ms),
            "dead_letters": sum(n for _, n in self.fleet.dead_letter_depths(shards)),
            "history": self._sampled(name, Sample(now, counters)),
        }

    def _priorities(
        self, shards: list[Keys], depths: list[StreamDepth], now_ms: int
    ) -> list[dict[str, int]]:
        """Per priority holding work: items admitted and not answered (every batch key) and
        the age of the oldest request not answered."""
        summary = by_priority(self.fleet.priority_items(shards), depths, now_ms)
        return [
            {"priority": p, "items": items, "age_ms": age or 0}
            for p, (items, age) in summary.items()
        ]

    def _sampled(self, name: str, sample: Sample) -> list[dict[str, float | None]]:
        """Keep ``sample`` (at most one per SAMPLE_EVERY_S) and the rates of the history."""
        with self._lock:
            history = self._history.setdefault(name, deque())
            if not history or sample.at - history[-1].at >= SAMPLE_EVERY_S:
                history.append(sample)
            while history and sample.at - history[0].at > HISTORY_S:
                history.popleft()
            samples = list(history)
        return [rates(a, b) for a, b in itertools.pairwise(samples)]

    def dead_letters(self, name: str) -> list[dict[str, Any]]:
        letters = DeadLetters(self.fleet, self.prefix, name)
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


def _worker(consumer: str, beat: int, record: dict[str, str], now_ms: int) -> dict[str, Any]:
    return {
        "id": consumer,
        "heartbeat_age_ms": max(0, now_ms - beat),
        "host": record.get("host", "")[:100],
        "pid": record.get("pid", "")[:20],
        "partition": record.get("partition", "")[:10],
        "device": record.get("device", "")[:40],
        "batches": hash_count(record.get("batches", "")),
        "items": hash_count(record.get("items", "")),
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

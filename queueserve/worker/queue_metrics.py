"""What the supervisor adds to its merged metrics per scrape: the queues as Redis holds them,
its partitions' restarts, and the build.

The queue gauges describe a serving, not a worker: every worker of the serving exports the same
values, so aggregate them with ``max`` (docs/operations.md, "What to sum across workers").
"""

from __future__ import annotations

import logging
import platform
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from importlib import metadata
from typing import Any

from queueserve.broker.admin import Admin, StreamDepth
from queueserve.errors import RedisCommandError, RedisUnavailable
from queueserve.wire.keys import Keys
from queueserve.worker.metrics import KEY_LABELS, OTHER_KEY, _prometheus

log = logging.getLogger(__name__)

# What a scrape reads: the queues, the per-priority counts, the dead letters (Admin's rows)
_Read = tuple[list[StreamDepth], list[tuple[Keys, int, dict[int, int]]], list[tuple[Keys, int]]]


def _labelled_keys(
    totals: dict[str, int], declared: Iterable[str], limit: int
) -> tuple[list[str], list[str]]:
    """(keys with a label of their own, keys summed under ``other``): the declared keys (shown
    even when idle) and the ``limit`` others with the largest ``totals``."""
    own = [k for k in dict.fromkeys(declared) if k != OTHER_KEY]
    ranked = sorted((k for k in totals if k not in own), key=lambda k: (-totals[k], k))
    named = [k for k in ranked if k != OTHER_KEY][:limit]
    labelled = set(named)
    return own + named, [k for k in ranked if k not in labelled]


class QueueCollector:
    """Per serving, read from Redis per scrape: entries waiting and pending per batch key (the
    declared keys and the ``key_labels`` keys holding the most entries, the rest summed under
    ``key="other"``), per priority the items admitted and not answered, the entries waiting and
    the oldest unanswered request's age, items admitted and not answered (every key and
    priority: what KEDA scales on), and dead letters. Only streams holding entries are read."""

    def __init__(
        self,
        broker: Admin,
        prefix: str,
        servings: Sequence[str],
        *,
        declared: Iterable[str] = ("default",),
        key_labels: int = KEY_LABELS,
    ) -> None:
        self.broker = broker
        self.keys = [Keys(prefix, s) for s in servings]
        self.declared = tuple(declared)
        self.key_labels = key_labels
        self._said: set[tuple[str, str]] = set()  # (serving, error) logged: few, by serving

    def collect(self) -> Iterator[Any]:
        _prometheus()
        from prometheus_client.core import GaugeMetricFamily as Gauge

        try:
            try:
                streams, by_priority, dead_letters = self._read(self.keys)
            except RedisCommandError:  # one serving's key of another type: not the others'
                streams, by_priority, dead_letters = self._read_each()
        except RedisUnavailable as e:
            log.warning("metrics: %s", e)
            return
        depth = Gauge(
            "queueserve_queue_depth", "Entries waiting to be read", labels=["serving", "key"]
        )
        pending = Gauge(
            "queueserve_pending", "Entries read and not yet acked", labels=["serving", "key"]
        )
        for name, rows in self._by_key(streams).items():
            for key, (ready, held) in self._bounded(rows).items():
                depth.add_metric([name, key], ready)
                pending.add_metric([name, key], held)
        yield from (depth, pending)
        yield from self._by_priority(streams)
        priority_items = Gauge(
            "queueserve_priority_queued_items",
            "Items admitted and not yet answered, per priority (every batch key)",
            labels=["serving", "priority"],
        )
        per_priority: Counter[tuple[str, int]] = Counter()
        for keys, _, found in by_priority:  # shards summed
            per_priority.update({(keys.name, p): n for p, n in found.items()})
        for (name, priority), n in sorted(per_priority.items()):
            priority_items.add_metric([name, str(priority)], n)
        yield priority_items
        queued = Gauge(
            "queueserve_queued_items",
            "Items admitted and not yet answered, of every batch key and priority",
            labels=["serving"],
        )
        for name, n in _summed((keys.name, n) for keys, n, _ in by_priority).items():
            queued.add_metric([name], n)
        dead = Gauge(
            "queueserve_dead_letter_depth", "Entries in the dead-letter stream", labels=["serving"]
        )
        for name, n in _summed((keys.name, n) for keys, n in dead_letters).items():
            dead.add_metric([name], n)
        yield from (queued, dead)

    def _read(self, keys_list: Sequence[Keys]) -> _Read:
        """The queues, per-priority counts and dead letters of these servings' shards."""
        shards = [s for keys in keys_list for s in self.broker.shards(keys)]
        return (
            self.broker.queue_depths(shards),
            self.broker.priority_items(shards),
            self.broker.dead_letter_depths(shards),
        )

    def _read_each(self) -> _Read:
        """``_read`` serving by serving, without those whose keys Redis refuses to read (one
        of another type: anyone may write one), each said in the log once."""
        streams: list[StreamDepth] = []
        by_priority: list[tuple[Keys, int, dict[int, int]]] = []
        dead_letters: list[tuple[Keys, int]] = []
        for keys in self.keys:
            try:
                found = self._read([keys])
            except RedisCommandError as e:
                if (keys.name, str(e)) not in self._said:
                    self._said.add((keys.name, str(e)))
                    log.warning("metrics: serving %s has no queue gauges: %s", keys.name, e)
                continue
            streams += found[0]
            by_priority += found[1]
            dead_letters += found[2]
        return streams, by_priority, dead_letters

    def _by_key(self, streams: Sequence[StreamDepth]) -> dict[str, dict[str, list[int]]]:
        waiting: dict[str, dict[str, list[int]]] = {k.name: {} for k in self.keys}
        for s in streams:  # priorities and shards summed
            row = waiting[s.keys.name].setdefault(s.key, [0, 0])
            row[0] += max(0, s.length - s.pending)
            row[1] += s.pending
        return waiting

    def _by_priority(self, streams: Sequence[StreamDepth]) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily as Gauge

        depth = Gauge(
            "queueserve_priority_queue_depth",
            "Entries waiting to be read, per priority (every batch key; an entry holds one "
            "request or a pack of them: queueserve_priority_queued_items counts items)",
            labels=["serving", "priority"],
        )
        age = Gauge(
            "queueserve_oldest_request_age_seconds",
            "Age of the oldest request not yet answered, per priority (every batch key)",
            labels=["serving", "priority"],
        )
        now_ms = time.time() * 1000
        ready: Counter[tuple[str, int]] = Counter()
        oldest: dict[tuple[str, int], float] = {}
        for s in streams:
            at = (s.keys.name, s.priority)
            ready[at] += max(0, s.length - s.pending)
            if s.first_ms:
                oldest[at] = max(oldest.get(at, 0.0), max(0.0, now_ms - s.first_ms) / 1000)
        for (name, priority), n in sorted(ready.items()):
            depth.add_metric([name, str(priority)], n)
        for (name, priority), seconds in sorted(oldest.items()):
            age.add_metric([name, str(priority)], seconds)
        yield from (depth, age)

    def _bounded(self, rows: dict[str, list[int]]) -> dict[str, list[int]]:
        named, rest = _labelled_keys(
            {k: sum(v) for k, v in rows.items()}, self.declared, self.key_labels
        )
        out = {k: rows.get(k, [0, 0]) for k in named}
        if rest:
            out[OTHER_KEY] = [sum(rows[k][0] for k in rest), sum(rows[k][1] for k in rest)]
        return out


def _summed(rows: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Per serving, its shards' figures added up."""
    out: dict[str, int] = {}
    for name, n in rows:
        out[name] = out.get(name, 0) + n
    return out


class SupervisorCollector:
    """The worker's own figures: partition restarts by cause (recycled, died_in_batch,
    crashed), from the supervisor that restarted them, and the build."""

    def __init__(self, restarts: Counter[tuple[int, str]]) -> None:
        self.restarts = restarts

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        info = GaugeMetricFamily(
            "queueserve_build_info",
            "Always 1; the queueserve and Python versions this worker runs",
            labels=["version", "python"],
        )
        info.add_metric([version(), platform.python_version()], 1)
        yield info
        restarts = CounterMetricFamily(
            "queueserve_partition_restarts",
            "Partition processes restarted, by cause: recycled, died_in_batch, crashed",
            labels=["partition", "reason"],
        )
        for (partition, reason), n in sorted(dict(self.restarts).items()):
            restarts.add_metric([str(partition), reason], n)
        yield restarts


def version() -> str:
    try:
        return metadata.version("queueserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"

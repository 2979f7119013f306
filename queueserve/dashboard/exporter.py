"""The dashboard's ``GET /metrics``: each serving's backlog as Redis holds it, for Prometheus,
so that KEDA and the alerts see waiting work when no worker runs (a worker's /metrics goes
with the worker: scaled to zero, nothing exported the backlog, and nothing scaled it up).

Per serving of the registry (at most MAX_LISTED_SERVINGS, as every listing): its admission
counters (items admitted and not answered), its live workers and its dead letters, a few
commands per serving in round trips of a thousand (broker/fleet.py, ``backlogs``), never a
read per batch key: with 20,000 batch keys a serving costs what it costs with one. Scrapes
that come within a second share one reading (board.py's Snapshots), so several Prometheus
replicas cost Redis one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from queueserve.broker.fleet import Fleet


class BacklogCollector:
    """prometheus-client's collector of the backlogs of ``prefix``'s servings."""

    def __init__(self, fleet: Fleet, prefix: str) -> None:
        self.fleet = fleet
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily as Gauge

        listed, _ = self.fleet.listing(self.prefix)
        backlogs = self.fleet.backlogs(self.prefix, sorted(listed))
        queued = Gauge(
            "queueserve_queued_items",
            "Items admitted and not yet answered, of every batch key and priority (read by "
            "the dashboard: with or without a worker)",
            labels=["serving"],
        )
        live = Gauge(
            "queueserve_live_workers",
            "Partitions of the serving whose heartbeat is at most 10 s old",
            labels=["serving"],
        )
        dead = Gauge(
            "queueserve_dead_letter_depth", "Entries in the dead-letter stream", labels=["serving"]
        )
        for b in backlogs:
            queued.add_metric([b.name], b.queued)
            live.add_metric([b.name], b.live_workers)
            dead.add_metric([b.name], b.dead_letters)
        yield from (queued, live, dead)


def exposition(fleet: Fleet, prefix: str) -> bytes:
    """The text of one scrape."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(BacklogCollector(fleet, prefix))
    return bytes(generate_latest(registry))

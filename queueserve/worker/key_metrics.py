"""The metrics of key states (a serving with ``load_key``; queueserve/key_states.py), part of
metrics.py's PrometheusMiddleware: loads and their time, evictions, the states a partition
holds, and how many batches found their key's state held (the hit rate)."""

from __future__ import annotations

from typing import Any

from queueserve.serving import Partition, Serving

# A load reads a model's weights: from milliseconds (an adapter) to minutes
_LOAD_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class KeyStateMetrics:
    """Counters of one partition's key states (``pc``: prometheus_client; ``kw``: where to
    register)."""

    def __init__(self, pc: Any, kw: dict[str, Any]) -> None:
        self.loads = pc.Counter(
            "queueserve_key_loads",
            "Calls of a serving's load_key, by outcome (ok, error)",
            ["serving", "outcome"],
            **kw,
        )
        self.load_seconds = pc.Histogram(
            "queueserve_key_load_seconds",
            "Time in load_key (loads that raised included)",
            ["serving"],
            buckets=_LOAD_BUCKETS,
            **kw,
        )
        self.evictions = pc.Counter(
            "queueserve_key_evictions",
            "Key states evicted from a partition's LRU (unload_key called)",
            ["serving"],
            **kw,
        )
        self.uses = pc.Counter(
            "queueserve_key_state_uses",
            "Batches that took their key's state: held already (hit) or loaded for them (miss)",
            ["serving", "result"],
            **kw,
        )
        self.held = pc.Gauge(
            "queueserve_keys_held",
            "Key states a partition holds",
            ["serving", "partition"],
            **kw,
        )

    def key_loaded(
        self, serving: Serving, key: str, partition: Partition, seconds: float, ok: bool
    ) -> None:
        self.loads.labels(serving.name, "ok" if ok else "error").inc()
        self.load_seconds.labels(serving.name).observe(seconds)

    def key_evicted(self, serving: Serving, key: str, partition: Partition) -> None:
        self.evictions.labels(serving.name).inc()

    def key_used(self, serving: Serving, partition: Partition, hit: bool, held: int) -> None:
        self.uses.labels(serving.name, "hit" if hit else "miss").inc()
        self.held.labels(serving.name, str(partition.index)).set(held)

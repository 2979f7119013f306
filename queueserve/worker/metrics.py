"""Prometheus metrics for workers (``queueserve worker --metrics-port``), with health probes.

Partitions record into prometheus-client's multiprocess files; the supervisor serves them
merged on one port, together with the queue gauges read from Redis at scrape time
(queue_metrics.py), ``/healthz`` (every partition process alive) and ``/readyz`` (Redis
answers and every partition has sent a heartbeat). Busy ratio per partition is
``rate(queueserve_partition_busy_seconds_total[1m])``.

What a scrape costs is bounded whatever the number of batch keys: a ``key`` label names the
worker's declared keys and at most ``metrics_keys`` others (the keys holding the most entries
for the queue gauges; the first keys a partition ran for the batch-size histogram), and the
rest are summed under ``key="other"``; queue gauges read only the streams that hold entries
(the ready and active sets), never every key ever seen. The port that serves them is
metrics_server.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from queueserve.serving import Partition, Serving
from queueserve.steps import StepServing
from queueserve.wire.figures import LATENCY_BOUNDS
from queueserve.wire.tenants import TENANT_NAME
from queueserve.worker.key_metrics import KeyStateMetrics
from queueserve.worker.middleware import Middleware
from queueserve.worker.stepping.joins import StepRecord

log = logging.getLogger(__name__)

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Waits in a queue and whole requests run longer than batches: up to 10 minutes. The
# dashboard's figures count in the same buckets (wire/figures.py), so both give one p99.
_LATENCY_BUCKETS = LATENCY_BOUNDS

DEFAULT_HOST = "127.0.0.1"  # --metrics-host: 0.0.0.0 to be scraped from other hosts
KEY_LABELS = 20  # --metrics-keys: batch keys with a label of their own, besides declared ones
OTHER_KEY = "other"  # the label of every other batch key, summed
TENANT_LABELS = 100  # tenants with a label of their own; later ones share OTHER_KEY


class KeyLabels:
    """The ``key`` label of a batch key in one partition's histograms: declared keys and the
    first ``limit`` others keep their name, later ones share ``other``, so what a partition
    writes stays bounded however many keys it serves."""

    def __init__(self, declared: Iterable[str], limit: int) -> None:
        self._declared = frozenset(declared) - {OTHER_KEY}
        self._others: set[str] = set()
        self._limit = limit
        self._lock = threading.Lock()

    def __call__(self, key: str) -> str:
        if key in self._declared or key in self._others:
            return key
        with self._lock:
            if key == OTHER_KEY or len(self._others) >= self._limit:
                return OTHER_KEY
            self._others.add(key)
        return key


def since_enqueue(entry_id: bytes, now: float) -> float:
    """Seconds from a request's enqueue, its stream entry id's milliseconds (Redis's clock,
    which XADD stamps), to ``now`` (this host's): 0 when the clocks disagree the other way,
    or for an id anyone wrote that holds no time."""
    ms = entry_id.partition(b"-")[0]
    if not ms.isdigit() or len(ms) > 15:
        return 0.0
    return max(0.0, now - int(ms) / 1000)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(
            "metrics need prometheus-client: pip install queueserve[metrics]"
        ) from None
    return prometheus_client


class PrometheusMiddleware(Middleware):
    """Records batching metrics of the partition it runs in."""

    def __init__(
        self,
        registry: Any = None,
        *,
        declared: Iterable[str] = ("default",),
        key_labels: int = KEY_LABELS,
    ) -> None:
        pc = _prometheus()
        kw = {} if registry is None else {"registry": registry}
        # one registry for all (a test's own, or the default)
        histogram, counter, gauge = (partial(m, **kw) for m in (pc.Histogram, pc.Counter, pc.Gauge))
        self.key_label = KeyLabels(declared, key_labels)
        self.batch_size = histogram(
            "queueserve_batch_size",
            "Items per executed batch",
            ["serving", "key"],
            buckets=_SIZE_BUCKETS,
        )
        self.utilization = histogram(
            "queueserve_batch_utilization",
            "Batch size / batch_size capacity",
            ["serving"],
            buckets=_RATIO_BUCKETS,
        )
        self.wait = histogram(
            "queueserve_batch_wait_seconds",
            "From a batch's first item to its execution",
            ["serving"],
            buckets=_TIME_BUCKETS,
        )
        self.execution = histogram(
            "queueserve_batch_execution_seconds",
            "Time in the batch function",
            ["serving"],
            buckets=_TIME_BUCKETS,
        )
        self.busy = counter(
            "queueserve_partition_busy_seconds",
            "Seconds a partition spent executing batches",
            ["serving", "partition"],
        )
        self.items = counter("queueserve_items", "Items answered", ["serving"])
        self.tenant_items = counter(
            "queueserve_tenant_items",
            "Items taken into batches, by the tenant their request names (a gateway's)",
            ["serving", "tenant"],
        )
        self.tenant_label = KeyLabels((), TENANT_LABELS)
        self.requests = counter("queueserve_requests", "Requests answered completely", ["serving"])
        self.errors = counter(
            "queueserve_errors", "Items answered with an error, by kind", ["serving", "kind"]
        )
        self.redeliveries = counter(
            "queueserve_redeliveries", "Entries reclaimed from dead consumers", ["serving"]
        )
        self.step_slots = histogram(
            "queueserve_step_slots",
            "Sequences decoded per step of a step serving",
            ["serving"],
            buckets=_SIZE_BUCKETS,
        )
        self.generated = counter(
            "queueserve_generated_tokens", "Outputs produced by step servings", ["serving"]
        )
        self.prefill_tokens = counter(
            "queueserve_prefill_tokens",
            "Prompt tokens prefilled (prefix-cache hits excluded)",
            ["serving"],
        )
        self.prefill_seconds = counter(
            "queueserve_prefill_seconds", "Seconds step servings spent in prefill", ["serving"]
        )
        self.cache_lookups = counter(
            "queueserve_prefix_cache_lookups",
            "Prefix-cache lookups, by result (hit, miss)",
            ["serving", "result"],
        )
        self.cache_saved = counter(
            "queueserve_prefix_cache_saved_tokens",
            "Prompt tokens not prefilled thanks to the prefix cache",
            ["serving"],
        )
        self.dead_letters = counter(
            "queueserve_dead_letters", "Entries moved to the dead-letter stream", ["serving"]
        )
        self.cache = gauge(
            "queueserve_result_cache",
            "The result cache's counts in Redis, every worker's and client's: hits, misses, "
            "stored, bytes, too_big (read at each heartbeat)",
            ["serving", "count"],
        )
        self.redis_failures = counter(
            "queueserve_redis_errors",
            "Failed Redis attempts of a partition's loops (each retried with backoff)",
            ["partition"],
        )
        self.queue_time = histogram(
            "queueserve_queue_time_seconds",
            "From a request's enqueue (its stream entry id, Redis's clock) to its first batch",
            ["serving"],
            buckets=_LATENCY_BUCKETS,
        )
        self.end_to_end = histogram(
            "queueserve_end_to_end_seconds",
            "From a request's enqueue (Redis's clock) to its last answer written",
            ["serving"],
            buckets=_LATENCY_BUCKETS,
        )
        self.first_output = histogram(
            "queueserve_time_to_first_output_seconds",
            "Step servings: from a request's enqueue to its first output",
            ["serving"],
            buckets=_LATENCY_BUCKETS,
        )
        self.per_output = histogram(
            "queueserve_time_per_output_seconds",
            "Step servings: a decode step that produced outputs (the time between outputs)",
            ["serving"],
            buckets=_TIME_BUCKETS,
        )

        self.model = gauge(
            "queueserve_batch_model_seconds",
            "max_latency set: learned batch time a + b*n (term a: per batch, b: per item or "
            "cost unit)",
            ["serving", "partition", "term"],
        )
        self.slack = gauge(
            "queueserve_latency_slack_seconds",
            "max_latency set: the last batch's max_latency less its oldest item's wait and run",
            ["serving", "partition"],
        )
        self.key_states = KeyStateMetrics(pc, kw)  # servings with load_key

    def batch_model(
        self, serving: Serving, partition: Partition, a: float, b: float, slack: float
    ) -> None:
        name, index = serving.name, str(partition.index)
        self.model.labels(name, index, "a").set(a)
        self.model.labels(name, index, "b").set(b)
        self.slack.labels(name, index).set(slack)

    def batch_opened(
        self, serving: Serving, key: str, partition: Partition, slices: Sequence[Any]
    ) -> None:
        self._count_tenants(serving, slices)
        if isinstance(serving, StepServing):  # decode steps, not arrivals: see step()
            return
        now = time.time()
        queue_time = self.queue_time.labels(serving.name)
        for piece in slices:
            if piece.offset == 0:  # a request's first batch (a split one has several)
                queue_time.observe(since_enqueue(piece.request.entry_id, now))

    def _count_tenants(self, serving: Serving, slices: Sequence[Any]) -> None:
        """Items per tenant, for requests whose header names one (a stranger's field: only a
        tenant's name counts, and at most TENANT_LABELS names have a label of their own)."""
        for piece in slices:
            fields = piece.request.fields
            if fields is None:
                continue
            tenant = fields.get("tenant")
            if type(tenant) is str and TENANT_NAME.fullmatch(tenant):
                label = self.tenant_label(tenant)
                self.tenant_items.labels(serving.name, label).inc(len(piece.items))

    def requests_answered(self, serving: Serving, entry_ids: Sequence[bytes]) -> None:
        now = time.time()
        end_to_end = self.end_to_end.labels(serving.name)
        for entry_id in entry_ids:
            end_to_end.observe(since_enqueue(entry_id, now))

    def batch_started(
        self, serving: Serving, key: str, partition: Partition, size: int, waited: float
    ) -> None:
        self.batch_size.labels(serving.name, self.key_label(key)).observe(size)
        self.utilization.labels(serving.name).observe(min(1.0, size / serving.batch_size))
        self.wait.labels(serving.name).observe(waited)

    def batch_finished(
        self, serving: Serving, key: str, partition: Partition, size: int, seconds: float
    ) -> None:
        self.execution.labels(serving.name).observe(seconds)
        self.busy.labels(serving.name, str(partition.index)).inc(seconds)

    def replied(self, serving: Serving, items: int, requests: int, errors: dict[str, int]) -> None:
        self.items.labels(serving.name).inc(items)
        self.requests.labels(serving.name).inc(requests)
        for kind, n in errors.items():
            self.errors.labels(serving.name, kind).inc(n)

    def step(self, serving: Serving, partition: Partition, record: StepRecord) -> None:
        name = serving.name
        if record.slots:
            self.step_slots.labels(name).observe(record.slots)
        self.generated.labels(name).inc(record.generated)
        self.prefill_tokens.labels(name).inc(record.prefill_tokens)
        self.prefill_seconds.labels(name).inc(record.prefill_seconds)
        if record.cache_hits:
            self.cache_lookups.labels(name, "hit").inc(record.cache_hits)
        if record.cache_misses:
            self.cache_lookups.labels(name, "miss").inc(record.cache_misses)
        self.cache_saved.labels(name).inc(record.cache_saved_tokens)
        if record.generated:
            self.per_output.labels(name).observe(record.decode_seconds)
        if record.first_outputs:
            now = time.time()
            first_output = self.first_output.labels(name)
            for entry_id in record.first_outputs:
                first_output.observe(since_enqueue(entry_id, now))

    def redelivered(self, serving: Serving, entries: int) -> None:
        self.redeliveries.labels(serving.name).inc(entries)

    def key_loaded(
        self, serving: Serving, key: str, partition: Partition, seconds: float, ok: bool
    ) -> None:
        self.key_states.key_loaded(serving, key, partition, seconds, ok)

    def key_evicted(self, serving: Serving, key: str, partition: Partition) -> None:
        self.key_states.key_evicted(serving, key, partition)

    def key_used(self, serving: Serving, partition: Partition, hit: bool, held: int) -> None:
        self.key_states.key_used(serving, partition, hit, held)

    def dead_lettered(self, serving: Serving, entries: int) -> None:
        self.dead_letters.labels(serving.name).inc(entries)

    def partition_started(self, servings: Sequence[Serving], partition: Partition) -> None:
        # A series from 0, so that the first errors are an increase Prometheus sees
        self.redis_failures.labels(str(partition.index)).inc(0)

    def redis_errors(self, partition: Partition, errors: int) -> None:
        self.redis_failures.labels(str(partition.index)).inc(errors)

    def cache_counts(self, serving: Serving, counts: Mapping[str, int]) -> None:
        for name, count in counts.items():
            self.cache.labels(serving.name, name).set(count)

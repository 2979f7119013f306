"""Prometheus metrics for workers (``queueserve worker --metrics-port``), with health probes.

Partitions record into prometheus-client's multiprocess files; the supervisor serves them
merged on one port, together with queue depth and pending counts read from Redis at scrape
time, ``/healthz`` (every partition process alive) and ``/readyz`` (Redis answers and every
partition has sent a heartbeat). Busy ratio per partition is
``rate(queueserve_partition_busy_seconds_total[1m])``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from queueserve.broker.sync import RedisBroker
from queueserve.errors import RedisUnavailable
from queueserve.serving import Partition, Serving
from queueserve.wire import protocol as P
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline.stepping import StepRecord

log = logging.getLogger(__name__)

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


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

    def __init__(self, registry: Any = None) -> None:
        pc = _prometheus()
        kw = {} if registry is None else {"registry": registry}
        self.batch_size = pc.Histogram(
            "queueserve_batch_size", "Items per executed batch", ["serving", "key"],
            buckets=_SIZE_BUCKETS, **kw)
        self.utilization = pc.Histogram(
            "queueserve_batch_utilization", "Batch size / batch_size capacity", ["serving"],
            buckets=_RATIO_BUCKETS, **kw)
        self.wait = pc.Histogram(
            "queueserve_batch_wait_seconds", "From a batch's first item to its execution",
            ["serving"], buckets=_TIME_BUCKETS, **kw)
        self.execution = pc.Histogram(
            "queueserve_batch_execution_seconds", "Time in the batch function", ["serving"],
            buckets=_TIME_BUCKETS, **kw)
        self.busy = pc.Counter(
            "queueserve_partition_busy_seconds", "Seconds a partition spent executing batches",
            ["serving", "partition"], **kw)
        self.items = pc.Counter(
            "queueserve_items", "Items answered", ["serving"], **kw)
        self.requests = pc.Counter(
            "queueserve_requests", "Requests answered completely", ["serving"], **kw)
        self.errors = pc.Counter(
            "queueserve_errors", "Items answered with an error, by kind", ["serving", "kind"], **kw)
        self.redeliveries = pc.Counter(
            "queueserve_redeliveries", "Entries reclaimed from dead consumers", ["serving"], **kw)
        self.step_slots = pc.Histogram(
            "queueserve_step_slots", "Sequences decoded per step of a step serving",
            ["serving"], buckets=_SIZE_BUCKETS, **kw)
        self.generated = pc.Counter(
            "queueserve_generated_tokens", "Outputs produced by step servings", ["serving"], **kw)
        self.prefill_tokens = pc.Counter(
            "queueserve_prefill_tokens", "Prompt tokens prefilled (prefix-cache hits excluded)",
            ["serving"], **kw)
        self.prefill_seconds = pc.Counter(
            "queueserve_prefill_seconds", "Seconds step servings spent in prefill", ["serving"],
            **kw)
        self.cache_lookups = pc.Counter(
            "queueserve_prefix_cache_lookups", "Prefix-cache lookups, by result (hit, miss)",
            ["serving", "result"], **kw)
        self.cache_saved = pc.Counter(
            "queueserve_prefix_cache_saved_tokens", "Prompt tokens not prefilled thanks to the "
            "prefix cache", ["serving"], **kw)
        self.dead_letters = pc.Counter(
            "queueserve_dead_letters", "Entries moved to the dead-letter stream", ["serving"],
            **kw)

    def batch_started(
        self, serving: Serving, key: str, partition: Partition, size: int, waited: float
    ) -> None:
        self.batch_size.labels(serving.name, key).observe(size)
        self.utilization.labels(serving.name).observe(min(1.0, size / serving.batch_size))
        self.wait.labels(serving.name).observe(waited)

    def batch_finished(
        self, serving: Serving, key: str, partition: Partition, size: int, seconds: float
    ) -> None:
        self.execution.labels(serving.name).observe(seconds)
        self.busy.labels(serving.name, str(partition.index)).inc(seconds)

    def replied(
        self, serving: Serving, items: int, requests: int, errors: dict[str, int]
    ) -> None:
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

    def redelivered(self, serving: Serving, entries: int) -> None:
        self.redeliveries.labels(serving.name).inc(entries)

    def dead_lettered(self, serving: Serving, entries: int) -> None:
        self.dead_letters.labels(serving.name).inc(entries)


class QueueCollector:
    """Queue depth, pending and dead letters per serving and key, read from Redis per scrape."""

    def __init__(self, broker: RedisBroker, prefix: str, servings: Sequence[str]) -> None:
        self.broker = broker
        self.keys = [P.Keys(prefix, s) for s in servings]

    def collect(self) -> Iterator[Any]:
        _prometheus()
        from prometheus_client.core import GaugeMetricFamily

        depth = GaugeMetricFamily(
            "queueserve_queue_depth", "Entries waiting to be read", labels=["serving", "key"])
        pending = GaugeMetricFamily(
            "queueserve_pending", "Entries read and not yet acked", labels=["serving", "key"])
        dead = GaugeMetricFamily(
            "queueserve_dead_letter_depth", "Entries in the dead-letter stream",
            labels=["serving"])
        waiting: dict[tuple[str, str], list[int]] = {}
        dead_letters: dict[str, int] = {}
        try:
            shards = [s for keys in self.keys for s in self.broker.shards(keys)]
            for keys, key, length, held in self.broker.queue_depths(shards):
                row = waiting.setdefault((keys.name, key), [0, 0])  # shards summed
                row[0] += max(0, length - held)
                row[1] += held
            for keys, length in self.broker.dead_letter_depths(shards):
                dead_letters[keys.name] = dead_letters.get(keys.name, 0) + length
        except RedisUnavailable as e:
            log.warning("metrics: %s", e)
            return
        for (name, key), (ready, held) in waiting.items():
            depth.add_metric([name, key], ready)
            pending.add_metric([name, key], held)
        for name, length in dead_letters.items():
            dead.add_metric([name], length)
        yield from (depth, pending, dead)


class MetricsServer:
    """Serves /metrics, /healthz and /readyz on ``port`` from a background thread."""

    def __init__(
        self, port: int, registry: Any, healthy: Callable[[], bool], ready: Callable[[], bool],
        host: str = "0.0.0.0",
    ) -> None:
        pc = _prometheus()
        render = pc.generate_latest

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, render(registry), pc.CONTENT_TYPE_LATEST)
                elif self.path in ("/healthz", "/readyz"):
                    ok = (healthy if self.path == "/healthz" else ready)()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"not ok\n", "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("metrics http: " + format, *args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="queueserve-metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

"""The worker's metrics endpoint: merged from partition processes, or from this process."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from queueserve.broker.admin import Admin
from queueserve.serving import Serving
from queueserve.worker.metrics import (
    DEFAULT_HOST,
    KEY_LABELS,
    MetricsServer,
    PrometheusMiddleware,
)
from queueserve.worker.queue_metrics import QueueCollector, SupervisorCollector

if TYPE_CHECKING:
    from queueserve.worker.partition import PartitionHost
    from queueserve.worker.supervisor import Supervisor


class Worker(Protocol):
    """What the metrics endpoint reads of the worker it serves (``qs.Worker``), named here so
    that this module need not import the worker module that starts it."""

    @property
    def redis_url(self) -> str: ...

    @property
    def prefix(self) -> str: ...

    @property
    def servings(self) -> Sequence[Serving]: ...

    @property
    def declared_keys(self) -> tuple[str, ...]: ...

    metrics_port: int | None
    metrics_host: str

    @property
    def options(self) -> _MetricsConfig: ...


class _MetricsConfig(Protocol):
    @property
    def metrics_keys(self) -> int: ...


__all__ = [
    "DEFAULT_HOST",
    "KEY_LABELS",
    "MetricsServer",
    "in_process_metrics",
    "supervisor_metrics",
]


def _collector(worker: Worker, broker: Admin) -> QueueCollector:
    return QueueCollector(
        broker,
        worker.prefix,
        [s.name for s in worker.servings],
        declared=worker.declared_keys,
        key_labels=worker.options.metrics_keys,
    )


@contextlib.contextmanager
def supervisor_metrics(worker: Worker, supervisor: Supervisor) -> Iterator[MetricsServer]:
    """Serve metrics for a supervised worker while the block runs.

    Partitions inherit PROMETHEUS_MULTIPROC_DIR and write their metrics there; this process
    merges them per scrape and adds queue depths from Redis."""
    from prometheus_client import CollectorRegistry, multiprocess

    with contextlib.ExitStack() as stack:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="qs-metrics-"))
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
            stack.callback(os.environ.pop, "PROMETHEUS_MULTIPROC_DIR", None)
        path = os.environ["PROMETHEUS_MULTIPROC_DIR"]
        supervisor.on_exit.append(
            lambda pid: multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
        )
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
        broker = Admin(worker.redis_url)
        stack.callback(broker.close)
        registry.register(_collector(worker, broker))
        registry.register(SupervisorCollector(supervisor.restarts))
        assert worker.metrics_port is not None
        server = MetricsServer(
            worker.metrics_port,
            registry,
            healthy=supervisor.all_alive,
            ready=lambda: broker.ping() and supervisor.all_registered(broker, worker),
            host=worker.metrics_host,
        )
        stack.callback(server.stop)
        yield server.start()


def in_process_metrics(
    worker: Worker, host: Callable[[], PartitionHost | None]
) -> tuple[MetricsServer, PrometheusMiddleware]:
    """Metrics of a worker serving in this process (``Worker.start()``), in their own registry."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    broker = Admin(worker.redis_url)
    registry.register(_collector(worker, broker))
    registry.register(SupervisorCollector(Counter()))  # no supervisor: nothing restarts

    def healthy() -> bool:
        running = host()
        return running is not None and running.alive()

    assert worker.metrics_port is not None
    server = MetricsServer(
        worker.metrics_port,
        registry,
        healthy=healthy,
        ready=lambda: healthy() and broker.ping(),
        host=worker.metrics_host,
    )
    return server, PrometheusMiddleware(
        registry, declared=worker.declared_keys, key_labels=worker.options.metrics_keys
    )

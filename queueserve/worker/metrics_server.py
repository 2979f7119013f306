"""The worker's metrics endpoint: merged from partition processes, or from this process.

The port listens on 127.0.0.1 unless told otherwise (a batch key may hold what its producer
considers private), serves at most ``MAX_CONNECTIONS`` connections at once and drops one
silent for ``IDLE_TIMEOUT_S``; when all are taken, a new one takes the place of the one
slowest to send its request, so slow clients cannot keep scrapes out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

from queueserve.broker.admin import Admin
from queueserve.errors import QueueServeError
from queueserve.serving import Serving
from queueserve.worker.metrics import DEFAULT_HOST, KEY_LABELS, PrometheusMiddleware, _prometheus
from queueserve.worker.queue_metrics import QueueCollector, SupervisorCollector

if TYPE_CHECKING:
    from queueserve.worker.partition import PartitionHost
    from queueserve.worker.supervisor import Supervisor

log = logging.getLogger(__name__)


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


MAX_CONNECTIONS = 8  # connections served at once (then the slowest is closed for a new one)
IDLE_TIMEOUT_S = 5.0  # a connection silent this long (no request, no reading) is dropped
EVICT_WAIT_S = 1.0  # how long a new connection waits for the place of the one it closed


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS at once, so connections cannot pile
    up threads. When all are taken, a new connection takes the place of the one that has
    been sending its request the longest (a scraper sends its own at once): slow clients,
    which a silence timeout alone would let hold every place by sending a byte now and then,
    cannot keep scrapes out. A new connection is closed at once only when every place holds a
    request being answered."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        if ":" in address[0]:  # an IPv6 host such as ::1
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._reading: dict[Any, float] = {}  # connection -> when it came, until its request is in

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not (
            self._evict_slowest() and self._slots.acquire(timeout=EVICT_WAIT_S)
        ):
            log.warning(
                "metrics http: %d connections open already; closed one from %s",
                MAX_CONNECTIONS,
                client_address,
            )
            self.shutdown_request(request)
            return
        with self._lock:
            self._reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.request_read(request)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.request_read(request)
            self._slots.release()

    def request_read(self, request: Any) -> None:
        """``request``'s connection sent its whole request (or is done): no longer slow."""
        with self._lock:
            self._reading.pop(request, None)

    def _evict_slowest(self) -> bool:
        """Close the connection that has been sending its request the longest; its thread
        ends and frees its place. False when every connection has sent its request."""
        with self._lock:
            if not self._reading:
                return False
            slowest = min(self._reading, key=self._reading.__getitem__)
            del self._reading[slowest]
        with contextlib.suppress(OSError):  # closed meanwhile
            slowest.shutdown(socket.SHUT_RDWR)
        return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away before its answer was written (a reset, a closed socket,
        # a timeout) is its own business: one debug line, not a traceback on stderr
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.debug("metrics http: %s went away: %s", client_address, error)
            return
        super().handle_error(request, client_address)


def _probe(path: str, check: Callable[[], bool]) -> bool:
    """A probe's answer: no (503) when it cannot be told, Redis refusing a read it needs (a
    key of another type under a serving's name: anyone may write one), said in the log."""
    try:
        return check()
    except QueueServeError as e:
        log.warning("metrics http: %s answers 503: %s", path, e)
        return False


class _Rendered:
    """The registry's text. Scrapes that arrive while a collection runs wait for it and share
    its result, so concurrent scrapers cost Redis and memory once; a scrape that finds none
    running collects afresh, so what it reads is never older than its request (reusing a
    collection for a second made a scrape right after a run read the counters from before
    it)."""

    def __init__(self, render: Callable[[], bytes]) -> None:
        self._render = render
        self._cond = threading.Condition()
        self._running = False
        self._collections = 0
        self._result: bytes | BaseException = b""

    def __call__(self) -> bytes:
        with self._cond:
            if self._running:
                joined = self._collections
                self._cond.wait_for(lambda: self._collections != joined)
                return self._unwrap(self._result)
            self._running = True
        result: bytes | BaseException
        try:
            result = self._render()
        except Exception as exc:  # the waiters get it too, each raising in its own request
            result = exc
        with self._cond:
            self._running = False
            self._collections += 1
            self._result = result
            self._cond.notify_all()
        return self._unwrap(result)

    @staticmethod
    def _unwrap(result: bytes | BaseException) -> bytes:
        if isinstance(result, BaseException):
            raise result
        return result


class MetricsServer:
    """Serves /metrics, /healthz and /readyz on ``host``:``port`` from a background thread."""

    def __init__(
        self,
        port: int,
        registry: Any,
        healthy: Callable[[], bool],
        ready: Callable[[], bool],
        host: str = DEFAULT_HOST,
    ) -> None:
        pc = _prometheus()
        metrics = _Rendered(lambda: bytes(pc.generate_latest(registry)))

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_TIMEOUT_S  # a silent connection must not keep its thread
            server: _BoundedHTTPServer

            def parse_request(self) -> bool:
                parsed = super().parse_request()
                self.server.request_read(self.request)  # its head is in: not a slow client
                return parsed

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, metrics(), pc.CONTENT_TYPE_LATEST)
                elif self.path in ("/healthz", "/readyz"):
                    ok = _probe(self.path, healthy if self.path == "/healthz" else ready)
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

        self.server = _BoundedHTTPServer((host, port), Handler)
        self.host = host
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="queueserve-metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        self._thread.start()
        host = f"[{self.host}]" if ":" in self.host else self.host
        log.info(
            "metrics: http://%s:%d/metrics (and /healthz, /readyz)%s",
            host,
            self.port,
            " on every interface" if self.host in ("0.0.0.0", "::") else "",
        )
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

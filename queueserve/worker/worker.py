"""The public worker: serve one or more servings until told to stop."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import platform
import threading
import time
from collections.abc import Sequence
from importlib import metadata

from queueserve.broker.consumer import Consumer
from queueserve.broker.retry import RedisFailure, Retry
from queueserve.broker.urls import redact_url
from queueserve.errors import RedisUnavailable
from queueserve.serving import Partition, Serving
from queueserve.settings import Settings, check_prefix, check_redis_url
from queueserve.wire.keys import Keys
from queueserve.wire.timing import HEARTBEAT_TTL_MS
from queueserve.worker.config import ServingSource, WorkerConfig
from queueserve.worker.metrics_server import (
    MetricsServer,
    in_process_metrics,
    supervisor_metrics,
)
from queueserve.worker.middleware import Middleware
from queueserve.worker.options import WorkerOptions
from queueserve.worker.partition import PartitionHost, consumer_prefix
from queueserve.worker.partition_process import host_for, partition_main
from queueserve.worker.supervisor import (
    EXIT_CRASH_LOOP,
    EXIT_ERROR,
    EXIT_FORCED,
    EXIT_OK,
    Supervisor,
    partition_for,
    resolve_partitions,
)

log = logging.getLogger(__name__)

# Exit codes of `queueserve worker` (docs/operations.md); the others come from the supervisor.
EXIT_USAGE = 2
# How long a starting worker retries an unreachable Redis before it gives up (exit 1): long
# enough for a Redis started beside it (compose, a pod's sidecar), short enough to be told.
REDIS_STARTUP_WAIT_S = 5.0
__all__ = ["EXIT_CRASH_LOOP", "EXIT_ERROR", "EXIT_FORCED", "EXIT_OK", "EXIT_USAGE", "Worker"]


class Worker:
    """Consume the servings' streams, run batches, and reply.

    >>> qs.Worker([square], redis_url="redis://localhost:6379/0", partitions="auto").run()

    ``run()`` starts one process per partition and supervises them until SIGTERM/SIGINT (or
    ``stop()``): partitions then stop reading, finish and answer what they hold, ack, and exit,
    within ``shutdown_timeout``. A second signal exits at once. ``handle_signals=False`` leaves
    signals to an application that embeds the worker. ``start()``/``stop()`` instead serve one
    partition in background threads of this process (no supervision): for embedding and tests.

    Servings may be given as objects or as ``"module:attr"`` strings; partition processes
    import strings themselves, so their functions need not be picklable.

    ``metrics_port`` serves Prometheus metrics on ``metrics_host`` (127.0.0.1 unless told:
    ``"0.0.0.0"`` to be scraped from other hosts), labelling the declared batch keys and at
    most ``metrics_keys`` others by name; the rest are summed under ``key="other"``.

    The options are WorkerOptions (queueserve/worker/options.py), which checks them. One
    left out (None) is taken from its ``QUEUESERVE_<NAME>`` environment variable, else its
    default; ``partitions``'s default is 1 here (``queueserve worker``: auto), and
    ``QUEUESERVE_PARTITIONS`` still wins over it.
    """

    def __init__(
        self,
        servings: ServingSource | Sequence[ServingSource],
        *,
        redis_url: str | None = None,
        prefix: str | None = None,
        partitions: int | str | None = None,
        batch_size: int | None = None,
        batch_timeout: float | str | None = None,
        batch_keys: Sequence[str] | None = None,
        max_concurrent_batches: int | None = None,
        shutdown_timeout: float | str | None = None,
        max_restarts: int | None = None,
        restart_window: float | str | None = None,
        max_batch_seconds: float | str | None = None,
        max_batches_per_partition: int | None = None,
        max_partition_memory: int | str | None = None,
        torch_threads: int | None = None,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        metrics_keys: int | None = None,
        log_format: str | None = None,
        log_level: str | None = None,
        middleware: Sequence[Middleware] = (),
        handle_signals: bool = True,
    ) -> None:
        sources = [servings] if isinstance(servings, Serving | str) else list(servings)
        keywords = locals()  # those named as WorkerOptions fields (test_options holds it)
        options = WorkerOptions.of(
            {k: v for k, v in keywords.items() if k in WorkerOptions.model_fields and v is not None}
        )
        if "partitions" not in options.model_fields_set:  # neither keyword nor variable
            options = options.model_copy(update={"partitions": 1})
        self.options = options
        if "log_level" in options.model_fields_set:  # given, or its variable: else the app's
            logging.getLogger("queueserve").setLevel(options.log_level)
        require_extras(options)
        settings = Settings()
        if redis_url:
            self.redis_source = "given"
        elif "redis_url" in settings.model_fields_set:
            self.redis_source = "from QUEUESERVE_REDIS_URL"
        else:
            self.redis_source = "the default: pass --redis-url or set QUEUESERVE_REDIS_URL"
        self.config = WorkerConfig(
            redis_url=check_redis_url(redis_url or settings.redis_url),
            prefix=check_prefix(prefix) if prefix else settings.prefix,
            options=options,
            threads_per_partition=os.cpu_count() or 1,  # divided among partitions in run()
            log_level=logging.getLogger("queueserve").getEffectiveLevel(),
            middleware=tuple(middleware),
        )
        self.metrics_port = options.metrics_port
        self.metrics_host = options.metrics_host
        self.sources = sources
        self.servings = self.config.servings(sources)  # fails here, early, on bad servings
        names = [s.name for s in self.servings]
        if not names:
            raise TypeError("Worker needs one or more qs.Serving objects or module:attr strings")
        if len(set(names)) != len(names):
            raise ValueError(f"serving names must be unique in one worker, got {names}")
        self.handle_signals = handle_signals
        self._host: PartitionHost | None = None
        self._supervisor: Supervisor | None = None
        self._metrics: MetricsServer | None = None
        self._stopped = threading.Event()

    @property
    def redis_url(self) -> str:
        return self.config.redis_url

    @property
    def prefix(self) -> str:
        return self.config.prefix

    @property
    def declared_keys(self) -> tuple[str, ...]:
        """The batch keys read from the start: ``default`` and every ``batch_keys`` one."""
        return tuple(dict.fromkeys(("default", *self.config.options.batch_keys)))

    def run(self) -> int:
        """Serve with one supervised process per partition until stopped; returns the exit
        code (0; EXIT_ERROR when a partition could not start; EXIT_CRASH_LOOP when one kept
        dying). Raises RedisUnavailable when Redis does not answer within a few seconds."""
        self._log_start()
        wait_for_redis(self.redis_url, self.servings[0].name, self.prefix)
        count, kind = resolve_partitions(self.options.partitions)
        partitions = [partition_for(i, count, kind) for i in range(count)]
        # partitions x torch threads must not exceed the cores (docs/design.md §6), unless
        # the operator says otherwise (--torch-threads)
        threads = self.options.torch_threads or max(1, (os.cpu_count() or 1) // count)
        config = dataclasses.replace(self.config, threads_per_partition=threads)
        log.info(
            "partitions: %d (%s), %s each",
            count,
            ", ".join(p.device for p in partitions),
            "1 torch thread"
            if config.threads_per_partition == 1
            else f"{config.threads_per_partition} torch threads",
        )
        self._supervisor = Supervisor(
            partition_main,
            (self.sources, config),
            partitions,
            shutdown_timeout=self.config.options.shutdown_timeout,
            max_restarts=self.options.max_restarts,
            restart_window=self.options.restart_window,
            max_batch_seconds=self.config.limits.max_batch_seconds,
            handle_signals=self.handle_signals,
        )
        self._supervisor.on_exit.append(self._release_dead_partition)
        if self._stopped.is_set():
            return EXIT_OK
        if self.metrics_port is None:
            return self._supervisor.run()
        with supervisor_metrics(self, self._supervisor) as server:
            self.metrics_port = server.port
            return self._supervisor.run()

    def _release_dead_partition(self, pid: int) -> None:
        """Off the supervisor's thread: Redis may be away, and the restart must not wait."""
        threading.Thread(
            target=release_consumers_of,
            name=f"queueserve-release-{pid}",
            daemon=True,
            args=(self.redis_url, [Keys(self.prefix, s.name) for s in self.servings], pid),
        ).start()

    def _log_start(self) -> None:
        log.info(
            "queueserve %s worker starting (pid %d, Python %s)",
            _version(),
            os.getpid(),
            platform.python_version(),
        )
        log.info(
            "Redis: %s (%s), key prefix %r",
            redact_url(self.redis_url),
            self.redis_source,
            self.prefix,
        )
        for serving in self.servings:
            options = serving.options()
            shown = " ".join(
                f"{k}={v}"
                for k, v in options.items()
                if v not in ("", False) and k != "batch_timeout"
            )
            log.info("serving %s: batch_timeout=%gs %s", serving.name, serving.batch_timeout, shown)

    def start(self) -> Worker:
        """Serve partition 0 in background threads of this process; returns at once."""
        if self._host is not None:
            raise RuntimeError("this worker was started already")
        extra: list[Middleware] = []
        if self.metrics_port is not None:
            server, prometheus = in_process_metrics(self, lambda: self._host)
            self._metrics = server.start()
            self.metrics_port = server.port
            extra.append(prometheus)
        self._host = host_for(self.servings, self.config, Partition(), extra)
        self._host.start()
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """Stop gracefully: stop reading, finish and answer what is held. For ``start()``,
        returns True when everything held was answered within the timeout."""
        self._stopped.set()
        if self._supervisor is not None:
            self._supervisor.stop()
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None
        if self._host is None:
            return True
        host, self._host = self._host, None
        return host.stop(self.config.options.shutdown_timeout if timeout is None else timeout)

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _version() -> str:
    try:
        return metadata.version("queueserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


# option -> (module it needs, the extra that brings it, the option as a flag)
_EXTRAS = {
    "metrics_port": ("prometheus_client", "metrics", "--metrics-port"),
    "log_format": ("pythonjsonlogger", "logs", "--log-format json"),
}


def require_extras(options: WorkerOptions) -> None:
    """An ImportError naming the extra to install, said before anything starts (a partition
    would otherwise die of a bare ModuleNotFoundError in a crash loop)."""
    for name, (module, extra, flag) in _EXTRAS.items():
        if getattr(options, name) in (None, "text"):
            continue
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"{flag} needs the {extra} extra: pip install 'queueserve[{extra}]'")


def wait_for_redis(url: str, serving: str, prefix: str) -> None:
    """Return once Redis answers; RedisUnavailable after REDIS_STARTUP_WAIT_S of retries.
    Checked here, once, so an unreachable Redis is one line and exit 1, not every partition
    dying with a traceback until the crash-loop limit."""
    broker = Consumer(url)
    retry = Retry(broker.outage, "startup check")
    try:
        # any read: it raises with redis-py's reason
        retry.run(
            lambda: broker.meta(Keys(prefix, serving)),
            give_up_at=time.monotonic() + REDIS_STARTUP_WAIT_S,
        )
    except RedisUnavailable as e:
        raise RedisUnavailable(
            f"{e} (retried for {REDIS_STARTUP_WAIT_S:g}s), or point the worker at yours with "
            "--redis-url or QUEUESERVE_REDIS_URL"
        ) from None
    finally:
        broker.close()


def release_consumers_of(url: str, keys_list: list[Keys], pid: int) -> None:
    """Take the consumers of dead partition process ``pid`` off every serving's live set, so
    the other partitions reclaim its entries at their next pass instead of ``DEAD_AFTER_S``
    after its last heartbeat (docs/design.md §5 "No loss"). Best effort: when Redis cannot be
    reached, the heartbeat's age tells the same a little later."""
    broker = Consumer(url, owner=f"supervisor (release of pid {pid})")
    try:
        mine = consumer_prefix(pid)
        dead = {
            consumer
            for keys in keys_list
            for consumer in broker.alive_consumers(keys, HEARTBEAT_TTL_MS / 1000)
            if consumer.startswith(mine)
        }
        for consumer in dead:
            broker.leave(keys_list, consumer)
            log.info("consumer %s of dead partition pid %d left the live set", consumer, pid)
    except RedisFailure as e:
        log.info("could not release the consumers of dead partition pid %d: %s", pid, e)
    finally:
        broker.close()

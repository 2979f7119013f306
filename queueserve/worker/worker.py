"""The public worker: serve one or more servings until told to stop."""

from __future__ import annotations

import copy
import dataclasses
import logging
import multiprocessing
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from multiprocessing.connection import Connection
from typing import Any

from queueserve._durations import parse_duration
from queueserve.broker.consumer import Consumer
from queueserve.broker.retry import RedisFailure, Retry
from queueserve.broker.urls import redact_url
from queueserve.errors import RedisUnavailable
from queueserve.serving import (
    MAX_BATCH_TIMEOUT_S,
    Partition,
    Serving,
    _check_batch_size,
    _check_duration,
)
from queueserve.settings import Settings, check_prefix, check_redis_url
from queueserve.wire.protocol import Keys
from queueserve.wire.timing import HEARTBEAT_TTL_MS
from queueserve.worker.loading import load_servings
from queueserve.worker.metrics_server import (
    DEFAULT_HOST,
    KEY_LABELS,
    MetricsServer,
    in_process_metrics,
    supervisor_metrics,
)
from queueserve.worker.middleware import Middleware
from queueserve.worker.partition import PartitionHost, StartupFailed, consumer_prefix
from queueserve.worker.supervisor import (
    EXIT_CRASH_LOOP,
    EXIT_ERROR,
    EXIT_FORCED,
    EXIT_OK,
    Supervisor,
    check_partitions,
    partition_for,
    resolve_partitions,
)
from queueserve.worker.watchdog import (
    EXIT_RECYCLE,
    EXIT_THREAD_DIED,
    BatchClock,
    Limits,
    parse_bytes,
    recycle_reason,
)

log = logging.getLogger(__name__)

# Exit codes of `queueserve worker` (docs/operations.md); the others come from the supervisor.
EXIT_USAGE = 2
# How long a starting worker retries an unreachable Redis before it gives up (exit 1): long
# enough for a Redis started beside it (compose, a pod's sidecar), short enough to be told.
REDIS_STARTUP_WAIT_S = 5.0
__all__ = ["EXIT_CRASH_LOOP", "EXIT_ERROR", "EXIT_FORCED", "EXIT_OK", "EXIT_USAGE", "Worker"]

ServingSource = Serving | str  # a Serving, or "module:attr" that names servings


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a partition process needs besides its servings (picklable)."""

    redis_url: str
    prefix: str
    batch_size: int | None
    batch_timeout: float | None
    batch_keys: tuple[str, ...]
    max_concurrent_batches: int
    shutdown_timeout: float
    threads_per_partition: int
    log_level: int
    metrics: bool = False
    metrics_keys: int = KEY_LABELS
    middleware: tuple[Middleware, ...] = ()
    limits: Limits = field(default_factory=Limits)

    def servings(self, sources: Sequence[ServingSource]) -> list[Serving]:
        loaded = [s for src in sources for s in _load(src)]
        return [_with_overrides(s, self.batch_size, self.batch_timeout) for s in loaded]


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
    """

    def __init__(
        self,
        servings: ServingSource | Sequence[ServingSource],
        *,
        redis_url: str | None = None,
        prefix: str | None = None,
        partitions: int | str = 1,
        batch_size: int | None = None,
        batch_timeout: float | str | None = None,
        batch_keys: Sequence[str] = (),
        max_concurrent_batches: int = 1,
        shutdown_timeout: float | str = 30.0,
        max_restarts: int = 5,
        restart_window: float | str = 60.0,
        max_batch_seconds: float | str | None = None,
        max_batches_per_partition: int | None = None,
        max_partition_memory: int | str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = DEFAULT_HOST,
        metrics_keys: int = KEY_LABELS,
        middleware: Sequence[Middleware] = (),
        handle_signals: bool = True,
    ) -> None:
        sources = [servings] if isinstance(servings, Serving | str) else list(servings)
        if batch_size is not None:
            _check_batch_size(batch_size)
        if isinstance(max_concurrent_batches, bool) or not isinstance(max_concurrent_batches, int) \
                or max_concurrent_batches < 1:
            raise ValueError(
                f"max_concurrent_batches must be an int >= 1, got {max_concurrent_batches!r}"
            )
        self.partitions = check_partitions(partitions)
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
            batch_size=batch_size,
            batch_timeout=None if batch_timeout is None
            else _check_duration("batch_timeout", batch_timeout, MAX_BATCH_TIMEOUT_S),
            batch_keys=tuple(batch_keys),
            max_concurrent_batches=max_concurrent_batches,
            shutdown_timeout=parse_duration(shutdown_timeout, what="shutdown_timeout"),
            threads_per_partition=os.cpu_count() or 1,  # divided among partitions in run()
            log_level=logging.getLogger("queueserve").getEffectiveLevel(),
            metrics=metrics_port is not None,
            metrics_keys=_check_metrics_keys(metrics_keys),
            middleware=tuple(middleware),
            limits=_limits(max_batch_seconds, max_batches_per_partition, max_partition_memory),
        )
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.sources = sources
        self.servings = self.config.servings(sources)  # fails here, early, on bad servings
        names = [s.name for s in self.servings]
        if not names:
            raise TypeError("Worker needs one or more qs.Serving objects or module:attr strings")
        if len(set(names)) != len(names):
            raise ValueError(f"serving names must be unique in one worker, got {names}")
        self.max_restarts = max_restarts
        self.restart_window = parse_duration(restart_window, what="restart_window")
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
        return tuple(dict.fromkeys(("default", *self.config.batch_keys)))

    def run(self) -> int:
        """Serve with one supervised process per partition until stopped; returns the exit
        code (0; EXIT_ERROR when a partition could not start; EXIT_CRASH_LOOP when one kept
        dying). Raises RedisUnavailable when Redis does not answer within a few seconds."""
        self._log_start()
        wait_for_redis(self.redis_url, self.servings[0].name, self.prefix)
        count, kind = resolve_partitions(self.partitions)
        partitions = [partition_for(i, count, kind) for i in range(count)]
        # partitions x torch threads must not exceed the cores (docs/design.md §6)
        config = dataclasses.replace(
            self.config, threads_per_partition=max(1, (os.cpu_count() or 1) // count)
        )
        log.info(
            "partitions: %d (%s), %s each", count, ", ".join(p.device for p in partitions),
            "1 torch thread" if config.threads_per_partition == 1
            else f"{config.threads_per_partition} torch threads",
        )
        self._supervisor = Supervisor(
            partition_main,
            (self.sources, config),
            partitions,
            shutdown_timeout=self.config.shutdown_timeout,
            max_restarts=self.max_restarts,
            restart_window=self.restart_window,
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
            target=release_consumers_of, name=f"queueserve-release-{pid}", daemon=True,
            args=(self.redis_url, [Keys(self.prefix, s.name) for s in self.servings], pid),
        ).start()

    def _log_start(self) -> None:
        log.info("queueserve %s worker starting (pid %d, Python %s)", _version(), os.getpid(),
                 platform.python_version())
        log.info("Redis: %s (%s), key prefix %r", redact_url(self.redis_url), self.redis_source,
                 self.prefix)
        for serving in self.servings:
            options = serving.options()
            shown = " ".join(f"{k}={v}" for k, v in options.items()
                             if v not in ("", False) and k != "batch_timeout")
            log.info("serving %s: batch_timeout=%gs %s", serving.name, serving.batch_timeout,
                     shown)

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
        self._host = _host_for(self.servings, self.config, Partition(), extra)
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
        return host.stop(self.config.shutdown_timeout if timeout is None else timeout)

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _version() -> str:
    try:
        return metadata.version("queueserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def wait_for_redis(url: str, serving: str, prefix: str) -> None:
    """Return once Redis answers; RedisUnavailable after REDIS_STARTUP_WAIT_S of retries.
    Checked here, once, so an unreachable Redis is one line and exit 1, not every partition
    dying with a traceback until the crash-loop limit."""
    broker = Consumer(url)
    retry = Retry(broker.outage, "startup check")
    try:
        # any read: it raises with redis-py's reason
        retry.run(lambda: broker.meta(Keys(prefix, serving)),
                  give_up_at=time.monotonic() + REDIS_STARTUP_WAIT_S)
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


def partition_main(
    sources: Sequence[ServingSource], config: WorkerConfig, partition: Partition,
    report: Connection, shared_clock: Any,
) -> None:
    """Entry point of a partition process (spawned by the supervisor), which it tells over
    ``report`` whether it started, why not, and what it drained, and through ``shared_clock``
    when its running batch started (queueserve.worker.watchdog)."""
    # The supervisor turns Ctrl-C into SIGTERM for every partition; one signal is enough.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threads = str(config.threads_per_partition)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)
    logging.basicConfig(
        level=config.log_level,
        format=f"%(asctime)s %(levelname)s partition-{partition.index} %(name)s: %(message)s",
    )
    # A SIGTERM sent to the whole process group arrives twice (directly and forwarded by the
    # supervisor): both mean "drain". Forcing is the supervisor's job (it SIGKILLs partitions).
    stop = threading.Event()
    wake = threading.Event()  # a SIGTERM, or a limit reached
    clock = BatchClock(shared_clock, wake, config.limits.max_batches_per_partition)

    def drain(_signum: int, _frame: object) -> None:
        stop.set()
        wake.set()

    signal.signal(signal.SIGTERM, drain)
    try:
        host = _start_partition(sources, config, partition, clock)
    except Exception as e:
        # One line, said by the supervisor; the traceback only for those who ask for it.
        log.debug("partition %d could not start", partition.index, exc_info=True)
        report.send(("failed", str(e) if isinstance(e, StartupFailed)
                     else f"{type(e).__name__}: {e}"))
        sys.exit(EXIT_ERROR)
    report.send(("started",))
    code = _serve_until_stopped(partition, config.limits, clock, stop, wake)
    host.stop(config.shutdown_timeout)
    report.send(("stopped", host.drained, host.summary))
    sys.exit(code)


def _serve_until_stopped(
    partition: Partition, limits: Limits, clock: BatchClock, stop: threading.Event,
    wake: threading.Event,
) -> int:
    """Wait for a SIGTERM, the supervisor's death or a recycling limit; the exit code."""
    # The spawn sentinel, not getppid(): it was handed over at spawn, so a supervisor killed
    # while this partition was still loading its model is seen too (getppid() read after the
    # load would already name the reaper that adopted us).
    supervisor = multiprocessing.parent_process()
    while True:
        wake.wait(1.0)
        if stop.is_set():
            return EXIT_OK
        if supervisor is not None and not supervisor.is_alive():  # do not serve on, orphaned
            log.warning(
                "partition %d: the worker process is gone; draining and exiting", partition.index
            )
            return EXIT_OK
        if (why := recycle_reason(limits, clock)) is not None:
            log.info("partition %d recycling: %s; draining, then a fresh one starts",
                     partition.index, why)
            return EXIT_RECYCLE


def _start_partition(
    sources: Sequence[ServingSource], config: WorkerConfig, partition: Partition,
    clock: BatchClock,
) -> PartitionHost:
    servings = config.servings(sources)
    _bind_device(partition, config.threads_per_partition)
    extra: list[Middleware] = [clock]
    if config.metrics:  # the supervisor set PROMETHEUS_MULTIPROC_DIR for us
        from queueserve.worker.metrics import PrometheusMiddleware

        extra.append(PrometheusMiddleware(
            declared=("default", *config.batch_keys), key_labels=config.metrics_keys
        ))
    # A long-lived thread dying of a bug ends the process at once (a drain could wait on
    # that thread for ever); the supervisor restarts it, and what it held is reclaimed.
    host = _host_for(servings, config, partition, extra,
                     on_fatal=lambda: os._exit(EXIT_THREAD_DIED))
    clock.on_limit = host.stop_reading
    host.start(freeze_heap=True)
    return host


def _bind_device(partition: Partition, threads: int) -> None:
    if "torch" not in sys.modules and not partition.device.startswith("cuda"):
        return
    import torch

    if partition.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(partition.device))
    else:
        torch.set_num_threads(threads)


def _host_for(
    servings: list[Serving], config: WorkerConfig, partition: Partition,
    extra: Sequence[Middleware] = (), on_fatal: Callable[[], None] = lambda: None,
) -> PartitionHost:
    return PartitionHost(
        servings, config.redis_url, config.prefix, partition,
        batch_keys=config.batch_keys, max_concurrent_batches=config.max_concurrent_batches,
        middleware=[*config.middleware, *extra], on_fatal=on_fatal,
    )


def _check_metrics_keys(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"metrics_keys must be an int >= 0 (batch keys with a metrics label of their own; "
            f"the rest are summed under key=\"other\"), got {value!r}"
        )
    return value


def _limits(
    max_batch_seconds: float | str | None, max_batches: int | None, max_memory: int | str | None
) -> Limits:
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
    ):
        raise ValueError(f"max_batches_per_partition must be an int >= 1, got {max_batches!r}")
    return Limits(
        max_batch_seconds=None if max_batch_seconds is None
        else parse_duration(max_batch_seconds, what="max_batch_seconds"),
        max_batches_per_partition=max_batches,
        max_partition_memory=parse_bytes(max_memory, "max_partition_memory"),
    )


def _load(source: ServingSource) -> list[Serving]:
    if isinstance(source, Serving):
        return [source]
    if isinstance(source, str):
        return load_servings(source)
    raise TypeError(f"expected a qs.Serving or a 'module:attr' string, got {source!r}")


def _with_overrides(
    serving: Serving, batch_size: int | None, batch_timeout: float | None
) -> Serving:
    if batch_size is None and batch_timeout is None:
        return serving
    changed = copy.copy(serving)
    if batch_size is not None:
        changed.batch_size = batch_size
    if batch_timeout is not None:
        changed.batch_timeout = batch_timeout
    return changed

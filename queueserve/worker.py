"""The public worker: serve one or more servings until told to stop."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._durations import parse_duration
from .loading import load_servings
from .middleware import Middleware
from .partition import PartitionHost
from .serving import Partition, Serving, _check_batch_size
from .settings import Settings
from .supervisor import (
    EXIT_CRASH_LOOP,
    EXIT_FORCED,
    EXIT_OK,
    Supervisor,
    check_partitions,
    partition_for,
    resolve_partitions,
)
from .worker_metrics import MetricsServer, in_process_metrics, supervisor_metrics

log = logging.getLogger(__name__)

# Exit codes of `queueserve worker` (docs/operations.md).
EXIT_ERROR = 1
EXIT_USAGE = 2
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
    middleware: tuple[Middleware, ...] = ()

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
        metrics_port: int | None = None,
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
        self.config = WorkerConfig(
            redis_url=redis_url or settings.redis_url,
            prefix=prefix or settings.prefix,
            batch_size=batch_size,
            batch_timeout=None if batch_timeout is None
            else parse_duration(batch_timeout, what="batch_timeout"),
            batch_keys=tuple(batch_keys),
            max_concurrent_batches=max_concurrent_batches,
            shutdown_timeout=parse_duration(shutdown_timeout, what="shutdown_timeout"),
            threads_per_partition=os.cpu_count() or 1,  # divided among partitions in run()
            log_level=logging.getLogger("queueserve").getEffectiveLevel(),
            metrics=metrics_port is not None,
            middleware=tuple(middleware),
        )
        self.metrics_port = metrics_port
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

    def run(self) -> int:
        """Serve with one supervised process per partition until stopped; returns the exit
        code (0, or EXIT_CRASH_LOOP when a partition kept dying)."""
        count, kind = resolve_partitions(self.partitions)
        partitions = [partition_for(i, count, kind) for i in range(count)]
        # partitions x torch threads must not exceed the cores (DESIGN §6)
        config = dataclasses.replace(
            self.config, threads_per_partition=max(1, (os.cpu_count() or 1) // count)
        )
        self._supervisor = Supervisor(
            partition_main,
            (self.sources, config),
            partitions,
            shutdown_timeout=self.config.shutdown_timeout,
            max_restarts=self.max_restarts,
            restart_window=self.restart_window,
            handle_signals=self.handle_signals,
        )
        if self._stopped.is_set():
            return EXIT_OK
        if self.metrics_port is None:
            return self._supervisor.run()
        with supervisor_metrics(self, self._supervisor) as server:
            self.metrics_port = server.port
            return self._supervisor.run()

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


def partition_main(
    sources: Sequence[ServingSource], config: WorkerConfig, partition: Partition
) -> None:
    """Entry point of a partition process (spawned by the supervisor)."""
    # The supervisor turns Ctrl-C into SIGTERM for every partition; one signal is enough.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threads = str(config.threads_per_partition)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)
    logging.basicConfig(
        level=config.log_level,
        format=f"%(asctime)s %(levelname)s partition-{partition.index} %(name)s: %(message)s",
    )
    servings = config.servings(sources)
    _bind_device(partition, config.threads_per_partition)
    extra: list[Middleware] = []
    if config.metrics:  # the supervisor set PROMETHEUS_MULTIPROC_DIR for us
        from .metrics import PrometheusMiddleware

        extra.append(PrometheusMiddleware())
    # A runner thread dying of a bug ends the process; the supervisor restarts it.
    host = _host_for(servings, config, partition, extra, on_fatal=lambda: os._exit(EXIT_ERROR))
    stop = threading.Event()
    # A SIGTERM sent to the whole process group arrives twice (directly and forwarded by the
    # supervisor): both mean "drain". Forcing is the supervisor's job (it SIGKILLs partitions).
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    supervisor = os.getppid()
    host.start()
    while not stop.wait(1.0):
        if os.getppid() != supervisor:  # the supervisor was killed: do not serve on, orphaned
            logging.getLogger(__name__).warning(
                "partition %d: the worker process is gone; draining and exiting", partition.index
            )
            break
    host.stop(config.shutdown_timeout)
    sys.exit(EXIT_OK)


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

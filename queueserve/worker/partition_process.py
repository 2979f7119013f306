"""A partition process: the entry point the supervisor spawns, which loads the servings,
binds the device, serves until told to stop or recycled, and reports how it went."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from queueserve import tracing
from queueserve.serving import Partition, Serving
from queueserve.worker import logs
from queueserve.worker.config import ServingSource, WorkerConfig
from queueserve.worker.middleware import Middleware
from queueserve.worker.partition import PartitionHost, StartupFailed
from queueserve.worker.supervisor import EXIT_ERROR, EXIT_OK
from queueserve.worker.watchdog import (
    EXIT_RECYCLE,
    EXIT_THREAD_DIED,
    BatchClock,
    Limits,
    recycle_reason,
)

log = logging.getLogger(__name__)


def partition_main(
    sources: Sequence[ServingSource],
    config: WorkerConfig,
    partition: Partition,
    report: Connection,
    shared_clock: Any,
) -> None:
    """Entry point of a partition process (spawned by the supervisor), which it tells over
    ``report`` whether it started, why not, and what it drained, and through ``shared_clock``
    when its running batch started (queueserve.worker.watchdog)."""
    # The supervisor turns Ctrl-C into SIGTERM for every partition; one signal is enough.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threads = str(config.threads_per_partition)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)
    logs.configure(config.log_level, config.options.log_format, partition.index)
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
        report.send(("failed", _failed(e, partition), _in_setup(e)))
        sys.exit(EXIT_ERROR)
    report.send(("started",))
    code = _serve_until_stopped(partition, config.limits, clock, stop, wake)
    host.stop(config.options.shutdown_timeout)
    report.send(("stopped", host.drained, host.summary))
    sys.exit(code)


def _failed(error: Exception, partition: Partition) -> str:
    """Log why this partition could not start, and return it in one line (the supervisor says
    it). A serving's setup() that raised is its author's code: its traceback is an ERROR, once
    per start of the partition; the others (Redis refused a command) only at DEBUG."""
    serving = _in_setup(error)
    if serving is not None:
        log.error(
            "serving %s: setup() failed on partition %d (%s)",
            serving,
            partition.index,
            partition.device,
            exc_info=error.__cause__,
        )
    else:
        log.debug("partition %d could not start", partition.index, exc_info=True)
    return str(error) if isinstance(error, StartupFailed) else f"{type(error).__name__}: {error}"


def _in_setup(error: Exception) -> str | None:
    """The serving whose setup() raised ``error``'s cause; None when it was something else."""
    return error.serving if isinstance(error, StartupFailed) else None


def _serve_until_stopped(
    partition: Partition,
    limits: Limits,
    clock: BatchClock,
    stop: threading.Event,
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
            log.info(
                "partition %d recycling: %s; draining, then a fresh one starts",
                partition.index,
                why,
            )
            return EXIT_RECYCLE


def _start_partition(
    sources: Sequence[ServingSource],
    config: WorkerConfig,
    partition: Partition,
    clock: BatchClock,
) -> PartitionHost:
    servings = config.servings(sources)
    _bind_device(partition, config.threads_per_partition)
    extra: list[Middleware] = [clock]
    if config.options.metrics_port is not None:  # the supervisor set PROMETHEUS_MULTIPROC_DIR
        from queueserve.worker.metrics import PrometheusMiddleware

        extra.append(
            PrometheusMiddleware(
                declared=("default", *config.options.batch_keys),
                key_labels=config.options.metrics_keys,
            )
        )
    # A long-lived thread dying of a bug ends the process at once (a drain could wait on
    # that thread for ever); the supervisor restarts it, and what it held is reclaimed.
    host = host_for(servings, config, partition, extra, on_fatal=lambda: os._exit(EXIT_THREAD_DIED))
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


def host_for(
    servings: list[Serving],
    config: WorkerConfig,
    partition: Partition,
    extra: Sequence[Middleware] = (),
    on_fatal: Callable[[], None] = lambda: None,
) -> PartitionHost:
    return PartitionHost(
        servings,
        config.redis_url,
        config.prefix,
        partition,
        batch_keys=config.options.batch_keys,
        max_concurrent_batches=config.options.max_concurrent_batches,
        middleware=[*config.middleware, *extra, *_tracing()],
        on_fatal=on_fatal,
    )


def _tracing() -> list[Middleware]:
    """Spans of batches when the ``otel`` extra is installed (worker/tracing.py); without
    it, opentelemetry is never imported."""
    if not tracing.AVAILABLE:
        return []
    from queueserve.worker.tracing import TracingMiddleware

    return [TracingMiddleware()]

"""The public worker: serve one or more servings until told to stop."""

from __future__ import annotations

import copy
import logging
import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType

from ._durations import parse_duration
from .partition import PartitionHost
from .serving import Partition, Serving, _check_batch_size
from .settings import Settings

log = logging.getLogger(__name__)

# Exit codes of `queueserve worker`, documented in docs/operations.md.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_FORCED = 3  # a second SIGTERM/SIGINT: stopped at once, unfinished work left pending


class Worker:
    """Consume the servings' streams, run batches, and reply.

    >>> qs.Worker([square], redis_url="redis://localhost:6379/0").run()

    ``run()`` blocks until SIGTERM/SIGINT (or ``stop()``): it then stops reading, finishes and
    answers what it holds, acks, and returns, within ``shutdown_timeout``. A second signal exits
    at once. ``handle_signals=False`` leaves signals to an application that embeds the worker;
    ``start()``/``stop()`` run it in background threads of this process.
    """

    def __init__(
        self,
        servings: Serving | Sequence[Serving],
        *,
        redis_url: str | None = None,
        prefix: str | None = None,
        batch_size: int | None = None,
        batch_timeout: float | str | None = None,
        batch_keys: Sequence[str] = (),
        max_concurrent_batches: int = 1,
        shutdown_timeout: float | str = 30.0,
        handle_signals: bool = True,
    ) -> None:
        servings = [servings] if isinstance(servings, Serving) else list(servings)
        if not servings or not all(isinstance(s, Serving) for s in servings):
            raise TypeError(f"Worker needs one or more qs.Serving objects, got {servings!r}")
        names = [s.name for s in servings]
        if len(set(names)) != len(names):
            raise ValueError(f"serving names must be unique in one worker, got {names}")
        if batch_size is not None:
            _check_batch_size(batch_size)
        if batch_timeout is not None:
            batch_timeout = parse_duration(batch_timeout, what="batch_timeout")
        if isinstance(max_concurrent_batches, bool) or not isinstance(max_concurrent_batches, int) \
                or max_concurrent_batches < 1:
            raise ValueError(
                f"max_concurrent_batches must be an int >= 1, got {max_concurrent_batches!r}"
            )
        self.servings = [_with_overrides(s, batch_size, batch_timeout) for s in servings]
        settings = Settings()
        self.redis_url = redis_url or settings.redis_url
        self.prefix = prefix or settings.prefix
        self.batch_keys = tuple(batch_keys)
        self.max_concurrent_batches = max_concurrent_batches
        self.shutdown_timeout = parse_duration(shutdown_timeout, what="shutdown_timeout")
        self.handle_signals = handle_signals
        self._stop = threading.Event()
        self._host: PartitionHost | None = None
        self._signals = 0

    def start(self) -> Worker:
        """Start serving in background threads of this process; returns at once."""
        if self._host is not None:
            raise RuntimeError("this worker was started already")
        self._host = PartitionHost(
            self.servings, self.redis_url, self.prefix, Partition(),
            batch_keys=self.batch_keys, max_concurrent_batches=self.max_concurrent_batches,
        )
        self._host.start()
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """Stop reading, finish and answer what is held; True when everything was answered."""
        self._stop.set()
        if self._host is None:
            return True
        host, self._host = self._host, None
        return host.stop(self.shutdown_timeout if timeout is None else timeout)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT or ``stop()``; returns the exit code."""
        if self.handle_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        self.start()
        self._stop.wait()
        log.info("stopping: finishing what this worker holds (up to %gs)", self.shutdown_timeout)
        self.stop()
        return EXIT_OK

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(EXIT_FORCED)
        log.info("%s received: graceful shutdown", signal.Signals(signum).name)
        self._stop.set()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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

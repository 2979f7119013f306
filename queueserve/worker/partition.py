"""One partition: every serving of a worker, run in this process on one device."""

from __future__ import annotations

import functools
import gc
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from queueserve.broker.cache_stats import cache_counts
from queueserve.broker.consumer import Consumer
from queueserve.broker.retry import RedisFailure, Retry
from queueserve.errors import QueueServeError, RedisCommandError, RedisUnavailable
from queueserve.serving import Partition, Serving
from queueserve.wire.keys import Keys
from queueserve.wire.timing import HEARTBEAT_EVERY_S, HEARTBEAT_TTL_MS
from queueserve.worker.figures import ServingFigures
from queueserve.worker.middleware import Middleware, Middlewares
from queueserve.worker.pipeline.runner import ServingRunner
from queueserve.worker.watchdog import run_guarded

log = logging.getLogger(__name__)

YOUNG_COLLECTION_AFTER = 10_000  # objects allocated and not freed (Python's default: 700)


class StartupFailed(QueueServeError):
    """A partition could not start serving (a serving's setup() raised, Redis refused its
    first heartbeat); the message is one line naming the serving and the cause. ``serving``
    names the serving whose setup() raised (its exception is the cause), None otherwise."""

    def __init__(self, message: str, serving: str | None = None) -> None:
        super().__init__(message)
        self.serving = serving


class Tally(Middleware):
    """What a partition ran and answered: for its stop line (what it drained, what in all)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # hooks come from each serving's execute and reply threads
        self.batches = 0
        self.requests = 0
        self.items = 0

    def batch_finished(
        self, serving: Serving, key: str, partition: Partition, size: int, seconds: float
    ) -> None:
        with self._lock:
            self.batches += 1

    def replied(self, serving: Serving, items: int, requests: int, errors: dict[str, int]) -> None:
        with self._lock:
            self.requests += requests
            self.items += items

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"batches": self.batches, "requests": self.requests, "items": self.items}


def drained_line(drained: dict[str, int], total: dict[str, int]) -> str:
    """``drained 1 batch (2 requests) held at stop; 14 batches, 30 requests, 120 items in all``"""
    return (
        f"drained {_n(drained['batches'], 'batch', 'batches')} "
        f"({_n(drained['requests'], 'request', 'requests')}) held at stop; "
        f"{_n(total['batches'], 'batch', 'batches')}, "
        f"{_n(total['requests'], 'request', 'requests')}, {_n(total['items'], 'item', 'items')} "
        "in all"
    )


def _n(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def consumer_name(partition: Partition) -> str:
    """Unique per process start, readable in `queueserve stats`: host-pid-partition-nonce."""
    return f"{consumer_prefix(os.getpid())}{partition.index}-{uuid.uuid4().hex[:6]}"


def consumer_prefix(pid: int) -> str:
    """What the consumer names of process ``pid`` on this host start with."""
    return f"{socket.gethostname()}-{pid}-p"


class PartitionHost:
    """Runs the servings of one partition in the current process."""

    def __init__(
        self,
        servings: Sequence[Serving],
        url: str,
        prefix: str,
        partition: Partition,
        *,
        batch_keys: tuple[str, ...] = (),
        max_concurrent_batches: int = 1,
        middleware: Sequence[Middleware] = (),
        on_fatal: Callable[[], None] = lambda: None,
    ) -> None:
        self.partition = partition
        self.tally = Tally()
        self.figures = ServingFigures(servings)  # each serving's own, for the dashboard
        self.middleware = Middlewares([self.tally, self.figures, *middleware])
        self.consumer = consumer_name(partition)
        # Every loop of this partition shares the broker, so an outage is logged once here.
        self.broker = Consumer(url, owner=f"partition {partition.index} ({self.consumer})")
        self.servings = list(servings)
        self._on_fatal = on_fatal
        self.runners = [
            ServingRunner(
                s,
                self.broker,
                prefix,
                self.consumer,
                partition,
                batch_keys=batch_keys,
                max_concurrent_batches=max_concurrent_batches,
                middleware=self.middleware,
                on_fatal=self._thread_died,
            )
            for s in self.servings
        ]
        # A pool of what the partition runs (redis-py's 100 ran out at about 50 servings):
        # its servings' threads, the heartbeat's, and this one's start and stop.
        self.broker.size_pool(sum(r.redis_threads for r in self.runners) + 2)
        self._stopped = threading.Event()
        self._heart: threading.Thread | None = None
        self.summary: dict[str, int] = {}  # after stop(): totals, and what was drained at stop
        self.drained: dict[str, int] = {}
        self._info: dict[str, str | int] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "partition": partition.index,
            "partitions": partition.count,
            "device": partition.device,
            "servings": ",".join(s.name for s in self.servings),
            "started_ms": int(time.time() * 1000),
        }

    def start(self, *, freeze_heap: bool = False) -> None:
        """Set up every serving and start serving; StartupFailed (one line) when that fails.

        ``freeze_heap`` (a partition process, whose heap is the worker's own): once every
        serving is set up, collect and freeze what exists. A model's library (torch,
        transformers) leaves some 200,000 objects that the garbage collector's full passes
        would otherwise walk every few seconds under load, 150 ms each with every thread
        stopped: a stall in every request in flight. Frozen, they are never walked again;
        what the serving makes afterwards is collected as usual, once 10,000 more objects
        live than were freed (700 by default: one read of a hundred entries passed that, so
        the young generation was walked after nearly every read; the objects of a batch in
        flight are freed by their reference counts, and only cycles wait for a pass)."""
        for runner in self.runners:  # setup() prepares the object that will serve
            try:
                runner.serving.setup(self.partition)
            except Exception as e:
                raise StartupFailed(
                    f"setup() of serving {runner.serving.name!r} failed on partition "
                    f"{self.partition.index} ({self.partition.device}): {type(e).__name__}: {e}",
                    runner.serving.name,
                ) from e
        if freeze_heap:
            gc.collect()
            gc.freeze()
            gc.set_threshold(YOUNG_COLLECTION_AFTER, 10, 10)
        for keys in [k for runner in self.runners for k in runner.shards]:
            self._ride_out(functools.partial(self._clear_junk, keys))
        self._ride_out(self._beat)
        for runner in self.runners:
            self._ride_out(runner.start)
        self._heart = threading.Thread(
            target=run_guarded,
            name="queueserve-heartbeat",
            daemon=True,
            args=(
                f"partition {self.partition.index}: heartbeat",
                self._heartbeat_loop,
                self._thread_died,
                self._stopped.is_set,
            ),
        )
        self._heart.start()
        self.middleware.partition_started([r.serving for r in self.runners], self.partition)
        log.info(
            "partition %d (%s) serving %s as consumer %s",
            self.partition.index,
            self.partition.device,
            ", ".join(s.name for s in self.servings),
            self.consumer,
        )

    def stop_reading(self) -> None:
        """Take no more work in; what is held still runs and is answered (``stop``)."""
        for runner in self.runners:
            runner.stop_reading()

    def stop(self, timeout: float | None) -> bool:
        """Stop reading, finish and answer what is held; True when all of it was answered."""
        deadline = None if timeout is None else time.monotonic() + timeout
        at_stop = self.tally.snapshot()
        self.stop_reading()
        log.info(
            "partition %d draining: stopped reading, finishing what it holds%s",
            self.partition.index,
            "" if timeout is None else f" (up to {timeout:g}s)",
        )
        finished = all(
            r.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for r in self.runners
        )
        self._stopped.set()
        if self._heart is not None:
            self._heart.join(timeout=5)
        try:
            self.broker.leave([r.keys for r in self.runners], self.consumer)
        except RedisFailure as e:
            log.warning("could not unregister consumer %s: %s", self.consumer, e)
        if not finished:
            log.warning(
                "partition %d: shutdown timeout passed with work unfinished; it stays pending "
                "for other workers to reclaim",
                self.partition.index,
            )
        self.broker.close()
        self.summary = self.tally.snapshot()
        drained = {k: v - at_stop[k] for k, v in self.summary.items()}
        log.info(
            "partition %d stopped: %s", self.partition.index, drained_line(drained, self.summary)
        )
        self.drained = drained
        return finished

    def alive(self) -> bool:
        return all(t.is_alive() for r in self.runners for t in r.threads)

    def _thread_died(self) -> None:
        """A long-lived thread died of a bug (logged by watchdog.run_guarded): ``on_fatal``
        ends a partition process at once (worker.py exits with EXIT_THREAD_DIED, and the
        supervisor restarts it). Where it returns (a worker started in-process), the
        partition takes no more work and stops heartbeating, so that other workers reclaim
        what it holds once its heartbeat lapses, instead of it serving on half-dead."""
        self._on_fatal()
        self.stop_reading()
        self._stopped.set()

    def _keys(self) -> list[Keys]:
        return [r.keys for r in self.runners]

    def _ride_out(self, step: Callable[[], None]) -> None:
        """One Redis step of the start, retried while Redis is unavailable: the supervisor
        restarts a partition whenever it dies, Redis may be restarting just then, and a start
        must wait that out as every running loop does rather than stop the worker. An error
        that retrying will not fix (a refused command) fails the start."""
        retry = Retry(self.broker.outage, "start")
        while True:
            try:
                step()
            except RedisUnavailable as e:
                time.sleep(retry.failed(e))
                continue
            except RedisCommandError as e:
                raise StartupFailed(str(e)) from e
            retry.succeeded()
            return

    def _beat(self) -> None:
        # With what it ran so far, in all and per serving (wire/figures.py): the dashboard's
        # throughput, error rate and latency (board.py)
        info = {**self._info, **self.tally.snapshot(), **self.figures.fields()}
        for runner in self.runners:  # the keys whose state it holds (affinity.py)
            info.update(runner.held_field())
        self.broker.heartbeat(self._keys(), self.consumer, HEARTBEAT_TTL_MS, info)
        for runner in self.runners:
            runner.follow_holders()
            if runner.serving.cache_ttl > 0:  # (the cache's counts: one more round trip)
                counts = cache_counts(self.broker, runner.shards)
                self.middleware.cache_counts(runner.serving, counts)

    def _clear_junk(self, keys: Keys) -> None:
        """A bookkeeping key of another type (anyone may write one) would fail the first
        heartbeat or declaration of every worker that starts: deleted, and said."""
        for junk in self.broker.clear_junk_bookkeeping(keys):
            log.warning("serving %s: deleted %s, which held another type", keys.name, junk)

    def _heartbeat_loop(self) -> None:
        # A missed beat is retried at the next one: a backoff shorter than the beat is moot.
        retry = Retry(self.broker.outage, "heartbeat")
        told = 0  # failed Redis attempts told to the middleware (metrics) so far
        while not self._stopped.wait(HEARTBEAT_EVERY_S):
            failures = self.broker.outage.failures
            if failures > told:  # told here, as they happen, beat or no beat
                self.middleware.redis_errors(self.partition, failures - told)
                told = failures
            try:
                self._beat()
            except RedisFailure as e:
                retry.failed(e)
                continue
            retry.succeeded()
            self.broker.close_idle()  # what a burst or the start opened goes back to Redis

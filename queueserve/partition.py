"""One partition: every serving of a worker, run in this process on one device."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from . import protocol as P
from .broker import RedisBroker
from .errors import RedisUnavailable
from .middleware import Middleware, Middlewares
from .runner import ServingRunner
from .serving import Partition, Serving

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
HEARTBEAT_TTL_MS = 30_000


def consumer_name(partition: Partition) -> str:
    """Unique per process start, readable in `queueserve stats`: host-pid-partition-nonce."""
    return f"{socket.gethostname()}-{os.getpid()}-p{partition.index}-{uuid.uuid4().hex[:6]}"


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
        self.middleware = Middlewares(middleware)
        self.broker = RedisBroker(url)
        self.consumer = consumer_name(partition)
        self.servings = list(servings)
        self.runners = [
            ServingRunner(
                s, self.broker, prefix, self.consumer, partition,
                batch_keys=batch_keys, max_concurrent_batches=max_concurrent_batches,
                middleware=self.middleware, on_fatal=on_fatal,
            )
            for s in self.servings
        ]
        self._stopped = threading.Event()
        self._heart: threading.Thread | None = None
        self._info: dict[str, str | int] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "partition": partition.index,
            "partitions": partition.count,
            "device": partition.device,
            "servings": ",".join(s.name for s in self.servings),
            "started_ms": int(time.time() * 1000),
        }

    def start(self) -> None:
        for runner in self.runners:  # setup() prepares the object that will serve
            runner.serving.setup(self.partition)
        self._beat()
        for runner in self.runners:
            runner.start()
        self._heart = threading.Thread(
            target=self._heartbeat_loop, name="queueserve-heartbeat", daemon=True
        )
        self._heart.start()
        self.middleware.partition_started([r.serving for r in self.runners], self.partition)
        log.info(
            "partition %d (%s) serving %s as consumer %s",
            self.partition.index, self.partition.device,
            ", ".join(s.name for s in self.servings), self.consumer,
        )

    def stop(self, timeout: float | None) -> bool:
        """Stop reading, finish and answer what is held; True when all of it was answered."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for runner in self.runners:
            runner.stop_reading()
        finished = all(
            r.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for r in self.runners
        )
        self._stopped.set()
        if self._heart is not None:
            self._heart.join(timeout=5)
        try:
            self.broker.leave([r.keys for r in self.runners], self.consumer)
        except RedisUnavailable as e:
            log.warning("could not unregister consumer %s: %s", self.consumer, e)
        if not finished:
            log.warning(
                "partition %d: shutdown timeout passed with work unfinished; it stays pending "
                "for other workers to reclaim", self.partition.index,
            )
        self.broker.close()
        return finished

    def alive(self) -> bool:
        return all(t.is_alive() for r in self.runners for t in r.threads)

    def _keys(self) -> list[P.Keys]:
        return [r.keys for r in self.runners]

    def _beat(self) -> None:
        self.broker.heartbeat(self._keys(), self.consumer, HEARTBEAT_TTL_MS, self._info)

    def _heartbeat_loop(self) -> None:
        failing = False
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                self._beat()
            except RedisUnavailable as e:
                if not failing:  # once per outage, then once when it ends
                    log.warning("heartbeat of %s failed: %s", self.consumer, e)
                failing = True
                continue
            if failing:
                log.warning("heartbeat of %s: Redis is reachable again", self.consumer)
                failing = False

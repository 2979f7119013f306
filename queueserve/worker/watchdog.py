"""Limits on a partition's batches and on its life, as Celery's time limits and
``max_tasks_per_child`` / ``max_memory_per_child`` put them on its pool's children.

- ``max_batch_seconds``: a batch running longer is abandoned. Python cannot stop a thread, so the
  supervisor kills the partition process; its requests are reclaimed by a live partition once the
  dead one's heartbeat has lapsed, each redelivery counted, and a request whose runs keep hanging
  is dead-lettered after ``max_deliveries`` like one whose runs keep crashing.
- ``max_batches_per_partition`` and ``max_partition_memory``: a partition that ran that many
  batches, or whose resident memory grew past the limit, is recycled gracefully — it stops
  reading, finishes and answers what it holds, and exits with ``EXIT_RECYCLE``; the supervisor
  starts a fresh one at once, and does not count it as a crash.

The partition and its supervisor share two numbers in shared memory, written by the partition
only: when its oldest running batch started (``time.monotonic()``, one clock for every process
on the machine; 0 when no batch runs), and how many batches it finished. A partition that dies
while a batch runs has its death charged to that batch's requests (through their delivery
counts), not to the worker's crash-loop count: a poison request cannot stop a worker.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from queueserve.serving import Partition, Serving
from queueserve.worker.middleware import Middleware

EXIT_RECYCLE = 75  # a partition's exit code for "recycled on purpose": restart, not a crash
# A partition's exit code when one of its long-lived threads died of a bug (BSD's EX_SOFTWARE):
# restarted, and counted as a crash (a bug that kills every restart stops the worker).
EXIT_THREAD_DIED = 70

log = logging.getLogger(__name__)

_SINCE, _DONE = 0, 1  # fields of the shared array


@dataclass(frozen=True)
class Limits:
    """The worker's limits on each partition (None: no limit)."""

    max_batch_seconds: float | None = None
    max_batches_per_partition: int | None = None
    max_partition_memory: int | None = None  # bytes of resident memory


def shared_clock(context: Any) -> Any:
    """A fresh shared array for one partition process (``context``: a multiprocessing
    context); [oldest running batch's start, batches finished]."""
    return context.RawArray("d", 2)


class BatchClock(Middleware):
    """Partition side: publishes when the oldest running batch started, and counts batches;
    once ``max_batches`` have finished, stops the partition taking work (``on_limit``) on the
    thread that finished the last one, and sets ``wake`` for the main thread to drain it."""

    def __init__(self, shared: Any, wake: threading.Event, max_batches: int | None = None) -> None:
        self._shared = shared
        self._wake = wake
        self._max_batches = max_batches
        # Set by the partition once its runners exist. Called before the batch's reply is
        # sent, so that reply cannot carry the executor's next read (runner._send): on a busy
        # machine the main thread, woken by ``wake``, may drain only several batches later.
        self.on_limit: Callable[[], None] = lambda: None
        self._running: dict[int, float] = {}  # executor thread -> its batch's start
        self._lock = threading.Lock()

    @property
    def batches(self) -> int:
        return int(self._shared[_DONE])

    def batch_started(
        self, serving: Serving, key: str, partition: Partition, size: int, waited: float
    ) -> None:
        with self._lock:
            self._running[threading.get_ident()] = time.monotonic()
            self._shared[_SINCE] = min(self._running.values())

    def batch_finished(
        self, serving: Serving, key: str, partition: Partition, size: int, seconds: float
    ) -> None:
        with self._lock:
            self._running.pop(threading.get_ident(), None)
            self._shared[_SINCE] = min(self._running.values(), default=0.0)
            self._shared[_DONE] += 1
            reached = self._max_batches is not None and self._shared[_DONE] >= self._max_batches
        if reached:
            self.on_limit()
            self._wake.set()


def run_guarded(
    what: str,
    loop: Callable[[], None],
    on_death: Callable[[], None],
    may_end: Callable[[], bool],
) -> None:
    """Run the loop of one of a partition's long-lived threads (``what`` names it in the log).

    A partition that lives on with a thread dead is a zombie: it heartbeats, so nobody
    reclaims what it holds, while that thread's work (reading, replying, sweeping,
    reclaiming...) never happens. So a loop that raises, or returns while ``may_end()`` is
    False, is logged CRITICAL (with the traceback) and ``on_death`` ends the partition."""
    try:
        loop()
    except BaseException:
        log.critical("%s thread died; ending the partition", what, exc_info=True)
    else:
        if may_end():
            return
        log.critical("%s thread ended while its partition serves; ending the partition", what)
    on_death()


def recycle_reason(limits: Limits, clock: BatchClock) -> str | None:
    """Why this partition should drain and restart now, or None."""
    most = limits.max_batches_per_partition
    if most is not None and clock.batches >= most:
        return f"it ran {clock.batches} batches (max_batches_per_partition={most})"
    cap = limits.max_partition_memory
    if cap is not None and (rss := resident_bytes()) >= cap:
        return (
            f"its resident memory is {rss / 2**20:.0f} MiB "
            f"(max_partition_memory={cap / 2**20:.0f} MiB)"
        )
    return None


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc; elsewhere the peak, from getrusage)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def running_for(shared: Any, now: float) -> float | None:
    """Supervisor side: seconds the partition's oldest running batch has run, None if idle."""
    since = float(shared[_SINCE])
    return None if since == 0.0 else now - since

"""The worker's supervisor: one child process per partition, restarted when it dies.

Children are started with ``spawn`` (never ``fork``): a forked child inherits the parent's threads'
locks and, with CUDA, a context it cannot use. The supervisor itself never touches a device.

Signals: the first SIGTERM/SIGINT is forwarded to every partition as SIGTERM, each drains (stops
reading, finishes and answers what it holds, acks) and exits; the supervisor waits up to the
shutdown timeout. A second signal kills the partitions and exits at once.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from .serving import Partition

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FORCED = 3  # a second SIGTERM/SIGINT: stopped at once, unfinished work left pending
EXIT_CRASH_LOOP = 4  # a partition died max_restarts times within restart_window


def visible_cuda_devices() -> int:
    """CUDA devices torch can see (honouring CUDA_VISIBLE_DEVICES); 0 without torch or CUDA."""
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def check_partitions(partitions: object) -> int | str:
    if partitions == "auto":
        return "auto"
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be 'auto' or an int >= 1, got {partitions!r}")
    return partitions


def resolve_partitions(partitions: int | str) -> tuple[int, str]:
    """(count, device kind) for ``auto`` or a number: one per visible CUDA device, else CPU.
    Asks torch (importing it takes seconds), so only a supervisor that starts partitions
    calls this."""
    partitions = check_partitions(partitions)
    gpus = visible_cuda_devices()
    if partitions == "auto":
        return (gpus, "cuda") if gpus else (1, "cpu")
    assert isinstance(partitions, int)
    return partitions, "cuda" if gpus >= partitions else "cpu"


def partition_for(index: int, count: int, kind: str) -> Partition:
    return Partition(index=index, device=f"cuda:{index}" if kind == "cuda" else "cpu", count=count)


@dataclass
class _Slot:
    partition: Partition
    process: BaseProcess | None = None
    restart_at: float = 0.0
    crashes: deque[float] = field(default_factory=deque)


class Supervisor:
    """Start, watch and restart the partition processes of one worker."""

    def __init__(
        self,
        target: Any,
        args: tuple[Any, ...],
        partitions: Sequence[Partition],
        *,
        shutdown_timeout: float,
        max_restarts: int = 5,
        restart_window: float = 60.0,
        handle_signals: bool = True,
    ) -> None:
        self._target = target
        self._args = args
        self._slots = [_Slot(p) for p in partitions]
        self.shutdown_timeout = shutdown_timeout
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.handle_signals = handle_signals
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = threading.Event()
        self._signals = 0
        self.on_exit: Callable[[int], None] | None = None  # told each dead partition's pid

    def stop(self) -> None:
        """Ask for a graceful stop (what the first SIGTERM does)."""
        self._stop.set()

    def all_alive(self) -> bool:
        """Every partition process is running (the liveness probe)."""
        return not self._stop.is_set() and all(
            s.process is not None and s.process.is_alive() for s in self._slots
        )

    def all_registered(self, broker: Any, worker: Any) -> bool:
        """Every running partition has sent a heartbeat for every serving (readiness)."""
        from .protocol import Keys

        pids = [s.process.pid for s in self._slots if s.process is not None]
        if len(pids) != len(self._slots):
            return False
        for serving in worker.servings:
            alive = broker.alive_consumers(Keys(worker.prefix, serving.name), 10.0)
            if not all(any(f"-{pid}-p" in name for name in alive) for pid in pids):
                return False
        return True

    def run(self) -> int:
        if self.handle_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        for slot in self._slots:
            self._spawn(slot)
        code = EXIT_OK
        while not self._stop.is_set():
            self._wait_for_change()
            code = self._restart_dead()
            if code != EXIT_OK:
                break
        self._shutdown()
        return code

    # -- internals -------------------------------------------------------------------------
    def _spawn(self, slot: _Slot) -> None:
        process = self._ctx.Process(
            target=self._target,
            args=(*self._args, slot.partition),
            name=f"queueserve-partition-{slot.partition.index}",
        )
        process.start()
        slot.process = process
        log.info(
            "partition %d (%s) started as pid %s",
            slot.partition.index, slot.partition.device, process.pid,
        )

    def _wait_for_change(self) -> None:
        sentinels = [s.process.sentinel for s in self._slots if s.process is not None]
        pending = [s.restart_at for s in self._slots if s.process is None]
        timeout = 0.5
        if pending:
            timeout = max(0.0, min(timeout, min(pending) - time.monotonic()))
        multiprocessing.connection.wait(sentinels, timeout=timeout)

    def _restart_dead(self) -> int:
        now = time.monotonic()
        for slot in self._slots:
            process = slot.process
            if process is not None and process.exitcode is not None:
                if self._stop.is_set():
                    return EXIT_OK
                if self._record_crash(slot, process, now):
                    return EXIT_CRASH_LOOP
            if slot.process is None and slot.restart_at <= now and not self._stop.is_set():
                self._spawn(slot)
        return EXIT_OK

    def _record_crash(self, slot: _Slot, process: BaseProcess, now: float) -> bool:
        """Note a dead partition and schedule its restart; True when it is crash-looping."""
        code = process.exitcode
        assert code is not None
        if self.on_exit is not None and process.pid is not None:
            self.on_exit(process.pid)
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        slot.process = None
        slot.crashes.append(now)
        while slot.crashes and slot.crashes[0] < now - self.restart_window:
            slot.crashes.popleft()
        if len(slot.crashes) > self.max_restarts:
            log.error(
                "partition %d %s; it died %d times within %gs: stopping the worker (exit %d)",
                slot.partition.index, why, len(slot.crashes), self.restart_window,
                EXIT_CRASH_LOOP,
            )
            return True
        delay = min(0.5 * 2 ** (len(slot.crashes) - 1), 30.0)
        slot.restart_at = now + delay
        log.warning(
            "partition %d (pid %s) %s; restarting in %.1fs",
            slot.partition.index, process.pid, why, delay,
        )
        return False

    def _shutdown(self) -> None:
        alive = [s.process for s in self._slots if s.process is not None and s.process.is_alive()]
        for process in alive:
            if process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout + 5.0
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in alive:
            if process.is_alive():
                log.warning("partition pid %s did not stop in time: killing it", process.pid)
                process.kill()
                process.join(5)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            name = signal.Signals(signum).name
            log.warning("second %s: killing partitions and exiting now", name)
            for slot in self._slots:
                if slot.process is not None and slot.process.is_alive():
                    slot.process.kill()
            os._exit(EXIT_FORCED)
        log.info("%s received: draining partitions", signal.Signals(signum).name)
        self._stop.set()

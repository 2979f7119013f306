"""The worker's supervisor: one child process per partition, restarted when it dies.

Children are started with ``spawn`` (never ``fork``): a forked child inherits the parent's threads'
locks and, with CUDA, a context it cannot use. The supervisor itself never touches a device.

Each partition reports over a pipe: ``("started",)`` once it serves, ``("failed", line, serving)``
when it could not start (``serving``: the one whose setup() raised, its traceback logged by the
partition; else None), ``("stopped", drained, totals)`` after draining. A partition that fails
before it ever started is a startup failure: the worker stops with EXIT_ERROR at once instead of
restarting it into a crash loop. A partition one of whose threads died of a bug exits with
EXIT_THREAD_DIED (watchdog.py): restarted, and always counted as a crash.

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
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from queueserve.serving import Partition
from queueserve.worker.partition import drained_line
from queueserve.worker.watchdog import EXIT_RECYCLE, EXIT_THREAD_DIED, running_for, shared_clock

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 1  # a partition could not start (setup() failed), or Redis unreachable at start
EXIT_FORCED = 3  # a second SIGTERM/SIGINT: stopped at once, unfinished work left pending
EXIT_CRASH_LOOP = 4  # a partition died max_restarts times within restart_window
RESTART_REASONS = ("recycled", "died_in_batch", "crashed")
# Where the NVIDIA kernel driver shows itself; with none of them, CUDA has no device to offer.
NVIDIA_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


def visible_cuda_devices() -> int:
    """CUDA devices torch can see (honouring CUDA_VISIBLE_DEVICES); 0 without torch or CUDA.
    Importing torch takes seconds, so it is asked only where an NVIDIA driver is loaded and
    CUDA_VISIBLE_DEVICES does not hide every device: a CPU machine's worker starts at once."""
    if importlib.util.find_spec("torch") is None or not _nvidia_driver():
        return 0
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _nvidia_driver() -> bool:
    return any(os.path.exists(p) for p in NVIDIA_DRIVER_PATHS)


def check_partitions(partitions: object) -> int | str:
    if partitions == "auto":
        return "auto"
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be 'auto' or an int >= 1, got {partitions!r}")
    return partitions


def resolve_partitions(partitions: int | str) -> tuple[int, str]:
    """(count, device kind) for ``auto`` or a number: one per visible CUDA device, else CPU.
    Asks torch where a GPU may be (visible_cuda_devices), so only a supervisor that starts
    partitions calls this."""
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
    reports: Connection | None = None  # the partition's end writes, this end reads
    restart_at: float = 0.0
    crashes: deque[float] = field(default_factory=deque)
    started: bool = False  # it reported serving at least once
    failure: str | None = None  # why it could not start, as it reported
    failed_in: str | None = None  # the serving whose setup() raised (its traceback is logged)
    drained: dict[str, int] = field(default_factory=dict)  # summed over its stops
    totals: dict[str, int] = field(default_factory=dict)
    clock: Any = None  # shared with the process: its running batch (worker.watchdog)
    abandoned: bool = False  # killed for running a batch past max_batch_seconds


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for name, n in counts.items():
        into[name] = into.get(name, 0) + n


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
        max_batch_seconds: float | None = None,
        handle_signals: bool = True,
    ) -> None:
        self._target = target
        self._args = args
        self._slots = [_Slot(p) for p in partitions]
        self.shutdown_timeout = shutdown_timeout
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.max_batch_seconds = max_batch_seconds
        self.handle_signals = handle_signals
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = threading.Event()
        self._signals = 0
        self._why_stop = "stop() was called"
        self.on_exit: list[Callable[[int], None]] = []  # each told every dead partition's pid
        # (partition index, why: recycled, died_in_batch, crashed) -> restarts (metrics)
        self.restarts: Counter[tuple[int, str]] = Counter(
            {(p.index, why): 0 for p in partitions for why in RESTART_REASONS}
        )

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
        from queueserve.wire.keys import Keys
        from queueserve.wire.timing import ALIVE_WITHIN_S

        pids = [s.process.pid for s in self._slots if s.process is not None]
        if len(pids) != len(self._slots):
            return False
        for serving in worker.servings:
            alive = broker.alive_consumers(Keys(worker.prefix, serving.name), ALIVE_WITHIN_S)
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
            self._read_reports()
            self._abandon_overdue_batches()
            code = self._restart_dead()
            if code != EXIT_OK:
                break
        self._shutdown()
        self._read_reports()
        drained: dict[str, int] = {}
        totals: dict[str, int] = {}
        for slot in self._slots:
            _add(drained, slot.drained)
            _add(totals, slot.totals)
        counts = {"batches": 0, "requests": 0, "items": 0}
        log.info(
            "worker stopped (%s): partitions %s; exit code %d",
            self._why_stop,
            drained_line({**counts, **drained}, {**counts, **totals}),
            code,
        )
        return code

    # -- internals -------------------------------------------------------------------------
    def _spawn(self, slot: _Slot) -> None:
        reader, writer = self._ctx.Pipe(duplex=False)
        slot.clock, slot.abandoned = shared_clock(self._ctx), False
        process = self._ctx.Process(
            target=self._target,
            args=(*self._args, slot.partition, writer, slot.clock),
            name=f"queueserve-partition-{slot.partition.index}",
        )
        process.start()
        writer.close()  # the child holds its own copy; ours would keep EOF from ever coming
        if slot.reports is not None:
            slot.reports.close()
        slot.process, slot.reports = process, reader
        log.info(
            "partition %d (%s) started as pid %s",
            slot.partition.index,
            slot.partition.device,
            process.pid,
        )

    def _wait_for_change(self) -> None:
        sentinels: list[Any] = [s.process.sentinel for s in self._slots if s.process is not None]
        sentinels += [s.reports for s in self._slots if s.reports is not None]
        pending = [s.restart_at for s in self._slots if s.process is None]
        timeout = 0.5
        if pending:
            timeout = max(0.0, min(timeout, min(pending) - time.monotonic()))
        multiprocessing.connection.wait(sentinels, timeout=timeout)

    def _read_reports(self) -> None:
        for slot in self._slots:
            reports = slot.reports
            try:
                while reports is not None and reports.poll():
                    self._note(slot, reports.recv())
            except (EOFError, OSError):  # the partition is gone and said all it will
                reports.close()  # type: ignore[union-attr]
                slot.reports = None

    def _note(self, slot: _Slot, report: tuple[Any, ...]) -> None:
        kind = report[0]
        if kind == "started":
            slot.started = True
        elif kind == "failed":
            slot.failure = str(report[1])
            slot.failed_in = str(report[2]) if len(report) > 2 and report[2] else None
        elif kind == "stopped":
            _add(slot.drained, report[1])
            _add(slot.totals, report[2])

    def _restart_dead(self) -> int:
        now = time.monotonic()
        for slot in self._slots:
            process = slot.process
            if process is not None and process.exitcode is not None:
                if self._stop.is_set():
                    return EXIT_OK
                if slot.failure is not None and not slot.started:
                    self._why_stop = "a partition could not start"
                    log.error(
                        "partition %d could not start: %s. Stopping the worker (exit code %d) "
                        "without restarts: fix the cause and start it again (%s)",
                        slot.partition.index,
                        slot.failure,
                        EXIT_ERROR,
                        "the traceback of setup() is logged above"
                        if slot.failed_in is not None
                        else "--log-level DEBUG shows the traceback",
                    )
                    slot.process = None
                    return EXIT_ERROR
                if process.exitcode != EXIT_THREAD_DIED and self._restart_without_charge(
                    slot, process, now
                ):
                    continue
                if self._record_crash(slot, process, now):
                    self._why_stop = "a partition kept crashing"
                    return EXIT_CRASH_LOOP
            if slot.process is None and slot.restart_at <= now and not self._stop.is_set():
                self._spawn(slot)
        return EXIT_OK

    def _abandon_overdue_batches(self) -> None:
        """Kill partitions whose batch ran past max_batch_seconds (a thread cannot be stopped);
        their requests are reclaimed elsewhere, each run counted against max_deliveries."""
        if self.max_batch_seconds is None:
            return
        now = time.monotonic()
        for slot in self._slots:
            process = slot.process
            if process is None or slot.abandoned or not process.is_alive():
                continue
            ran = running_for(slot.clock, now)
            if ran is not None and ran > self.max_batch_seconds:
                log.error(
                    "partition %d (pid %s): a batch has run for %.1fs, over max_batch_seconds="
                    "%g: killing the partition; its requests are retried elsewhere (each run "
                    "counts against max_deliveries)",
                    slot.partition.index,
                    process.pid,
                    ran,
                    self.max_batch_seconds,
                )
                slot.abandoned = True
                process.kill()

    def _restart_without_charge(self, slot: _Slot, process: BaseProcess, now: float) -> bool:
        """Restart a partition that was recycled, or that died running a batch, without
        counting a crash: a death during a batch is charged to that batch's requests (their
        redeliveries are counted, and max_deliveries dead-letters them), so requests that
        kill their workers cannot make the worker exit."""
        recycled = process.exitcode == EXIT_RECYCLE
        during_batch = running_for(slot.clock, now) is not None
        if not (recycled or during_batch):
            return False
        self._tell_exit(process)
        slot.process = None
        slot.restart_at = now if recycled else now + 0.5
        self.restarts[slot.partition.index, "recycled" if recycled else "died_in_batch"] += 1
        if recycled:
            log.info(
                "partition %d (pid %s) recycled; starting a fresh one",
                slot.partition.index,
                process.pid,
            )
        elif not slot.abandoned:
            code = process.exitcode
            assert code is not None
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            log.warning(
                "partition %d (pid %s) died while running a batch (%s): charged to that "
                "batch's requests, not counted as a crash; restarting",
                slot.partition.index,
                process.pid,
                how,
            )
        return True

    def _tell_exit(self, process: BaseProcess) -> None:
        if process.pid is not None:
            for tell in self.on_exit:
                tell(process.pid)

    def _record_crash(self, slot: _Slot, process: BaseProcess, now: float) -> bool:
        """Note a dead partition and schedule its restart; True when it is crash-looping."""
        code = process.exitcode
        assert code is not None
        self._tell_exit(process)
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        if code == EXIT_THREAD_DIED:  # a bug, even when a batch ran meanwhile: it counts
            why += " (a thread of it died of a bug: its CRITICAL line above has the traceback)"
        slot.process = None
        slot.crashes.append(now)
        while slot.crashes and slot.crashes[0] < now - self.restart_window:
            slot.crashes.popleft()
        if len(slot.crashes) > self.max_restarts:
            log.error(
                "partition %d %s; it died %d times within %gs: stopping the worker (exit %d)",
                slot.partition.index,
                why,
                len(slot.crashes),
                self.restart_window,
                EXIT_CRASH_LOOP,
            )
            return True
        delay = min(0.5 * 2 ** (len(slot.crashes) - 1), 30.0)
        self.restarts[slot.partition.index, "crashed"] += 1
        slot.restart_at = now + delay
        log.warning(
            "partition %d (pid %s) %s; restarting in %.1fs",
            slot.partition.index,
            process.pid,
            why,
            delay,
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
            log.warning(
                "second %s: killing partitions and exiting now (exit code %d); "
                "unfinished work stays pending for other workers",
                name,
                EXIT_FORCED,
            )
            for slot in self._slots:
                if slot.process is not None and slot.process.is_alive():
                    slot.process.kill()
            os._exit(EXIT_FORCED)
        name = signal.Signals(signum).name
        log.info("%s received: draining partitions (a second signal stops at once)", name)
        self._why_stop = name
        self._stop.set()

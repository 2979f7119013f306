"""What every benchmark needs: a private redis-server, child processes, CPU clocks, percentiles.

Nothing here imports queueserve, so the hand-written baseline can use it too.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

REPO_ROOT = Path(__file__).resolve().parent.parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A private ``redis-server`` on a free loopback port, without persistence.

    Never the machine's shared Redis: the benchmark owns every key of this one.
    """

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server not found on PATH; install it (apt-get install "
                "redis-server) to run the benchmarks"
            )
        self._binary = binary
        self._dir = Path(tempfile.mkdtemp(prefix="qs-bench-redis-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        for _ in range(3):  # another process may grab the free port before we bind it
            self.port = free_port()
            self.proc = subprocess.Popen(
                [
                    self._binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(self._dir),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                    "--logfile",
                    str(self._dir / "redis.log"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(f"could not start redis-server; see {self._dir / 'redis.log'}")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
            try:
                if client.info("server")["process_id"] == self.proc.pid:
                    return True
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            finally:
                client.close()
            time.sleep(0.02)
        return False

    def version(self) -> str:
        client = redis.Redis.from_url(self.url)
        try:
            return str(client.info("server")["redis_version"])
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)


def spawn_module(module: str, *args: str) -> subprocess.Popen[bytes]:
    """``python -m module args...`` from the repository root (so ``bench`` is importable)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL
    )


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, wait, and SIGKILL if it would not go."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK  # utime, stime


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (a supervised worker runs partitions as children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def tree_cpu_times(pid: int) -> tuple[float, float]:
    user = system = 0.0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):  # ended meanwhile
            u, s = cpu_times(p)
            user, system = user + u, system + s
    return user, system


class CpuMeter:
    """CPU seconds spent by named processes between ``start()`` and ``stop()``; those named in
    ``trees`` count with their descendants (a child that ends in between takes its time along).

    ``stop()`` gives ``name`` (user + system) and ``name_sys`` (system alone) per process.
    """

    def __init__(self, pids: dict[str, int], trees: frozenset[str] = frozenset()) -> None:
        self.pids = pids
        self.trees = trees
        self._start: dict[str, tuple[float, float]] = {}

    def _now(self) -> dict[str, tuple[float, float]]:
        return {
            name: tree_cpu_times(pid) if name in self.trees else cpu_times(pid)
            for name, pid in self.pids.items()
        }

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> dict[str, float]:
        end = self._now()
        out = {}
        for name in self.pids:
            user = end[name][0] - self._start[name][0]
            system = end[name][1] - self._start[name][1]
            out[name] = user + system
            out[f"{name}_sys"] = system
        return out


def run_time(pid: int) -> float:
    """CPU seconds process ``pid``'s live threads have run, to the nanosecond (each thread's
    /proc schedstat): where ``cpu_times`` counts in clock ticks of 10 ms, too coarse for a
    few hundred round trips of a fraction of a millisecond each."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
            total += int(f.read().split()[0])
    return total / 1e9


class RunTimeMeter:
    """``CpuMeter`` to the nanosecond (``run_time``): user and system time together, and only
    of threads alive at both ends (the long-lived ones of a round trip's processes)."""

    def __init__(self, pids: dict[str, int], trees: frozenset[str] = frozenset()) -> None:
        self.pids = pids
        self.trees = trees
        self._start: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        # The trees first: a scan of /proc takes milliseconds of this process's CPU, which
        # must not fall between its own two readings
        trees = {
            name: process_tree(pid) if name in self.trees else [pid]
            for name, pid in self.pids.items()
        }
        out = {}
        for name, tree in trees.items():
            seconds = 0.0
            for p in tree:
                with contextlib.suppress(OSError):  # ended meanwhile
                    seconds += run_time(p)
            out[name] = seconds
        return out

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> dict[str, float]:
        end = self._now()
        return {name: end[name] - self._start[name] for name in self.pids}


class GcClock:
    """Seconds this process spent in garbage collections between ``start()`` and ``stop()``
    (every thread waits meanwhile): what the objects a client keeps per call cost it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def _tick(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began

    def start(self) -> None:
        self.seconds = 0.0
        gc.callbacks.append(self._tick)

    def stop(self) -> float:
        gc.callbacks.remove(self._tick)
        return self.seconds


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linearly interpolated."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass
class Rate:
    """Items/s over repeated runs: the median is the figure, min and max show the noise."""

    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def as_json(self) -> dict[str, object]:
        return {
            "median": round(self.median),
            "min": round(min(self.runs)),
            "max": round(max(self.runs)),
            "runs": [round(r) for r in self.runs],
        }

"""The two measurements every system of bench/peers.py gets, and what a runner needs around them.

- :func:`rate`: items/s for one item per call, many calls in flight: the producer makes
  ``window`` calls, then fetches every result (checking it is the item sent), then the next
  window; ``repeats`` runs of ``items`` items, the figure is the median run. Bounded in time:
  past ``seconds``, no new run starts and a run that is under way stops after its window.
- :func:`latency`: one call at a time on an idle system, p50 and p99 of ``calls`` calls after
  ``warmup`` untimed ones, bounded by ``seconds`` too.

Only the standard library and bench._harness (redis-py), so both venvs can run it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from bench._harness import REPO_ROOT, CpuMeter, percentile

# A result that takes longer than this means the system under test is broken: fail, never hang.
WAIT_S = 60.0
REQUIREMENTS = Path(__file__).resolve().parent.parent / "peers-requirements.txt"


def check(results: Sequence[Any], items: range) -> None:
    if list(results) != list(items):
        raise AssertionError(f"wrong results for items {items}: got {list(results)[:5]}...")


def rate(
    run_window: Callable[[range], Sequence[Any]],
    items: int,
    window: int,
    repeats: int,
    seconds: float,
    meter: CpuMeter | None = None,
) -> dict[str, Any]:
    """Items/s of ``run_window`` (send the items of a range, one call each, and return their
    results) over ``repeats`` runs of ``items`` items cut into windows; with a ``meter``, also
    the CPU µs per item of each of its processes (median run), which says where the time went
    on a machine that other work shares."""
    deadline = time.monotonic() + seconds
    runs: list[tuple[int, float]] = []
    cpu: list[dict[str, float]] = []
    for _ in range(repeats):
        if runs and time.monotonic() > deadline:
            break
        if meter is not None:
            meter.start()
        done, t0 = 0, time.perf_counter()
        for lo in range(0, items, window):
            if done and time.monotonic() > deadline:
                break
            part = range(lo, min(items, lo + window))
            check(run_window(part), part)
            done += len(part)
        runs.append((done, time.perf_counter() - t0))
        if meter is not None:
            used = meter.stop()
            cpu.append({name: used[name] * 1e6 / done for name in meter.pids})
    rates = [done / elapsed for done, elapsed in runs]
    out = {
        "items_per_s": round(statistics.median(rates)),
        "runs": [round(r) for r in rates],
        "items": [done for done, _ in runs],
        "window": window,
    }
    if cpu:
        out["cpu_us_per_item"] = {
            name: round(statistics.median(run[name] for run in cpu), 1) for name in cpu[0]
        }
    return out


def cpu_meter(redis_url: str, worker_pid: int) -> CpuMeter:
    """CPU of this process (the producer), the worker with its children, and redis-server."""
    client = redis.Redis.from_url(redis_url)
    try:
        redis_pid = int(client.info("server")["process_id"])
    finally:
        client.close()
    return CpuMeter(
        {"client": os.getpid(), "worker": worker_pid, "redis": redis_pid},
        trees=frozenset({"worker"}),
    )


def latency(call: Callable[[int], Any], calls: int, warmup: int, seconds: float) -> dict[str, Any]:
    """p50/p99 milliseconds of ``call(i)``, one call at a time."""
    for i in range(warmup):
        check([call(i)], range(i, i + 1))
    deadline = time.monotonic() + seconds
    times: list[float] = []
    clock = time.perf_counter
    for i in range(calls):
        if times and time.monotonic() > deadline:
            break
        t0 = clock()
        result = call(i)
        times.append(clock() - t0)
        check([result], range(i, i + 1))
    times.sort()
    return {
        "p50_ms": round(percentile(times, 50) * 1e3, 3),
        "p99_ms": round(percentile(times, 99) * 1e3, 3),
        "calls": len(times),
    }


def parse_args(
    description: str, argv: list[str] | None = None, variants: Sequence[str] = ()
) -> argparse.Namespace:
    """The arguments bench/peers.py gives every runner."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--redis-url", required=True, help="the private Redis to use")
    parser.add_argument("--items", type=int, default=5_000, help="items per throughput run")
    parser.add_argument("--window", type=int, default=256, help="calls in flight")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs")
    parser.add_argument("--rt-calls", type=int, default=500, help="timed one-at-a-time calls")
    parser.add_argument("--rt-warmup", type=int, default=20, help="untimed calls before those")
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="time bound of each of the two measurements"
    )
    if variants:
        parser.add_argument("--variant", choices=variants, default=variants[0])
    return parser.parse_args(argv)


def versions(*distributions: str) -> dict[str, str]:
    return {name: metadata.version(name) for name in distributions}


def pinned(distribution: str) -> str:
    """The line of bench/peers-requirements.txt that pins ``distribution``."""
    for line in REQUIREMENTS.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec.split("[", 1)[0].split("=", 1)[0].lower() == distribution.lower():
            return spec
    return distribution


def skip(distribution: str) -> None:
    """Say how to install a peer that is missing, as the runner's JSON line, and exit."""
    emit(
        {
            "skipped": f"{distribution} is not installed in {sys.prefix}: run scripts/bench-peers "
            f"(or {sys.executable} -m pip install '{pinned(distribution)}')"
        }
    )
    sys.exit(0)


def emit(result: dict[str, Any]) -> None:
    """The runner's one line of output (bench/peers.py reads the last line of stdout)."""
    print(json.dumps(result), flush=True)


class WorkerProcess:
    """A peer's worker as a child in a process group of its own, so that stopping it stops the
    processes it forked (Celery's pool, rq's work horses) too. Its output goes to a log file,
    printed to stderr when the worker dies early or the measurement fails. (When the runner
    itself is killed, bench/peers.py kills its whole process tree, this group included.)"""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="qs-peer-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1"),
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )

    def __enter__(self) -> WorkerProcess:
        return self

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"worker {self.proc.args!r} exited with code {self.proc.returncode}:\n{self.tail()}"
            )

    def tail(self, lines: int = 30) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            # Whatever of the group is left (a pool child, a work horse) goes now.
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if kind is not None:
            print(f"worker log ({self.log.name}):\n{self.tail()}", file=sys.stderr)
        self.log.close()
        os.unlink(self.log.name)

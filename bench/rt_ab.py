"""Idle round trips against two workers side by side: another checkout's and this one's.

    git worktree add --detach /tmp/base <commit>
    python -m bench.rt_ab /tmp/base [--calls 10000] [--block 200]

One private redis-server; a ``queueserve worker bench.servings:noop`` process run from each
checkout (prefixes ``a`` and ``b``) and the hand-written loop's consumer (bench/baseline.py).
This process makes one ``dispatch`` at a time to each, in turn, ``--block`` calls per turn (the
client is this checkout's for both), and one XADD + BLPOP of the loop, so that a busy machine
moves all three alike. Printed per target: round trip p50/p90/p99 and the CPU µs per call of
its worker's partition process (the loop's: its consumer's).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import queueserve as qs
from bench._harness import REPO_ROOT, RedisServer, cpu_times, percentile, stop_process
from bench.baseline import BaselineClient


def worker(root: Path, url: str, prefix: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "queueserve",
            "worker",
            "bench.servings:noop",
            "--redis-url",
            url,
            "--prefix",
            prefix,
            "--partitions",
            "1",
        ],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def partition_of(proc: subprocess.Popen[bytes]) -> int:
    """The pid of a worker's partition process (its spawned child)."""
    children = subprocess.run(
        ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    for pid in children:
        if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
            return int(pid)
    raise RuntimeError(f"worker {proc.pid} has no partition process yet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the other checkout (a git worktree)")
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--block", type=int, default=200)
    args = parser.parse_args()
    server = RedisServer().start()
    procs = [
        worker(args.base.resolve(), server.url, "a"),
        worker(REPO_ROOT, server.url, "b"),
        subprocess.Popen(
            [sys.executable, "-m", "bench.baseline", server.url, "bl"],
            cwd=REPO_ROOT,
            stderr=subprocess.DEVNULL,
        ),
    ]
    clients = [qs.Client(server.url, prefix="a"), qs.Client(server.url, prefix="b")]
    loop = BaselineClient(server.url, "bl")
    calls: dict[str, Callable[[int], Any]] = {
        "base": lambda i: clients[0].dispatch("noop", i, timeout=60),
        "this": lambda i: clients[1].dispatch("noop", i, timeout=60),
        "loop": loop.call,
    }
    try:
        for call in calls.values():  # warm: loaded, connected, caches filled
            for i in range(300):
                call(i)
        time.sleep(0.5)
        pids = {
            "base": partition_of(procs[0]),
            "this": partition_of(procs[1]),
            "loop": procs[2].pid,
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        cpu = dict.fromkeys(calls, 0.0)
        for _ in range(0, args.calls, args.block):
            for name, call in calls.items():
                before = sum(cpu_times(pids[name]))
                for i in range(args.block):
                    start = time.perf_counter()
                    call(i)
                    times[name].append(time.perf_counter() - start)
                cpu[name] += sum(cpu_times(pids[name])) - before
        print(
            f"{args.calls} idle round trips each, blocks of {args.block}, load average "
            f"{os.getloadavg()[0]:.1f}"
        )
        for name, t in times.items():
            t.sort()
            print(
                f"  {name:5} p50 {percentile(t, 50) * 1e3:.3f}  p90 {percentile(t, 90) * 1e3:.3f}"
                f"  p99 {percentile(t, 99) * 1e3:.3f} ms   worker CPU "
                f"{cpu[name] / len(t) * 1e6:.0f} µs per call"
            )
    finally:
        for client in clients:
            client.close()
        loop.close()
        for proc in procs:
            stop_process(proc)
        server.stop()


if __name__ == "__main__":
    main()

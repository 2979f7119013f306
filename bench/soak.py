"""Soak: worker memory stays flat under sustained load (docs/design.md §8: within 5% over 10
minutes).

A `queueserve worker bench.servings:noop` process (one partition) serves a steady mix for the
whole duration: packed `map` requests and `dispatch_many` calls from one thread, single-item
`dispatch` calls from four more. The partition's resident memory is sampled every few seconds;
the figure is the growth from the end of the warm-up (the first tenth of the run) to the end, as
a ratio of the warm-up RSS.

Items count when their answer came back and equals what was sent (noop echoes its items); a
wrong answer, a call that raised or waited past CALL_TIMEOUT_S, a load thread that died or would
not stop, or a worker that exited is an error. The run exits 1 on any error, or when the growth
misses the budget; 0 only when every call was answered right and memory stayed within it.

    python -m bench.soak [--minutes 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import queueserve as qs

from ._harness import RedisServer, process_tree, spawn_module, stop_process, wait_until

PREFIX = "soak"
CALL_TIMEOUT_S = 60.0  # a call unanswered this long is an error, not a hang
BUDGET = 0.05


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def partition_of(worker: int) -> int | None:
    """The worker's partition process: its child started by multiprocessing's spawn, not the
    resource tracker that comes with it (whichever of the two the process table lists first)."""
    for pid in process_tree(worker)[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"multiprocessing.spawn" in f.read():
                    return pid
        except OSError:
            continue  # ended meanwhile
    return None


class Load:
    """What the load threads got back, shared between them: items answered right, and every
    error (a thread that met one stops; so does the run)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.answered = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def add(self, answered: int) -> None:
        with self._lock:
            self.answered += answered

    def fail(self, error: str) -> None:
        with self._lock:
            self.errors.append(error)
        self.stop.set()

    def run(self, name: str, body: Callable[[qs.Client], None], url: str) -> threading.Thread:
        """``body(client)`` on a thread of its own until ``stop``; an exception it raises is
        an error of the run, never only a traceback on stderr."""

        def guarded() -> None:
            try:
                with qs.Client(url, prefix=PREFIX) as client:
                    while not self.stop.is_set():
                        body(client)
            except BaseException as e:
                self.fail(f"{name}: {type(e).__name__}: {e}")

        thread = threading.Thread(target=guarded, name=name)
        thread.start()
        return thread

    def check(self, what: str, got: Sequence[object], sent: Sequence[object]) -> None:
        """Count the items of ``got`` equal to ``sent``; any other is an error."""
        right = sum(g == s for g, s in zip(got, sent, strict=False))
        self.add(right)
        if right != len(sent) or len(got) != len(sent):
            self.fail(
                f"{what}: {len(sent) - right} of {len(sent)} items answered wrong "
                f"({len(got)} answers)"
            )


MAP_ITEMS = list(range(20_000))
MANY_ITEMS = list(range(100))


def packed(load: Load) -> Callable[[qs.Client], None]:
    def body(client: qs.Client) -> None:
        got = list(client.map("noop", MAP_ITEMS, chunk_size=256, timeout=CALL_TIMEOUT_S))
        load.check("map", got, MAP_ITEMS)
        load.check(
            "dispatch_many",
            client.dispatch_many("noop", MANY_ITEMS, timeout=CALL_TIMEOUT_S),
            MANY_ITEMS,
        )

    return body


def single(load: Load) -> Callable[[qs.Client], None]:
    def body(client: qs.Client) -> None:
        load.check("dispatch", [client.dispatch("noop", "x", timeout=CALL_TIMEOUT_S)], ["x"])

    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--json", help="write the samples and the figure here")
    args = parser.parse_args()
    server = RedisServer().start()
    worker = spawn_module(
        "queueserve",
        "worker",
        "bench.servings:noop",
        "--redis-url",
        server.url,
        "--prefix",
        PREFIX,
        "--partitions",
        "1",
        "--log-level",
        "WARNING",
    )
    load = Load()
    duration = args.minutes * 60
    try:
        wait_until(lambda: partition_of(worker.pid), 60, "the partition process")
        partition = partition_of(worker.pid)
        assert partition is not None
        threads = [load.run("packed", packed(load), server.url)]
        threads += [load.run(f"single-{i}", single(load), server.url) for i in range(4)]
        samples = sample(load, worker, partition, duration, args.every)
        load.stop.set()
        for t in threads:
            t.join(CALL_TIMEOUT_S + 10)
            if t.is_alive():
                load.fail(f"{t.name}: still running {CALL_TIMEOUT_S + 10:g}s after stop")
    finally:
        load.stop.set()
        stop_process(worker, timeout=60)
        server.stop()
    sys.exit(report(load, samples, duration, args))


def sample(
    load: Load, worker: subprocess.Popen[bytes], partition: int, duration: float, every: float
) -> list[tuple[float, float, int]]:
    """RSS and items answered every ``every`` seconds until ``duration``, a last sample at
    its end; stops early at the first error."""
    started = time.monotonic()
    samples: list[tuple[float, float, int]] = []
    while not load.stop.is_set():
        elapsed = time.monotonic() - started
        if worker.poll() is not None:
            load.fail(f"the worker exited with code {worker.returncode}")
            break
        try:
            rss = rss_mib(partition)
        except OSError as e:  # died, and its supervisor started another: not a soak any more
            load.fail(f"the partition process {partition} is gone: {e}")
            break
        samples.append((elapsed, rss, load.answered))
        print(
            f"{elapsed:7.0f}s  rss {samples[-1][1]:7.1f} MiB  answered {samples[-1][2]:,}",
            flush=True,
        )
        if elapsed >= duration:
            break
        load.stop.wait(min(every, duration - elapsed))
    return samples


def report(
    load: Load,
    samples: list[tuple[float, float, int]],
    duration: float,
    args: argparse.Namespace,
) -> int:
    """Print the figure and every error; the exit code (0: answered right, within budget)."""
    for error in load.errors:
        print(f"ERROR {error}", flush=True)
    if not samples or samples[-1][0] < duration:
        print(
            f"MISS: the run stopped after {samples[-1][0] if samples else 0:.0f}s of "
            f"{duration:.0f}s, {load.answered:,} items answered",
            flush=True,
        )
        return 1
    warm = [s for s in samples if s[0] >= duration / 10]
    base, end = warm[0][1], samples[-1][1]
    growth = (end - base) / base
    ok = abs(growth) <= BUDGET and not load.errors
    print(
        f"partition RSS after warm-up {base:.1f} MiB, at the end {end:.1f} MiB: growth "
        f"{growth * 100:+.1f}% over {args.minutes:g} min, {load.answered:,} items answered, "
        f"{len(load.errors)} errors (budget within {BUDGET:.0%}: {'ok' if ok else 'MISS'})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "samples": samples,
                    "growth": growth,
                    "minutes": args.minutes,
                    "answered": load.answered,
                    "errors": load.errors,
                },
                f,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    main()

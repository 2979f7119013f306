"""Many batch keys at full speed, served fairly (issue 11).

1. ``keys``: packed items/s (requests of 256 items, no-op serving, one worker) with 1, 10 and
   1,000 known batch keys, half of them idle and the other half sharing the load (1 key: it
   takes all). The same client code runs each case: a few threads keep requests in flight,
   going round their share of the busy keys. Budget: 10 and 1,000 keys >= 0.9x 1 key.
2. ``quiet``: a serving whose batch takes a fixed time holds a 100,000-item backlog on one key;
   requests on another key, one at a time, are timed from send to answer, median of 9 (their
   own batch, which takes the same fixed time, included). The busy key's batch time is
   measured as the backlog's drain time over its batches. Budget: <= 3 batch times.
   Expected: the rest of the running busy batch, at most the one busy batch already waiting
   in the worker, and its own.
3. ``--idle-keys N``: what N idle batch keys cost (issue 23), in one run: with 0 and then N
   known keys that each served one request and went quiet, the Redis server's CPU while the
   worker idles, one ``/metrics`` scrape's size and time, and one key's packed items/s.
   Budgets: idle Redis CPU within 2 percentage points of 0 keys, a scrape under 1 MB and 1 s,
   items/s >= 0.9x of 0 keys. This mode runs alone.

Every figure counts answers received, never requests planned: a thread that fails, or an
answer missing or wrong, ends the run with a non-zero exit.

    python -m bench.keys [--quick] [--json FILE]
    python -m bench.keys --idle-keys 100000 [--seconds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable

import redis

import queueserve as qs

from ._harness import RedisServer, free_port, spawn_module, stop_process, wait_until
from .keys_servings import BATCH_S

PREFIX = "bk"
CHUNK = 256
THREADS = 4
WINDOW = 8  # requests in flight per thread
WAIT_S = 120.0
QUIET_SAMPLES = 9  # quiet requests sent one after another during the backlog


def start_worker(url: str, serving: str, *extra: str) -> tuple[object, redis.Redis]:
    proc = spawn_module(
        "queueserve",
        "worker",
        f"bench.keys_servings:{serving}",
        "--redis-url",
        url,
        "--prefix",
        PREFIX,
        "--log-level",
        "WARNING",
        *extra,
    )
    r = redis.Redis.from_url(url)
    name = {"noop": "knoop", "timed": "ktimed"}[serving]
    wait_until(lambda: r.zcard(f"{PREFIX}:{{{name}}}:workers") > 0, 30, "the worker")
    return proc, r


def make_known(client: qs.Client, serving: str, keys: list[str], window: int = 5_000) -> None:
    """One request on each key, so the worker and Redis know them all; each answer checked."""
    for start in range(0, len(keys), window):
        tickets = [client.submit(serving, [0], batch_key=k) for k in keys[start : start + window]]
        for t in tickets:
            answer = t.result(WAIT_S)
            if answer != [0]:
                raise AssertionError(f"request {t.id} answered {answer!r}, not [0]")


def run_threads(body: Callable[[int], int], threads: int) -> tuple[int, float]:
    """Run ``body(i)`` on ``threads`` threads; (the sum of what they return, seconds taken).
    The first exception a thread raised is raised here, after every thread ended."""
    done = [0] * threads
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            done[i] = body(i)
        except BaseException as e:  # re-raised by the caller's thread below
            errors.append(e)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {threads} client threads failed") from errors[0]
    return sum(done), elapsed


def _answered(ticket: qs.client.sync.Ticket) -> int:
    """Items of one CHUNK-item request answered, checked."""
    answer = ticket.result(WAIT_S)
    if len(answer) != CHUNK:
        raise AssertionError(f"request {ticket.id} answered {len(answer)} items of {CHUNK}")
    return CHUNK


def pump(
    client: qs.Client, serving: str, busy: list[str], n: int = 0, seconds: float = 0.0
) -> float:
    """Items/s answered in CHUNK-item requests over the ``busy`` keys from THREADS threads:
    ``n`` items, or as many as ``seconds`` allow."""
    per_thread = n // THREADS // CHUNK
    deadline = time.perf_counter() + seconds

    def more(j: int) -> bool:
        return j < per_thread if n else time.perf_counter() < deadline

    def body(i: int) -> int:
        mine = busy[i::THREADS] or busy
        window: deque[qs.client.sync.Ticket] = deque()
        chunk = list(range(CHUNK))
        answered = j = 0
        while more(j):
            if len(window) >= WINDOW:
                answered += _answered(window.popleft())
            window.append(client.submit(serving, chunk, batch_key=mine[j % len(mine)]))
            j += 1
        while window:
            answered += _answered(window.popleft())
        return answered

    answered, elapsed = run_threads(body, THREADS)
    return answered / elapsed


def throughput(url: str, n: int, repeats: int) -> dict[str, float]:
    proc, r = start_worker(url, "noop")
    client = qs.Client(url, prefix=PREFIX)
    out: dict[str, float] = {}
    try:
        pump(client, "knoop", ["default"], n // 4)  # warm up
        cases = {
            1: ["default"],
            10: [f"t{i}" for i in range(10)],
            1000: [f"m{i}" for i in range(1000)],
        }
        for known, keys in cases.items():
            make_known(client, "knoop", keys)
            busy = keys[: max(1, known // 2)]
            rates = [pump(client, "knoop", busy, n) for _ in range(repeats)]
            out[f"keys_{known}"] = statistics.median(rates)
            print(
                f"{known:>5} known keys, {len(busy):>3} busy: {out[f'keys_{known}']:>10,.0f} "
                f"items/s (runs: {', '.join(f'{x:,.0f}' for x in rates)})",
                flush=True,
            )
    finally:
        client.close()
        r.close()
        stop_process(proc)  # type: ignore[arg-type]
    return out


def quiet_latency(url: str, backlog: int) -> dict[str, float]:
    proc, r = start_worker(url, "timed")
    client = qs.Client(url, prefix=PREFIX)
    try:
        make_known(client, "ktimed", ["busy", "quiet"])
        t0 = time.perf_counter()
        tickets = [
            client.submit("ktimed", list(range(CHUNK)), batch_key="busy")
            for _ in range(backlog // CHUNK)
        ]
        stream = f"{PREFIX}:{{ktimed}}:in:busy"
        # all of it in Redis: the client's sender must not be busy when the quiet one goes
        wait_until(
            lambda: int(r.xinfo_stream(stream)["entries-added"]) > len(tickets),
            60,
            "the backlog enqueued",
        )
        latencies = []
        for _ in range(QUIET_SAMPLES):
            time.sleep(3 * BATCH_S)  # the busy key runs batches back to back meanwhile
            sent = time.perf_counter()
            assert client.dispatch("ktimed", 7, batch_key="quiet", timeout=WAIT_S) == 7
            latencies.append(time.perf_counter() - sent)
        latency = statistics.median(latencies)
        left = r.xlen(stream)
        for t in tickets:
            t.result(WAIT_S)
        drained = time.perf_counter() - t0
        batch_s = drained / len(tickets)
        print(
            f"quiet key under a {backlog:,}-item backlog: median {latency * 1000:.1f} ms = "
            f"{latency / batch_s:.2f} batch times, max {max(latencies) / batch_s:.2f} (busy "
            f"batch {batch_s * 1000:.1f} ms; {left} busy requests still queued after the last "
            "quiet one)",
            flush=True,
        )
        return {
            "quiet_latency_ms": latency * 1000,
            "batch_ms": batch_s * 1000,
            "quiet_in_batches": latency / batch_s,
            "quiet_max_in_batches": max(latencies) / batch_s,
            "backlog_left_requests": left,
        }
    finally:
        client.close()
        r.close()
        stop_process(proc)  # type: ignore[arg-type]


def scrape(port: int) -> tuple[int, float]:
    """(bytes, seconds) of one /metrics scrape."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as r:
        size = len(r.read())
    return size, time.perf_counter() - t0


def cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of ``pid``, to the nanosecond (/proc schedstat): an idle
    Redis spends a few ms a second, below the 10 ms ticks of /proc/PID/stat."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def idle_costs(
    url: str, redis_pid: int, port: int, client: qs.Client, seconds: float, repeats: int
) -> dict[str, float]:
    """Redis CPU while the worker idles, one scrape, and one key's items/s (median)."""
    rates = [pump(client, "knoop", ["default"], seconds=seconds) for _ in range(repeats)]
    cpu0, t0 = cpu_seconds(redis_pid), time.perf_counter()
    time.sleep(seconds)  # the worker idles: what its sweeps and reads cost Redis
    cpu = (cpu_seconds(redis_pid) - cpu0) / (time.perf_counter() - t0)
    size, took = scrape(port)  # the first scrape since the worker started: nothing cached
    return {
        "redis_cpu_pct": 100 * cpu,
        "metrics_bytes": size,
        "metrics_s": took,
        "items_per_s": statistics.median(rates),
    }


def idle_keys(
    url: str, redis_pid: int, count: int, seconds: float, repeats: int
) -> dict[str, float]:
    """idle_costs with no idle keys, then with ``count`` of them, in one worker's life."""
    port = free_port()
    proc, r = start_worker(url, "noop", "--metrics-port", str(port))
    client = qs.Client(url, prefix=PREFIX)
    out: dict[str, float] = {}
    try:
        pump(client, "knoop", ["default"], seconds=seconds)  # warm up
        for phase, known in (("0", 0), ("n", count)):
            if known:
                t0 = time.perf_counter()
                make_known(client, "knoop", [f"idle{i}" for i in range(known)])
                wait_until(
                    lambda: r.zcard(f"{PREFIX}:{{knoop}}:active") == 0,
                    WAIT_S,
                    "every idle key's request acked",
                )
                print(f"{known:,} idle keys made in {time.perf_counter() - t0:.1f} s", flush=True)
            figures = idle_costs(url, redis_pid, port, client, seconds, repeats)
            out.update({f"{name}_{phase}": value for name, value in figures.items()})
            print(
                f"{known:>7,} idle keys: Redis CPU {figures['redis_cpu_pct']:5.2f}% idle, "
                f"/metrics {figures['metrics_bytes']:,} bytes in "
                f"{figures['metrics_s'] * 1000:.0f} ms, one key "
                f"{figures['items_per_s']:,.0f} items/s",
                flush=True,
            )
    finally:
        client.close()
        r.close()
        stop_process(proc)  # type: ignore[arg-type]
    return out


def idle_verdict(results: dict[str, float], count: int) -> bool:
    checks = [
        (
            f"idle Redis CPU, {count:,} keys - 0 keys",
            results["redis_cpu_pct_n"] - results["redis_cpu_pct_0"],
            "<= 2 points",
            2.0,
            False,
        ),
        (f"/metrics bytes, {count:,} keys", results["metrics_bytes_n"], "< 1 MB", 1e6, False),
        (f"/metrics seconds, {count:,} keys", results["metrics_s_n"], "< 1 s", 1.0, False),
        (
            f"one key's items/s, {count:,} keys / 0 keys",
            results["items_per_s_n"] / results["items_per_s_0"],
            ">= 0.9",
            0.9,
            True,
        ),
    ]
    ok = True
    for name, value, budget, bound, at_least in checks:
        passed = value >= bound if at_least else value <= bound
        ok &= passed
        print(f"{name}: {value:,.2f} (budget {budget}): {'ok' if passed else 'MISS'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.keys", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer items: a fast check")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--idle-keys",
        type=int,
        default=0,
        metavar="N",
        help="measure what N idle keys cost instead (issue 23)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=3.0,
        help="--idle-keys: seconds per measurement (default 3)",
    )
    args = parser.parse_args(argv)
    if args.idle_keys:
        return idle_main(args.idle_keys, args.seconds, 1 if args.quick else 3, args.json)
    n = 100_000 if args.quick else 600_000
    repeats = 1 if args.quick else 3
    server = RedisServer().start()
    try:
        results: dict[str, float] = throughput(server.url, n, repeats)
        results.update(quiet_latency(server.url, 20_000 if args.quick else 100_000))
    finally:
        server.stop()
    ok = True
    for known in (10, 1000):
        ratio = results[f"keys_{known}"] / results["keys_1"]
        results[f"ratio_{known}"] = ratio
        passed = ratio >= 0.9
        ok &= passed
        print(f"{known} keys / 1 key: {ratio:.2f} (budget >= 0.9): {'ok' if passed else 'MISS'}")
    passed = results["quiet_in_batches"] <= 3
    ok &= passed
    print(
        f"quiet key: {results['quiet_in_batches']:.2f} batch times (budget <= 3): "
        f"{'ok' if passed else 'MISS'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok else 1


def idle_main(count: int, seconds: float, repeats: int, json_path: str | None) -> int:
    server = RedisServer().start()
    try:
        assert server.proc is not None
        results = idle_keys(server.url, server.proc.pid, count, seconds, repeats)
    finally:
        server.stop()
    ok = idle_verdict(results, count)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

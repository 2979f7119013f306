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

    python -m bench.keys [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import deque

import redis

import queueserve as qs

from ._harness import RedisServer, spawn_module, stop_process, wait_until
from .keys_servings import BATCH_S

PREFIX = "bk"
CHUNK = 256
THREADS = 4
WINDOW = 8  # requests in flight per thread
WAIT_S = 120.0
QUIET_SAMPLES = 9  # quiet requests sent one after another during the backlog


def start_worker(url: str, serving: str) -> tuple[object, redis.Redis]:
    proc = spawn_module("queueserve", "worker", f"bench.keys_servings:{serving}",
                        "--redis-url", url, "--prefix", PREFIX, "--log-level", "WARNING")
    r = redis.Redis.from_url(url)
    name = {"noop": "knoop", "timed": "ktimed"}[serving]
    wait_until(lambda: r.zcard(f"{PREFIX}:{{{name}}}:workers") > 0, 30, "the worker")
    return proc, r


def make_known(client: qs.Client, serving: str, keys: list[str]) -> None:
    """One request on each key, so the worker and Redis know them all."""
    tickets = [client.submit(serving, [0], batch_key=k) for k in keys]
    for t in tickets:
        t.result(WAIT_S)


def pump(client: qs.Client, serving: str, busy: list[str], n: int) -> float:
    """Items/s of ``n`` items in CHUNK-item requests over the ``busy`` keys, THREADS threads."""
    per_thread = n // THREADS // CHUNK

    def body(i: int) -> None:
        mine = busy[i::THREADS] or busy
        window: deque[qs.client.sync.Ticket] = deque()
        chunk = list(range(CHUNK))
        for j in range(per_thread):
            if len(window) >= WINDOW:
                assert len(window.popleft().result(WAIT_S)) == CHUNK
            window.append(client.submit(serving, chunk, batch_key=mine[j % len(mine)]))
        while window:
            assert len(window.popleft().result(WAIT_S)) == CHUNK

    threads = [threading.Thread(target=body, args=(i,)) for i in range(THREADS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return per_thread * THREADS * CHUNK / (time.perf_counter() - t0)


def throughput(url: str, n: int, repeats: int) -> dict[str, float]:
    proc, r = start_worker(url, "noop")
    client = qs.Client(url, prefix=PREFIX)
    out: dict[str, float] = {}
    try:
        pump(client, "knoop", ["default"], n // 4)  # warm up
        cases = {1: ["default"], 10: [f"t{i}" for i in range(10)],
                 1000: [f"m{i}" for i in range(1000)]}
        for known, keys in cases.items():
            make_known(client, "knoop", keys)
            busy = keys[: max(1, known // 2)]
            rates = [pump(client, "knoop", busy, n) for _ in range(repeats)]
            out[f"keys_{known}"] = statistics.median(rates)
            print(f"{known:>5} known keys, {len(busy):>3} busy: {out[f'keys_{known}']:>10,.0f} "
                  f"items/s (runs: {', '.join(f'{x:,.0f}' for x in rates)})", flush=True)
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
        tickets = [client.submit("ktimed", list(range(CHUNK)), batch_key="busy")
                   for _ in range(backlog // CHUNK)]
        stream = f"{PREFIX}:{{ktimed}}:in:busy"
        # all of it in Redis: the client's sender must not be busy when the quiet one goes
        wait_until(lambda: int(r.xinfo_stream(stream)["entries-added"]) > len(tickets), 60,
                   "the backlog enqueued")
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
        print(f"quiet key under a {backlog:,}-item backlog: median {latency * 1000:.1f} ms = "
              f"{latency / batch_s:.2f} batch times, max {max(latencies) / batch_s:.2f} (busy "
              f"batch {batch_s * 1000:.1f} ms; {left} busy requests still queued after the last "
              "quiet one)", flush=True)
        return {"quiet_latency_ms": latency * 1000, "batch_ms": batch_s * 1000,
                "quiet_in_batches": latency / batch_s,
                "quiet_max_in_batches": max(latencies) / batch_s, "backlog_left_requests": left}
    finally:
        client.close()
        r.close()
        stop_process(proc)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.keys", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer items: a fast check")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
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
    print(f"quiet key: {results['quiet_in_batches']:.2f} batch times (budget <= 3): "
          f"{'ok' if passed else 'MISS'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

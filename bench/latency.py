"""Latency against offered load, for fixed batch timeouts and for a latency target (issue 25).

Open-loop Poisson arrivals of single-item ``dispatch`` calls (one ``AsyncClient``, a task per
call, each timed from its scheduled send to its answer, so a client that falls behind shows as
latency) at shares of the serving's measured capacity, against ``affine``: a serving whose
batch of n items sleeps A + B*n seconds (stable on a shared machine), ``batch_size=32``, one
partition. Capacity is measured first, with a backlog of single-item requests. Per load and
policy: p50 and p99 latency and the answered items/s. Policies: ``batch_timeout`` 0, 2 ms,
10 ms, 50 ms, and ``max_latency=TARGET`` (with ``batch_timeout=50ms`` as its bound), set at
run time with ``config set`` on one worker.

Budget (issue 25): with max_latency, at every load up to 90%: p99 <= TARGET and items/s >=
0.95x the best fixed batch_timeout's; at 10%, p50 <= 1.5x batch_timeout=0's.

    python -m bench.latency [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import redis

import queueserve as qs

from ._harness import RedisServer, percentile, spawn_module, stop_process, wait_until

PREFIX = "blat"
A_S = 0.005  # what a batch costs whatever its size
B_S = 0.001  # what each item adds
TARGET_S = 0.1  # the max_latency policy's target
WAIT_S = 60.0
CONFIG_S = 1.5  # a worker picks up config changes within a second


def _affine(xs: list[Any]) -> list[Any]:
    time.sleep(A_S + B_S * len(xs))
    return xs


affine = qs.Serving(_affine, name="blat", batch_size=32, batch_timeout=0)

POLICIES: dict[str, dict[str, str]] = {
    "timeout 0": {"batch_timeout": "0", "max_latency": "0"},
    "timeout 2ms": {"batch_timeout": "2ms", "max_latency": "0"},
    "timeout 10ms": {"batch_timeout": "10ms", "max_latency": "0"},
    "timeout 50ms": {"batch_timeout": "50ms", "max_latency": "0"},
    f"max_latency {TARGET_S * 1000:g}ms": {
        "batch_timeout": "50ms",
        "max_latency": f"{TARGET_S * 1000:g}ms",
    },
}


def capacity(url: str, n: int) -> float:
    """Items/s the worker answers with a backlog of ``n`` single-item requests."""
    client = qs.Client(url, prefix=PREFIX)
    try:
        t0 = time.perf_counter()
        tickets = [client.submit("blat", [i]) for i in range(n)]
        for i, t in enumerate(tickets):
            if t.result(WAIT_S) != [i]:
                raise AssertionError(f"request {i}: wrong answer")
        return n / (time.perf_counter() - t0)
    finally:
        client.close()


async def open_loop(url: str, rate: float, seconds: float, seed: int) -> dict[str, float]:
    """Poisson arrivals at ``rate``/s for ``seconds``: latencies and answered items/s."""
    rng = random.Random(seed)
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    async with qs.AsyncClient(url, prefix=PREFIX) as client:

        async def one(at: float, i: int) -> None:
            if await client.dispatch("blat", i, timeout=WAIT_S) != i:
                raise AssertionError(f"call {i}: wrong answer")
            latencies.append(loop.time() - at)

        start = loop.time()
        at, i, tasks = start, 0, []
        while at < start + seconds:
            await asyncio.sleep(max(0.0, at - loop.time()))
            tasks.append(asyncio.create_task(one(at, i)))
            at += rng.expovariate(rate)
            i += 1
        await asyncio.gather(*tasks)
        elapsed = loop.time() - start
    latencies.sort()
    return {
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "items_s": len(latencies) / elapsed,
    }


def configure(r: redis.Redis, options: dict[str, str]) -> None:
    r.hset(f"{PREFIX}:{{blat}}:config", mapping=options)
    time.sleep(CONFIG_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="loads 10, 50, 90%%; 3 s each")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    loads, seconds = ((0.1, 0.5, 0.9), 3.0) if args.quick else ((0.1, 0.3, 0.5, 0.7, 0.9), 6.0)
    results: dict[str, Any] = {"a_s": A_S, "b_s": B_S, "target_s": TARGET_S}
    server = RedisServer().start()
    try:
        proc = spawn_module(
            "queueserve",
            "worker",
            "bench.latency:affine",
            "--redis-url",
            server.url,
            "--prefix",
            PREFIX,
            "--log-level",
            "ERROR",  # not a line per config change
        )
        r = redis.Redis.from_url(server.url)
        try:
            wait_until(lambda: r.zcard(f"{PREFIX}:{{blat}}:workers") > 0, 60, "the worker")
            configure(r, POLICIES["timeout 0"])
            full = capacity(server.url, 2000 if args.quick else 5000)
            results["capacity_items_s"] = full
            print(
                f"affine serving: {A_S * 1000:g} ms + {B_S * 1000:g} ms/item, batch_size 32; "
                f"measured capacity {full:.0f} items/s"
            )
            print("| load | policy | p50 ms | p99 ms | items/s |")
            print("|---|---|---|---|---|")
            for load in loads:
                for name, options in POLICIES.items():
                    configure(r, options)
                    row = asyncio.run(open_loop(server.url, load * full, seconds, seed=7))
                    results[f"{load:.0%} {name}"] = row
                    print(
                        f"| {load:.0%} | {name} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
                        f"{row['items_s']:.0f} |",
                        flush=True,
                    )
        finally:
            r.close()
            stop_process(proc)
    finally:
        server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

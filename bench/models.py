"""Many models behind one serving (issue 41; docs/usage.md, "Many models behind one serving").

    python -m bench.models [--partitions 2 4] [--requests 4000] [--json FILE]

32 batch keys, each a model whose load takes LOAD_S and whose batch takes BATCH_S
(bench/models_servings.py: simulated device time, so the figures are the scheduling's), get
REQUESTS one-item dispatches, IN_FLIGHT at a time (one asyncio client; each answer checked),
keys drawn with a Zipf(1.1) popularity (the same draw for every variant), on P partitions,
one private ``redis-server``, in one run. Throughput is the requests over the time to the
last answer:

- ``cached``: the feature: an LRU of 4 models per partition (max_loaded_keys=4), reads that
  follow what is loaded and charge a key its load (a key not held gathers requests for its
  lean, and partitions load such keys one at a time);
- ``per_batch``: (a) the model loaded for every batch;
- ``static``: (b) key i served only by partition i mod P (P servings of one partition each,
  with the same LRU of 4);
- ``ideal``: every model preloaded (where memory allows): device time alone (no ``load_key``,
  so keys take turns by batch, however few items each brings).

For each: items/s, loads, p50/p99 round trip per popularity decile (the keys by rank: decile
0 is the 4 most popular, decile 9 the 3 least), and (c) the offline optimum of loads for a
cache of 4 per partition (Belady: evict the model needed furthest in the future) over the
batches each partition ran, summed; and, as a bound no P caches can reach, Belady over all
batches in one cache of 4P.

Budgets (issue 41), ``cached`` on each P: items/s at least 0.9x ``ideal``'s; loads at most
1.3x the per-partition Belady optimum; the coldest decile's p99 within 3x the hottest's. A
wrong or missing answer fails the run (exit 2); a budget missed exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

import queueserve as qs
from bench._harness import RedisServer, percentile, spawn_module, stop_process
from bench._harness import wait_until as wait_for
from bench._verdict import Verdict, WorkFailed, at_least, at_most, report, run
from bench.models_servings import CACHE, STATIC_PARTITIONS

KEYS = 32
ZIPF_S = 1.1
PREFIX = "benchmodels"
IN_FLIGHT = 256  # requests the burst's client keeps in flight
VARIANTS = ("cached", "per_batch", "static", "ideal")


def zipf_weights(n: int = KEYS, s: float = ZIPF_S) -> list[float]:
    raw = [1.0 / (rank + 1) ** s for rank in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def decile(rank: int, n: int = KEYS) -> int:
    return rank * 10 // n


def belady(sequence: Sequence[str], cache: int) -> int:
    """Loads of the offline optimum over ``sequence`` with room for ``cache`` models: on a
    miss with the cache full, evict the model whose next use is furthest away (or never)."""
    next_use: list[int] = [0] * len(sequence)
    last: dict[str, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        next_use[i] = last.get(sequence[i], len(sequence))
        last[sequence[i]] = i
    held: dict[str, int] = {}  # model -> its next use
    loads = 0
    for i, key in enumerate(sequence):
        if key not in held:
            loads += 1
            if len(held) >= cache:
                del held[max(held, key=held.__getitem__)]
        held[key] = next_use[i]
    return loads


def belady_per_partition(batches: list[tuple[str, str]], cache: int) -> int:
    by_partition: dict[str, list[str]] = defaultdict(list)
    for pid, key in batches:
        by_partition[pid].append(key)
    return sum(belady(keys, cache) for keys in by_partition.values())


def burst(
    url: str, target: str | list[str], partitions: int, requests: int, seed: int
) -> tuple[int, dict[int, list[float]], float]:
    """``requests`` one-item dispatches, IN_FLIGHT at a time, keys drawn Zipf(1.1) (``seed``),
    each answer checked; (answers, round trips in seconds by decile, seconds to the last)."""
    rng = random.Random(seed)
    ranks = rng.choices(range(KEYS), zipf_weights(), k=requests)
    samples: dict[int, list[float]] = defaultdict(list)

    async def one(client: qs.AsyncClient, window: asyncio.Semaphore, i: int, rank: int) -> None:
        key = f"m{rank}"
        name = target if isinstance(target, str) else target[rank % partitions]
        async with window:
            started = time.perf_counter()
            got = await client.dispatch(name, i, batch_key=key, timeout=600)
            samples[decile(rank)].append(time.perf_counter() - started)
        if got != f"model-{key}:{i}":
            raise WorkFailed(f"{name} answered {got!r} for {key}:{i}")

    async def main() -> float:
        async with qs.AsyncClient(url, prefix=PREFIX) as client:
            for name in _names(target):  # its options read once, before the burst
                got = await client.dispatch(name, -1, batch_key="warm", timeout=600)
                if got != "model-warm:-1":
                    raise WorkFailed(f"{name} answered {got!r} for warm:-1")
            window = asyncio.Semaphore(IN_FLIGHT)
            started = time.perf_counter()
            await asyncio.gather(*(one(client, window, i, r) for i, r in enumerate(ranks)))
            return time.perf_counter() - started

    elapsed = asyncio.run(main())
    return sum(len(v) for v in samples.values()), samples, elapsed


def measure(url: str, variant: str, partitions: int, requests: int) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    r.delete("models:loads", "models:batches")
    workers = []
    if variant == "static":
        names = [f"static{i}" for i in range(partitions)]
        workers = [
            spawn_module(
                "queueserve", "worker", f"bench.models_servings:{name}", "--partitions", "1",
                "--redis-url", url, "--prefix", PREFIX, "--log-level", "WARNING",
            )
            for name in names
        ]  # fmt: skip
        target: str | list[str] = names
    else:
        workers = [
            spawn_module(
                "queueserve", "worker", f"bench.models_servings:{variant}",
                "--partitions", str(partitions), "--redis-url", url, "--prefix", PREFIX,
                "--log-level", "WARNING",
            )
        ]  # fmt: skip
        target = variant
    try:
        wait_for(
            lambda: sum(r.zcard(f"{PREFIX}:{{{n}}}:workers") for n in _names(target)) >= partitions,
            120,
            f"{variant}'s {partitions} partitions",
        )
        answered, samples, elapsed = burst(url, target, partitions, requests, seed=41)
    finally:
        for w in workers:
            stop_process(w, timeout=30)
    loads = r.llen("models:loads")
    batches = [tuple(x.decode().split(":", 1)) for x in r.lrange("models:batches", 0, -1)]
    r.close()
    deciles = {
        d: {
            "n": len(v),
            "p50_ms": percentile(sorted(v), 50) * 1000,
            "p99_ms": percentile(sorted(v), 99) * 1000,
        }
        for d, v in sorted(samples.items())
    }
    pairs = [(p, k) for p, k in batches]
    return {
        "variant": variant,
        "partitions": partitions,
        "items_per_s": answered / elapsed,
        "answered": answered,
        "batches": len(batches),
        "loads": loads,
        "belady": belady_per_partition(pairs, CACHE),
        "belady_pooled": belady([k for _, k in pairs], CACHE * partitions),
        "deciles": deciles,
    }


def _names(target: str | list[str]) -> list[str]:
    return [target] if isinstance(target, str) else target


def table(rows: list[dict[str, Any]]) -> None:
    print("| P | variant | items/s | batches | loads | Belady (per partition) | Belady (pooled) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['partitions']} | {row['variant']} | {row['items_per_s']:,.0f} | "
            f"{row['batches']:,} | {row['loads']:,} | {row['belady']:,} | "
            f"{row['belady_pooled']:,} |"
        )
    print()
    print("| P | variant | " + " | ".join(f"d{d} p50/p99 ms" for d in range(10)) + " |")
    print("|---|---|" + "---|" * 10)
    for row in rows:
        cells = [
            f"{row['deciles'][d]['p50_ms']:.0f}/{row['deciles'][d]['p99_ms']:.0f}"
            if d in row["deciles"]
            else "-"
            for d in range(10)
        ]
        print(f"| {row['partitions']} | {row['variant']} | " + " | ".join(cells) + " |")
    print(flush=True)


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    out = []
    for p in sorted({row["partitions"] for row in rows}):
        got = {row["variant"]: row for row in rows if row["partitions"] == p}
        cached, ideal = got["cached"], got["ideal"]
        out.append(
            at_least(
                f"P={p}: cached items/s >= 0.9x ideal",
                cached["items_per_s"] / ideal["items_per_s"],
                0.9,
                fmt="{:.2f}x",
            )
        )
        out.append(
            at_most(
                f"P={p}: cached loads <= 1.3x Belady (per partition)",
                cached["loads"] / max(cached["belady"], 1),
                1.3,
                fmt="{:.2f}x",
            )
        )
        deciles = cached["deciles"]
        coldest = max(deciles)
        out.append(
            at_most(
                f"P={p}: cached coldest decile p99 <= 3x hottest's",
                deciles[coldest]["p99_ms"] / deciles[0]["p99_ms"],
                3.0,
                fmt="{:.2f}x",
                note=f"d{coldest}: {deciles[coldest]['n']} calls",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--partitions", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if max(args.partitions) > STATIC_PARTITIONS:
        parser.error(f"at most {STATIC_PARTITIONS} partitions (the static servings)")

    def body() -> int:
        server = RedisServer().start()
        try:
            os.environ["QS_BENCH_URL"] = server.url  # the workers record there
            rows = []
            for p in args.partitions:
                for variant in args.variants:
                    row = measure(server.url, variant, p, args.requests)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        finally:
            server.stop()
        table(rows)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        if set(args.variants) >= {"cached", "ideal"}:
            return report(verdicts(rows))
        return 0

    return run(body)


if __name__ == "__main__":
    raise SystemExit(main())

"""What an idempotency key costs (issue 42): a keyed submit against a plain one, in one run, and
the Redis bytes of a key's record; and what the result cache is worth: a corpus with 30%
repeated items through ``map`` with the cache on and off, and the Redis bytes of a cached
embedding.

    python -m bench.once [--items 20000] [--cache-items 12000] [--rounds 3] [--part all]
                         [--quick] [--json out.json]

On a private ``redis-server`` (loopback, no persistence) with a ``queueserve worker`` of the
no-op serving ``bench.servings:noop``, rounds alternate three shapes of ``--items`` one-item
submits from THREADS threads in windows of WINDOW, every answer checked: plain
(``submit(noop, [i])``), jobs (``keep=`` a day: what a keyed request is besides its record),
and keyed (``submit(noop, [i], idempotency_key=...)``, a new key per
item, so each one runs: a job kept as long as its record, and the record written by the
enqueue script). Each shape's items/s is its median over the rounds. Then the last keyed
round's keys are sent again (every one a retry: answered from its first call's job, nothing
runs), and Redis's ``MEMORY USAGE`` of the records and ``used_memory`` per keyed request
(its record and its job's kept answer) are read.

The cache figure (``--part cache``): a ``queueserve worker`` of ``bench.once_servings``' two
servings, the same embedding function (simulated device time, a float32 vector of 384 per
item) with ``cache_ttl`` on and off. Each round makes a corpus of ``--cache-items`` texts, of
which REPEATS are repeats (each of a uniformly chosen new text of that round: every round
starts cold), shuffled, and sends it through
``map(chunk_size=CHUNK, max_in_flight=IN_FLIGHT)`` to each serving, alternating which goes
first; every answer is checked against the function's vector of its item. Each arm's items/s
is its median over the rounds; the enqueue script's hits and misses, ``MEMORY USAGE`` and
``STRLEN`` of the cached entries (a sample of 500) and ``used_memory`` per entry stored are
read after.

Budgets (issue 42): a keyed submit costs at most 15% over a plain one, so keyed items/s is at
least 1/1.15 of plain items/s in the same run; with the cache on, the corpus goes through at
least 1.35x as fast as with it off. A thread that fails or a wrong answer fails the run (exit
status 2); a budget missed gives 1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

import queueserve as qs
from bench._harness import RedisServer, spawn_module, stop_process, wait_until
from bench._verdict import Threads, Verdict, WorkFailed, at_least, report, run

PREFIX = "qsbo"
SERVING = "noop"
WINDOW = 512
THREADS = 8
WAIT_S = 60.0
KEYED_COST = 1.15  # a keyed submit's time per item, at most this times a plain one's
CACHE_GAIN = 1.35  # the corpus's items/s with the cache on, at least this times off
REPEATS = 0.3
CHUNK, IN_FLIGHT = 64, 8
JOB_KEEP_S = 86400.0  # the job shape keeps its answer as long as a key's record lives


def submit_all(client: qs.Client, n: int, key_of: Any, keep: float | None = None) -> float:
    """``n`` one-item submits from THREADS threads in windows, each answer checked; seconds.
    ``key_of(i)``: item i's idempotency key, or None for plain submits; ``keep``: jobs."""
    per = -(-n // THREADS)

    def body(t: int) -> None:
        start, stop = t * per, min(n, (t + 1) * per)
        for lo in range(start, stop, WINDOW):
            window = range(lo, min(stop, lo + WINDOW))
            tickets = [
                client.submit(SERVING, [i], keep=keep, idempotency_key=key_of(i)) for i in window
            ]
            for i, ticket in zip(window, tickets, strict=True):
                answer = ticket.result(WAIT_S)
                if answer != [i]:
                    raise WorkFailed(f"item {i} answered {answer!r:.80}, not [{i}]")

    threads = Threads(f"{n} submits from {THREADS} threads")
    began = time.perf_counter()
    for t in range(THREADS):
        threads.start(body, t)
    threads.join(WAIT_S + n / 100)
    return time.perf_counter() - began


def record_bytes(r: redis.Redis) -> tuple[int, float]:
    """How many key records there are, and their mean ``MEMORY USAGE`` (a sample of 1,000)."""
    keys = list(r.scan_iter(match=f"{PREFIX}:{{{SERVING}}}:once:*", count=10_000))
    sample = keys[:1000]
    sizes = [int(r.memory_usage(k) or 0) for k in sample]
    return len(keys), statistics.mean(sizes) if sizes else 0.0


def measure(n: int, rounds: int) -> dict[str, Any]:
    server = RedisServer().start()
    r = redis.Redis.from_url(server.url)
    worker = spawn_module(
        "queueserve",
        "worker",
        "bench.servings:noop",
        "--redis-url",
        server.url,
        "--prefix",
        PREFIX,
        "--log-level",
        "WARNING",
    )
    try:
        wait_until(lambda: r.zcard(f"{PREFIX}:{{{SERVING}}}:workers") > 0, 30, "the worker")
        plain: list[float] = []
        jobs: list[float] = []
        keyed: list[float] = []
        with qs.Client(server.url, prefix=PREFIX) as client:
            if client.dispatch(SERVING, 0) != 0:  # warm: the client's inbox and connections
                raise WorkFailed("the warm-up call was not answered 0")
            for k in range(rounds):  # alternating, so a machine growing busier weighs on both
                plain.append(n / submit_all(client, n, lambda _: None))
                jobs.append(n / submit_all(client, n, lambda _: None, JOB_KEEP_S))
                before = int(r.info("memory")["used_memory"])
                keyed.append(n / submit_all(client, n, lambda i, k=k: f"round{k}-item{i}"))
                kept = int(r.info("memory")["used_memory"]) - before
            last = rounds - 1
            retried = n / submit_all(client, n, lambda i: f"round{last}-item{i}")
            records, mean_record = record_bytes(r)
        return {
            "items": n,
            "rounds": rounds,
            "plain_items_per_s": [round(x) for x in plain],
            "job_items_per_s": [round(x) for x in jobs],
            "keyed_items_per_s": [round(x) for x in keyed],
            "plain_median": round(statistics.median(plain)),
            "job_median": round(statistics.median(jobs)),
            "keyed_median": round(statistics.median(keyed)),
            "job_per_plain": round(statistics.median(jobs) / statistics.median(plain), 3),
            "keyed_per_plain": round(statistics.median(keyed) / statistics.median(plain), 3),
            "retried_items_per_s": round(retried),
            "records": records,
            "record_memory_usage_bytes": round(mean_record, 1),
            "used_memory_per_keyed_request": round(kept / n, 1),
            "redis": server.version(),
        }
    finally:
        r.close()
        stop_process(worker)
        server.stop()


def corpus(n: int, k: int) -> list[str]:
    """Round ``k``'s texts, shuffled: (1 - REPEATS) * n new ones (of this round only) and
    REPEATS * n repeats of them, each of a uniformly chosen one."""
    rng = random.Random(k)
    fresh = [f"round{k}-doc{j}" for j in range(n - int(n * REPEATS))]
    out = fresh + [rng.choice(fresh) for _ in range(int(n * REPEATS))]
    rng.shuffle(out)
    return out


def map_all(client: qs.Client, serving: str, texts: list[str]) -> float:
    """``texts`` through ``map``, every answer checked after the clock stops; seconds."""
    from bench.once_servings import vector

    began = time.perf_counter()
    got = list(client.map(serving, texts, chunk_size=CHUNK, max_in_flight=IN_FLIGHT))
    took = time.perf_counter() - began
    for text, answer in zip(texts, got, strict=True):
        if not np.array_equal(answer, vector(text)):
            raise WorkFailed(f"{serving}: {text!r} was not answered its vector")
    return took


def cache_hash(r: redis.Redis, name: str) -> dict[str, int]:
    raw = r.hgetall(f"{PREFIX}:{{{name}}}:cachestats")
    return {k.decode(): int(v) for k, v in raw.items()}


def entry_bytes(r: redis.Redis, name: str) -> tuple[float, float]:
    """Mean ``MEMORY USAGE`` and ``STRLEN`` of a sample of 500 of ``name``'s cached entries."""
    keys = list(r.scan_iter(match=f"{PREFIX}:{{{name}}}:cached:*", count=10_000))[:500]
    if not keys:
        raise WorkFailed(f"{name}: no cached entry was written")
    usage = statistics.mean(int(r.memory_usage(k) or 0) for k in keys)
    return usage, statistics.mean(int(r.strlen(k)) for k in keys)


def measure_cache(n: int, rounds: int) -> dict[str, Any]:
    server = RedisServer().start()
    r = redis.Redis.from_url(server.url)
    on, off = "embed_cached", "embed_plain"
    worker = spawn_module(
        "queueserve", "worker", f"bench.once_servings:{on}", f"bench.once_servings:{off}",
        "--redis-url", server.url, "--prefix", PREFIX, "--log-level", "WARNING",
    )  # fmt: skip
    try:
        for name in (on, off):
            wait_until(lambda n=name: r.zcard(f"{PREFIX}:{{{n}}}:workers") > 0, 30, name)
        cached: list[float] = []
        plain: list[float] = []
        with qs.Client(server.url, prefix=PREFIX) as client:
            map_all(client, on, ["warm"])
            map_all(client, off, ["warm"])
            stored_before, used_before = cache_hash(r, on).get("stored", 0), 0
            for k in range(rounds):
                texts = corpus(n, k)
                arms = [(on, cached), (off, plain)]
                for name, rates in arms if k % 2 == 0 else arms[::-1]:
                    if name == on and k == 0:
                        used_before = int(r.info("memory")["used_memory"])
                    rates.append(n / map_all(client, name, texts))
                    if name == on and k == 0:
                        used = int(r.info("memory")["used_memory"]) - used_before
                        stored_first = cache_hash(r, on).get("stored", 0) - stored_before
            stats = cache_hash(r, on)
            usage, strlen = entry_bytes(r, on)
        repeats = n - len(set(corpus(n, 0)))
        return {
            "cache_items": n,
            "cache_rounds": rounds,
            "repeated_fraction": round(repeats / n, 3),
            "cache_on_items_per_s": [round(x) for x in cached],
            "cache_off_items_per_s": [round(x) for x in plain],
            "cache_on_per_off": round(statistics.median(cached) / statistics.median(plain), 3),
            "cache_hits": stats.get("hits", 0),
            "cache_misses": stats.get("misses", 0),
            "cached_entry_memory_usage_bytes": round(usage, 1),
            "cached_entry_strlen_bytes": round(strlen, 1),
            "used_memory_per_entry_stored": round(used / max(1, stored_first), 1),
            "redis": server.version(),
        }
    finally:
        r.close()
        stop_process(worker)
        server.stop()


def judge(out: dict[str, Any]) -> list[Verdict]:
    verdicts = []
    if "keyed_per_plain" in out:
        verdicts.append(
            at_least(
                f"keyed submit items/s >= 1/{KEYED_COST:g} of plain submit's (same run)",
                out["keyed_per_plain"],
                round(1 / KEYED_COST, 3),
                fmt="{:.3f}x",
            )
        )
    if "cache_on_per_off" in out:
        verdicts.append(
            at_least(
                f"30% repeats through map: cache on >= {CACHE_GAIN:g}x off (same run)",
                out["cache_on_per_off"],
                CACHE_GAIN,
                fmt="{:.3f}x",
            )
        )
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.once", description=__doc__)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--cache-items", type=int, default=12_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part", choices=("all", "keys", "cache"), default="all")
    parser.add_argument("--quick", action="store_true", help="5,000 items, 3 rounds")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.cache_items, args.rounds = 5_000, 3_000, 3

    def body() -> int:
        out: dict[str, Any] = {}
        if args.part in ("all", "keys"):
            out |= measure(args.items, args.rounds)
        if args.part in ("all", "cache"):
            out |= measure_cache(args.cache_items, args.rounds)
        verdicts = judge(out)
        out["budget_ok"] = all(v.met for v in verdicts)
        print(json.dumps(out, indent=2))
        if args.json:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        return report(verdicts)

    return run(body)


if __name__ == "__main__":
    sys.exit(main())

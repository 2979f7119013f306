"""What an idempotency key costs (issue 42): a keyed submit against a plain one, in one run, and
the Redis bytes of a key's record.

    python -m bench.once [--items 20000] [--rounds 3] [--quick] [--json out.json]

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

Budget (issue 42): a keyed submit costs at most 15% over a plain one, so keyed items/s is at
least 1/1.15 of plain items/s in the same run. The result cache of the issue is not built: its
figures are not measured here. A thread that fails or a wrong answer fails the run (exit
status 2); a budget missed gives 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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


def judge(out: dict[str, Any]) -> list[Verdict]:
    return [
        at_least(
            f"keyed submit items/s >= 1/{KEYED_COST:g} of plain submit's (same run)",
            out["keyed_per_plain"],
            round(1 / KEYED_COST, 3),
            fmt="{:.3f}x",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.once", description=__doc__)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5,000 items, 3 rounds")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.rounds = 5_000, 3

    def body() -> int:
        out = measure(args.items, args.rounds)
        verdicts = judge(out)
        out["budget_ok"] = all(v.met for v in verdicts)
        print(json.dumps(out, indent=2))
        if args.json:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        return report(verdicts)

    return run(body)


if __name__ == "__main__":
    sys.exit(main())

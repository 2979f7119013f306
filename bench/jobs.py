"""What finished jobs cost Redis, and that it all goes when their keep passes (issue 26).

    python -m bench.jobs [--jobs 100000] [--keep 60] [--json out.json]

On a private ``redis-server`` (loopback, no persistence) with a ``queueserve worker`` of the
no-op serving ``bench.servings:noop``: ``--jobs`` jobs of one small item each
(``submit(noop, [i], keep=...)``, 8 threads, windows of 512), all waited for; then Redis's
``used_memory`` against what it was before the jobs (a client's inboxes emptied, the streams
acked: what is left is the job records), their record groups counted (64 jobs a key); then,
once ``keep`` passed, the same again. The budget: at most 40 MB for 100,000 jobs, and no
group and no memory of theirs left after expiry (docs/benchmarks.md, "Jobs").
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis

import queueserve as qs
from bench._harness import RedisServer, spawn_module, stop_process, wait_until

PREFIX = "qsbj"
SERVING = "noop"
BUDGET_BYTES = 40 * 1000 * 1000
WINDOW = 512
THREADS = 8


def submit_jobs(client: qs.Client, n: int, keep: float) -> float:
    """Submit ``n`` one-item jobs from THREADS threads in windows; wait for all; seconds."""
    per = -(-n // THREADS)

    def body(t: int) -> None:
        start, stop = t * per, min(n, (t + 1) * per)
        for lo in range(start, stop, WINDOW):
            tickets = [
                client.submit(SERVING, [i], keep=keep) for i in range(lo, min(stop, lo + WINDOW))
            ]
            for ticket in tickets:
                ticket.result(60)

    threads = [threading.Thread(target=body, args=(t,)) for t in range(THREADS)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began


def job_groups(r: redis.Redis) -> int:
    return sum(1 for _ in r.scan_iter(match=f"{PREFIX}:jobs:*", count=10_000))


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def measure(n: int, keep: float) -> dict[str, Any]:
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
        with qs.Client(server.url, prefix=PREFIX) as client:
            client.dispatch(SERVING, 0)  # warm: the client's inbox and connections exist
            before = used(r)
            seconds = submit_jobs(client, n, keep)
            kept, keys = used(r), job_groups(r)
            expires = time.monotonic() + keep
            wait_until(lambda: job_groups(r) == 0, keep + 60, "every job record to expire")
            after_expiry = used(r)
            expired_after = round(time.monotonic() - expires, 1)
        return {
            "jobs": n,
            "keep_s": keep,
            "submit_items_per_s": round(n / seconds),
            "job_groups_kept": keys,
            "bytes_kept": kept - before,
            "bytes_per_job": round((kept - before) / n, 1),
            "bytes_left_after_expiry": after_expiry - before,
            "all_gone_s_after_keep": expired_after,
            "budget_ok": kept - before <= BUDGET_BYTES * n / 100_000 and keys >= n // 64,
            "redis": server.version(),
        }
    finally:
        stop_process(worker)
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.jobs", description=__doc__)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--keep", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    out = measure(args.jobs, args.keep)
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if out["budget_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""What finished jobs cost Redis, and that it all goes when their keep passes (issue 26).

    python -m bench.jobs [--jobs 100000] [--keep 60] [--quick] [--json out.json]

On a private ``redis-server`` (loopback, no persistence) with a ``queueserve worker`` of the
no-op serving ``bench.servings:noop``: ``--jobs`` jobs of one small item each
(``submit(noop, [i], keep=...)``, 8 threads, windows of 512), all waited for and each answer
checked (``[i]``: noop echoes its items); then Redis's ``used_memory`` against what it was
before the jobs (a client's inboxes emptied, the streams acked: what is left is the job
records), their record groups counted (64 jobs a key); then, once ``keep`` passed and every
group is gone, ``used_memory`` again, with the client closed. ``--quick``: 10,000 jobs, a
keep of 5 s.

Budgets (docs/benchmarks.md, "Jobs"): at most 40 MB for 100,000 jobs (pro rata), every job's
record kept until its keep (at least one group per 64 jobs); once it passed, no group left
and ``used_memory`` within LEFT_BYTES of before (Redis keeps its key-space table sized for the
peak a while). A thread that fails or a wrong answer fails the run (exit status 2); a budget
missed gives 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import redis

import queueserve as qs
from bench._harness import RedisServer, spawn_module, stop_process, wait_until
from bench._verdict import Threads, Verdict, WorkFailed, at_least, at_most, report, run

PREFIX = "qsbj"
SERVING = "noop"
BUDGET_BYTES = 40 * 1000 * 1000
WINDOW = 512
THREADS = 8
LEFT_BYTES = 512 * 1024  # used_memory after expiry, at most this much above before
WAIT_S = 60.0


def submit_jobs(client: qs.Client, n: int, keep: float) -> float:
    """Submit ``n`` one-item jobs from THREADS threads in windows; wait for all, each answer
    checked; seconds. A thread's error or a wrong answer fails the run."""
    per = -(-n // THREADS)

    def body(t: int) -> None:
        start, stop = t * per, min(n, (t + 1) * per)
        for lo in range(start, stop, WINDOW):
            window = range(lo, min(stop, lo + WINDOW))
            tickets = [client.submit(SERVING, [i], keep=keep) for i in window]
            for i, ticket in zip(window, tickets, strict=True):
                answer = ticket.result(WAIT_S)
                if answer != [i]:
                    raise WorkFailed(f"job of item {i} answered {answer!r:.80}, not [{i}]")

    threads = Threads(f"{n} jobs from {THREADS} threads")
    began = time.perf_counter()
    for t in range(THREADS):
        threads.start(body, t)
    threads.join(WAIT_S + n / 100)
    return time.perf_counter() - began


def job_groups(r: redis.Redis) -> int:
    return sum(1 for _ in r.scan_iter(match=f"{PREFIX}:jobs:*", count=10_000))


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def gone(r: redis.Redis, timeout: float) -> bool:
    """Whether every job group expired within ``timeout`` seconds."""
    try:
        wait_until(lambda: job_groups(r) == 0, timeout, "every job record to expire")
    except RuntimeError:
        return False
    return True


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
            if client.dispatch(SERVING, 0) != 0:  # warm: the client's inbox and connections
                raise WorkFailed("the warm-up call was not answered 0")
            before = used(r)
            seconds = submit_jobs(client, n, keep)
            kept, keys = used(r), job_groups(r)
            expires = time.monotonic() + keep
        all_gone = gone(r, keep + 60)
        after_expiry = used(r)
        return {
            "jobs": n,
            "keep_s": keep,
            "submit_items_per_s": round(n / seconds),
            "job_groups_kept": keys,
            "bytes_kept": kept - before,
            "bytes_per_job": round((kept - before) / n, 1),
            "job_groups_left_after_expiry": job_groups(r),
            "bytes_left_after_expiry": after_expiry - before,
            "all_gone_s_after_keep": round(time.monotonic() - expires, 1) if all_gone else None,
            "redis": server.version(),
        }
    finally:
        r.close()
        stop_process(worker)
        server.stop()


def judge(out: dict[str, Any]) -> list[Verdict]:
    """The budgets against one run's figures (``measure``'s)."""
    n = out["jobs"]
    return [
        at_most(
            f"Redis memory held by {n:,} finished jobs <= {BUDGET_BYTES * n / 100_000 / 1e6:g} MB",
            out["bytes_kept"] / 1e6,
            BUDGET_BYTES * n / 100_000 / 1e6,
            fmt="{:.1f} MB",
        ),
        at_least(
            f"every job's record kept until its keep: groups >= {n // 64}",
            out["job_groups_kept"],
            n // 64,
            fmt="{:.0f}",
        ),
        at_most(
            "no group left after keep",
            out["job_groups_left_after_expiry"],
            0,
            fmt="{:.0f}",
            positive=False,
        ),
        at_most(
            f"no memory left after keep: used_memory within {LEFT_BYTES / 1e6:.1f} MB of before",
            out["bytes_left_after_expiry"] / 1e6,
            LEFT_BYTES / 1e6,
            fmt="{:+.2f} MB",
            positive=False,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.jobs", description=__doc__)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--keep", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--quick", action="store_true", help="10,000 jobs, keep 5 s")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.keep = 10_000, 5.0

    def body() -> int:
        out = measure(args.jobs, args.keep)
        verdicts = judge(out)
        out["budget_ok"] = all(v.met for v in verdicts)
        print(json.dumps(out, indent=2))
        if args.json:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        return report(verdicts)

    return run(body)


if __name__ == "__main__":
    sys.exit(main())

"""What the open endpoints cost under large Redis state (issue 38, finding 5).

1. ``overview``: a ``queueserve dashboard`` process over one serving holding 20,000 batch keys,
   each with one queued request (enqueue.lua wrote them). Each read of ``/api/overview`` is
   timed from send to answer, every one a page not read before (a filter the serving's name
   holds: never the dashboard's one-second snapshot), and Redis's commands per read are
   counted (INFO commandstats); then six callers read one new page at once (the issue's
   shape: 64-76 s each before). The dashboard's resident memory (VmRSS, and its peak VmHWM)
   is read from /proc after it all. Budgets: every read within 0.5 s, RSS under 150 MiB.
2. ``models``: a ``queueserve gateway`` process with 1,000,000 keys of another application in
   its Redis; ``GET /v1/models`` timed 200 times. Budget: p99 within 20 ms. Redis's SCAN
   calls meanwhile are counted (0: the list is the registry's).

A private redis-server on a free port, never the machine's shared one.

    python -m bench.overview_cost [--quick] [--json FILE]

``--quick``: 2,000 batch keys and 100,000 unrelated keys, fewer reads (a smoke run; its
figures are not the budgets').
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import redis

from bench._harness import RedisServer, free_port, percentile, spawn_module, stop_process
from queueserve.broker.producer import Producer
from queueserve.wire.keys import Keys, inbox_key, servings_key

PREFIX = "qsbench"
SERVING = "embed"
OVERVIEW_BUDGET_S = 0.5
RSS_BUDGET_MIB = 150.0
MODELS_BUDGET_S = 0.020


def declare(r: redis.Redis) -> None:
    """The serving as a worker declares it (meta hash, registry entry), without a worker."""
    r.hset(Keys(PREFIX, SERVING).meta, mapping={"codec": "msgpack", "batch_size": "8"})
    r.zadd(servings_key(PREFIX), {SERVING: int(time.time() * 1000)})


def fill(url: str, count: int) -> None:
    """``count`` batch keys of the serving, each with one queued request of one item."""
    keys = Keys(PREFIX, SERVING)
    payload = bytes(msgpack.packb([1]))
    reply_to = inbox_key(PREFIX, "bench")
    with contextlib.closing(Producer(url)) as broker:
        for first in range(0, count, 1000):
            requests = [
                (f"k{i}", 1, bytes(msgpack.packb([1, i, 1, reply_to, 0, "msgpack"])), payload, 0)
                for i in range(first, min(first + 1000, count))
            ]
            broker.enqueue(keys, requests, 0)


def unrelated(r: redis.Redis, count: int) -> None:
    for first in range(0, count, 10_000):
        r.mset({f"other:app:{i}": "x" for i in range(first, min(first + 10_000, count))})


def calls(r: redis.Redis, name: str) -> int:
    stats = r.info("commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


def total_calls(r: redis.Redis) -> int:
    return sum(int(v["calls"]) for k, v in r.info("commandstats").items() if k != "cmdstat_info")


def memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of process ``pid`` in MiB."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


def serve(command: str, url: str) -> tuple[Any, str]:
    port = free_port()
    proc = spawn_module(
        "queueserve",
        *(command, "--port", str(port), "--redis-url", url, "--prefix", PREFIX),
        "--log-level",
        "WARNING",
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/healthz" if command == "gateway" else base, timeout=2).is_success:
                return proc, base
        time.sleep(0.1)
    stop_process(proc)
    raise RuntimeError(f"queueserve {command} did not answer within 60 s")


def pages() -> list[str]:
    """Filters the serving's name holds, each a page of its own (a snapshot not yet taken)."""
    return sorted(
        {SERVING[i:j] for i in range(len(SERVING)) for j in range(i + 1, len(SERVING) + 1)}
    )


def overview(url: str, r: redis.Redis, keys: int) -> dict[str, Any]:
    declare(r)
    started = time.monotonic()
    fill(url, keys)
    filled = time.monotonic() - started
    proc, base = serve("dashboard", url)
    try:
        with httpx.Client(base_url=base, timeout=120) as http:
            times, commands = [], []
            for page in pages()[:-1]:
                before = total_calls(r)
                t0 = time.perf_counter()
                response = http.get("/api/overview", params={"filter": page})
                times.append(time.perf_counter() - t0)
                commands.append(total_calls(r) - before)
                response.raise_for_status()
                [row] = response.json()["servings"]
                assert row["queue_counts"]["keys_with_work"] == keys, row["queue_counts"]
            together: list[float] = []
            barrier = threading.Barrier(6)

            def read() -> None:
                barrier.wait()
                t0 = time.perf_counter()
                http.get("/api/overview", params={"filter": pages()[-1]}).raise_for_status()
                together.append(time.perf_counter() - t0)

            threads = [threading.Thread(target=read) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        rss, peak = memory_mib(proc.pid)
    finally:
        stop_process(proc)
    ordered = sorted(times)
    return {
        "batch_keys": keys,
        "fill_s": round(filled, 1),
        "reads": len(times),
        "read_p50_s": round(percentile(ordered, 50), 4),
        "read_max_s": round(ordered[-1], 4),
        "six_at_once_max_s": round(max(together), 4),
        "commands_per_read_max": max(commands),
        "rss_mib": round(rss, 1),
        "peak_rss_mib": round(peak, 1),
        "ok": ordered[-1] <= OVERVIEW_BUDGET_S
        and max(together) <= OVERVIEW_BUDGET_S
        and peak < RSS_BUDGET_MIB,
    }


def models(url: str, r: redis.Redis, keys: int, asks: int) -> dict[str, Any]:
    declare(r)
    started = time.monotonic()
    unrelated(r, keys)
    filled = time.monotonic() - started
    proc, base = serve("gateway", url)
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            http.get("/v1/models").raise_for_status()  # (the gateway's client connects)
            scans = calls(r, "scan")
            times = []
            for _ in range(asks):
                t0 = time.perf_counter()
                response = http.get("/v1/models")
                times.append(time.perf_counter() - t0)
                response.raise_for_status()
            listed = [m["id"] for m in response.json()["data"]]
            assert SERVING in listed, listed  # (and the models mapped to it)
            scans = calls(r, "scan") - scans
    finally:
        stop_process(proc)
    ordered = sorted(times)
    p99 = percentile(ordered, 99)
    return {
        "unrelated_keys": r.dbsize(),
        "fill_s": round(filled, 1),
        "asks": asks,
        "p50_ms": round(percentile(ordered, 50) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
        "scans": scans,
        "ok": p99 <= MODELS_BUDGET_S and scans == 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller state, fewer reads")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    batch_keys, other_keys, asks = (2_000, 100_000, 50) if args.quick else (20_000, 1_000_000, 200)
    results: dict[str, Any] = {}
    for name, run in (
        ("overview", lambda url, r: overview(url, r, batch_keys)),
        ("models", lambda url, r: models(url, r, other_keys, asks)),
    ):
        server = RedisServer().start()
        try:
            with contextlib.closing(redis.Redis.from_url(server.url)) as r:
                results[name] = run(server.url, r)
        finally:
            server.stop()
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    ok = all(r["ok"] for r in results.values())
    print("within budget" if ok else "OVER BUDGET")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

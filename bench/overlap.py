"""Overlap benchmark: does the device ever wait on Redis or decoding? (issue 3, docs/design.md §6)

A serving whose batch takes a fixed device time T runs in a real worker process, under a load
that always has more than a batch queued. The ideal is ``batch_size / T`` items/s; the ratio to
it is the budget (>= 0.95). Two devices: a GIL-releasing sleep of exactly T, and a real torch
matmul on one thread sized to take T when run alone.

A CPU "device" on a 2-core machine shares the cores with Redis, the client and the worker's
I/O threads, so the matmul itself runs slower under load than alone. Two ratios are reported:
to the standalone T (``ratio``), and to the device time the batches really took during the
run (``busy``: the fraction of wall time the device was working; the budget's question, "does
the device ever wait?", is this one).

    python -m bench.overlap [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request

import redis

import queueserve as qs

from ._harness import RedisServer, free_port, spawn_module, stop_process, wait_until

CASES = [  # (serving, T seconds, batch size)
    ("sleep", 0.020, 64),
    ("sleep", 0.005, 64),
    ("matmul", 0.020, 64),
]


def _busy_seconds(port: int, serving: str) -> tuple[float, float]:
    """(seconds in the batch function, batches) so far, from the worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    busy: list[float] = []
    batches: list[float] = []
    for line in text.splitlines():
        if line.startswith("queueserve_partition_busy_seconds_total{") and serving in line:
            busy.append(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("queueserve_batch_execution_seconds_count{") and serving in line:
            batches.append(float(line.rsplit(" ", 1)[1]))
    if not busy or not batches:  # never 0: a renamed metric would read as an idle device
        raise RuntimeError(
            f"the worker's /metrics lacks queueserve_partition_busy_seconds_total"
            f" or queueserve_batch_execution_seconds_count for {serving!r}"
        )
    return sum(busy), sum(batches)


def _measure(
    url: str, serving: str, batches: int, batch: int, port: int
) -> tuple[float, float, float]:
    """Items/s under saturating load, and the device's busy seconds and batches meanwhile."""
    client = qs.Client(url, prefix=f"ov{serving}")
    try:
        assert client.dispatch(serving, 0, timeout=120) == 0  # warm: setup done, worker reading
        busy0, batches0 = _busy_seconds(port, serving)
        items = batches * batch
        started = time.perf_counter()
        for _ in client.map(serving, range(items), chunk_size=max(1, batch // 4), max_in_flight=64):
            pass
        wall = time.perf_counter() - started
        busy1, batches1 = _busy_seconds(port, serving)
        return items / wall, (busy1 - busy0), (batches1 - batches0)
    finally:
        client.close()


def run_case(url: str, serving: str, t: float, batch: int, batches: int) -> dict[str, float]:
    os.environ.update(QS_BENCH_T=str(t), QS_BENCH_BATCH=str(batch), QS_BENCH_URL=url)
    r = redis.Redis.from_url(url)
    r.delete("bench:matmul_t")
    port = free_port()
    worker = spawn_module(
        "queueserve",
        "worker",
        f"bench.overlap_servings:{serving.capitalize()}",
        "--redis-url",
        url,
        "--prefix",
        f"ov{serving}",
        "--partitions",
        "1",
        "--metrics-port",
        str(port),
        "--log-level",
        "WARNING",
    )
    try:
        rate, busy, ran = _measure(url, serving, batches, batch, port)
    finally:
        stop_process(worker, timeout=60)
    device_t = t
    if serving == "matmul":
        wait_until(lambda: r.exists("bench:matmul_t"), 10, "matmul calibration")
        device_t = float(r.get("bench:matmul_t") or t)
    in_run_t = busy / max(ran, 1)
    r.close()
    ideal = batch / device_t
    return {
        "T_ms": device_t * 1000,
        "T_in_run_ms": in_run_t * 1000,
        "batch_size": batch,
        "items_per_s": rate,
        "ideal": ideal,
        "ratio": rate / ideal,
        "busy": rate / (batch / in_run_t),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches, for a smoke run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    batches = 30 if args.quick else 200
    server = RedisServer().start()
    results = []
    try:
        for serving, t, batch in CASES:
            r = run_case(server.url, serving, t, batch, batches)
            results.append({"device": serving, **r})
            print(
                f"{serving:>7}  T={r['T_ms']:6.2f} ms (in run {r['T_in_run_ms']:6.2f})  "
                f"batch={batch:3d}  {r['items_per_s']:9.0f} items/s  ideal {r['ideal']:9.0f}  "
                f"ratio {r['ratio']:.3f}  busy {r['busy']:.3f}  (budget >= 0.95)",
                flush=True,
            )
    finally:
        server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overlap": results, "batches": batches}, f, indent=2)


if __name__ == "__main__":
    main()

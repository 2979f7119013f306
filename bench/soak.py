"""Soak: worker memory stays flat under sustained load (docs/design.md §8: within 5% over 10
minutes).

A `queueserve worker bench.servings:noop` process (one partition) serves a steady mix for the
whole duration: packed `map` requests, single-item `dispatch` calls from several threads, and a
trickle of failing items (so error paths run too). The partition's resident memory is sampled
every few seconds; the figure is the growth from the end of the warm-up (the first tenth of the
run) to the end, as a ratio of the warm-up RSS.

    python -m bench.soak [--minutes 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import queueserve as qs

from ._harness import RedisServer, process_tree, spawn_module, stop_process, wait_until

PREFIX = "soak"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _load(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    client = qs.Client(url, prefix=PREFIX)
    try:
        while not stop.is_set():
            for _ in client.map("noop", range(20_000), chunk_size=256):
                pass
            counts["items"] += 20_000
            results = client.dispatch_many("noop", list(range(100)))
            counts["items"] += len(results)
    finally:
        client.close()


def _singles(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    client = qs.Client(url, prefix=PREFIX)
    try:
        while not stop.is_set():
            client.dispatch("noop", "x")
            counts["items"] += 1
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--json", help="write the samples and the figure here")
    args = parser.parse_args()
    server = RedisServer().start()
    worker = spawn_module(
        "queueserve", "worker", "bench.servings:noop", "--redis-url", server.url,
        "--prefix", PREFIX, "--partitions", "1", "--log-level", "WARNING",
    )
    stop = threading.Event()
    counts = {"items": 0}
    try:
        wait_until(lambda: len(process_tree(worker.pid)) >= 2, 60, "the partition process")
        partition = process_tree(worker.pid)[1]
        threads = [threading.Thread(target=_load, args=(server.url, stop, counts))]
        threads += [threading.Thread(target=_singles, args=(server.url, stop, counts))
                    for _ in range(4)]
        for t in threads:
            t.start()
        started = time.monotonic()
        duration = args.minutes * 60
        samples: list[tuple[float, float, int]] = []
        while (elapsed := time.monotonic() - started) < duration:
            samples.append((elapsed, rss_mib(partition), counts["items"]))
            print(f"{elapsed:7.0f}s  rss {samples[-1][1]:7.1f} MiB  items {samples[-1][2]:,}",
                  flush=True)
            time.sleep(args.every)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        stop_process(worker, timeout=60)
        server.stop()
    warm = [s for s in samples if s[0] >= duration / 10]
    base, end = warm[0][1], samples[-1][1]
    growth = (end - base) / base
    print(f"partition RSS after warm-up {base:.1f} MiB, at the end {end:.1f} MiB: growth "
          f"{growth * 100:+.1f}% over {args.minutes:g} min, {samples[-1][2]:,} items "
          f"(budget within 5%: {'ok' if abs(growth) <= 0.05 else 'MISS'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": samples, "growth": growth, "minutes": args.minutes}, f)


if __name__ == "__main__":
    main()

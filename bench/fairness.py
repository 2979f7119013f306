"""Fairness under every shape of backlog (issue 25): a quiet key's and a priority-9 request's
wait, in batch times, while key "bulk" drains a backlog.

The serving's batch takes a fixed BATCH_S (``batch_size=10, batch_timeout=5ms``, one
partition), so "a batch time" is a fixed, known duration on any machine. Shapes of backlog:

- ``submit``: one ``submit`` of ITEMS items;
- ``dispatch_many``: one ``dispatch_many`` of ITEMS items (from a thread: it blocks);
- ``map``: ``list(client.map(..., chunk_size=256))`` of ITEMS items (map is lazy: its results
  are consumed, so its chunks are sent as it goes);
- ``packs16``: 16 clients, each submitting ITEMS / 16 one-item requests (clients pack them);
- ``keys1000``: 1,000 batch keys with two batches each, sent as two ``submit``s of a batch per
  key; the calls start once every key had its first turn (its first ``submit`` answered), so
  the worker is in the round of their second batches. Each quiet call is on a key of its own:
  a key that sends again within a second is not quiet, and waits for its turn like the busy
  keys (docs/usage.md); each priority-9 request goes on a busy key of its own too (a stream of
  priority-9 requests on one key, each sent before the last second is out, is a flood that
  priority ageing weighs against work that has waited: a round of 1,000 keys lasts 12 s here,
  more than the 9 s that 9 levels are worth by default).
- ``keys1000new``: outside the budget, to show the limit: 1,000 batch keys with ITEMS / 1,000
  items each (under a batch), sent just before the calls, so none had its first turn yet. They
  are all quiet keys, as the quiet key is, and it comes after the ones that came before it.

Per shape: the backlog alone (its items/s), then again with SAMPLES quiet-key dispatches and
SAMPLES priority-9 dispatches, one at a time, alternating; p50 and p99 of their latencies in
batch times, and the backlog's items/s with them over alone. Budget (issue 25): p99 <= 2 batch
times of waiting, backlog >= 0.9x alone. The figures include the request's own batch (1 batch
time), so the budget reads 3 here.

    python -m bench.fairness [--quick] [--only SHAPE ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

import queueserve as qs

from ._harness import RedisServer, percentile, spawn_module, stop_process, wait_until

PREFIX = "bfair"
BATCH_S = 0.01
BATCH_SIZE = 10
SHAPES = ["submit", "dispatch_many", "map", "packs16", "keys1000", "keys1000new"]
WAIT_S = 300.0


def _fixed_time(xs: list[Any]) -> list[Any]:
    time.sleep(BATCH_S)
    return xs


fair = qs.Serving(_fixed_time, name="bfair", batch_size=BATCH_SIZE, batch_timeout=0.005)


def _checked(shape: str, send: Callable[[list[int]], list[int]], items: int) -> None:
    if send(list(range(items))) != list(range(items)):
        raise AssertionError(f"{shape}: wrong answers")


def _packs(client: qs.Client, share: int) -> None:
    tickets = [client.submit("bfair", [i], batch_key="bulk") for i in range(share)]
    if [t.result(WAIT_S) for t in tickets] != [[i] for i in range(share)]:
        raise AssertionError("packs16: wrong answers")


def _many_keys(client: qs.Client, per_key: int, turned: threading.Event | None = None) -> None:
    """Sends ``per_key`` items on each of 1,000 keys; with ``turned``, as a second call of as
    many after the first, and sets it once the first calls were all answered."""
    sends = 2 if turned else 1
    tickets = [
        client.submit("bfair", list(range(per_key)), batch_key=f"k{k}")
        for _ in range(sends)
        for k in range(1000)
    ]
    for i, t in enumerate(tickets):
        if t.result(WAIT_S) != list(range(per_key)):
            raise AssertionError("keys1000: wrong answers")
        if turned and i == 999:
            turned.set()


def _bodies(
    shape: str, clients: list[qs.Client], items: int, turned: threading.Event
) -> list[Callable[[], None]]:
    """What each thread of the backlog of ``shape`` runs."""
    c = clients[0]
    if shape == "submit":
        send: Callable[[list[int]], list[int]] = lambda xs: c.submit(  # noqa: E731
            "bfair", xs, batch_key="bulk"
        ).result(WAIT_S)
    elif shape == "dispatch_many":
        send = lambda xs: c.dispatch_many("bfair", xs, batch_key="bulk")  # noqa: E731
    elif shape == "map":
        send = lambda xs: list(c.map("bfair", xs, batch_key="bulk"))  # noqa: E731
    elif shape == "packs16":
        return [functools.partial(_packs, client, items // len(clients)) for client in clients]
    elif shape == "keys1000":
        return [functools.partial(_many_keys, c, BATCH_SIZE, turned)]
    else:
        return [functools.partial(_many_keys, c, max(1, items // 1000))]
    return [functools.partial(_checked, shape, send, items)]


def _backlog(url: str, shape: str, items: int, turned: threading.Event) -> Callable[[], None]:
    """Starts the backlog of ``shape`` on threads; returns a function that waits until all of
    it was answered (and checks the answers). ``turned`` is set once the calls may start."""
    clients = [qs.Client(url, prefix=PREFIX) for _ in range(16 if shape == "packs16" else 1)]
    errors: list[BaseException] = []

    def guarded(body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as e:  # reported by the waiting thread
            errors.append(e)

    threads = [
        threading.Thread(target=guarded, args=(body,), daemon=True)
        for body in _bodies(shape, clients, items, turned)
    ]
    for t in threads:
        t.start()

    def wait() -> None:
        for t in threads:
            t.join(WAIT_S)
        for client in clients:
            client.close()
        if errors:
            raise RuntimeError(f"{shape}: the backlog failed") from errors[0]

    return wait


def one_shape(url: str, shape: str, items: int, samples: int) -> dict[str, float]:
    probe = qs.Client(url, prefix=PREFIX)
    if shape == "keys1000":
        items = 2000 * BATCH_SIZE
    many = shape.startswith("keys1000")
    try:
        t0 = time.perf_counter()
        _backlog(url, shape, items, threading.Event())()
        alone = items / (time.perf_counter() - t0)
        urgent_key = "k7" if many else "bulk"  # (keys1000: k7, k8, ..., one each, below)
        turned = threading.Event()
        t0 = time.perf_counter()
        wait = _backlog(url, shape, items, turned)
        if shape == "keys1000":
            turned.wait(WAIT_S)
        else:
            time.sleep(20 * BATCH_S)  # the backlog sent and running
        quiet: list[float] = []
        urgent: list[float] = []
        for i in range(samples):
            quiet_key, busy_key = (
                (f"quiet{i}", f"k{7 + i}") if shape == "keys1000" else ("quiet", urgent_key)
            )
            for key, priority, out in ((quiet_key, 0, quiet), (busy_key, 9, urgent)):
                sent = time.perf_counter()
                assert probe.dispatch("bfair", 7, batch_key=key, priority=priority) == 7
                out.append((time.perf_counter() - sent) / BATCH_S)
                time.sleep(2 * BATCH_S)
        wait()
        mixed = items / (time.perf_counter() - t0)
    finally:
        probe.close()
    quiet.sort()
    urgent.sort()
    row = {
        "quiet_p50": percentile(quiet, 50),
        "quiet_p99": percentile(quiet, 99),
        "p9_p50": percentile(urgent, 50),
        "p9_p99": percentile(urgent, 99),
        "backlog_ratio": mixed / alone,
    }
    print(
        f"| {shape} | {row['quiet_p50']:.2f} / {row['quiet_p99']:.2f} | "
        f"{row['p9_p50']:.2f} / {row['p9_p99']:.2f} | {row['backlog_ratio']:.2f} |",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 items, 10 samples")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--only", nargs="+", choices=SHAPES, default=SHAPES, help="these shapes")
    args = parser.parse_args(argv)
    items, samples = (2000, 10) if args.quick else (5000, 50)
    shapes = args.only
    results: dict[str, Any] = {"batch_s": BATCH_S, "items": items, "samples": samples}
    server = RedisServer().start()
    try:
        proc = spawn_module(
            "queueserve",
            "worker",
            "bench.fairness:fair",
            "--redis-url",
            server.url,
            "--prefix",
            PREFIX,
            "--log-level",
            "WARNING",
        )
        try:
            r = redis.Redis.from_url(server.url)
            wait_until(lambda: r.zcard(f"{PREFIX}:{{bfair}}:workers") > 0, 60, "the worker")
            r.close()
            print(f"backlog of {items:,} items on key 'bulk'; {samples} calls of each kind")
            print("| backlog | quiet key p50 / p99 | priority 9 p50 / p99 | backlog vs alone |")
            print("|---|---|---|---|")
            for shape in shapes:
                results[shape] = one_shape(server.url, shape, items, samples)
        finally:
            stop_process(proc)
    finally:
        server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

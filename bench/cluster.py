"""One serving on a local Redis Cluster (3 masters, 3 replicas): 1 shard against 3 shards.

    python -m bench.cluster [--items N] [--json out.json]
    python -m bench.cluster --failover [--durable]

For each shard count, a ``queueserve worker`` process serves the no-op serving and this
process sends, through one ``qs.Client``:

- ``single``: 8 threads over 4 clients (producers are many processes; each client's reply
  inbox lives on one slot, so one client would load one master with every reply), each
  thread submitting windows of 512 one-item tickets, then collecting them;
- ``packed``: one ``client.map(chunk_size=256, max_in_flight=8)`` per client, in threads, over
  10x as many items in all (Redis
  spends about 1 us per packed item: fewer would not move INFO cpu's counters reliably);
- ``durable``: the packed and the single-item runs again with ``durable=True`` (each enqueue
  waits for a replica: ``WAIT 1``), and a one-at-a-time round trip with and without it.

Each master's Redis CPU (INFO cpu: used_cpu_user + used_cpu_sys) is read before and after each
run, so the table shows Redis CPU per item on each master and how evenly the masters share it
(min/max of the masters' CPU). Everything runs on this machine's cores, so items/s measures
the Python ends far more than Redis; the per-item Redis CPU is what scales with nodes.

``--failover`` instead SIGKILLs the master of shard 1 of a 3-shard serving while 8 threads
send windows of 64 one-item requests (an in-process worker records what it executed), restarts
it once its replica is promoted, keeps sending 25 s, and reports answered / refused (the caller
got NotReplicated or RedisUnavailable) / lost (accepted, never answered: Timeout) / executed
twice, and how long the promotion took; ``--durable`` makes the serving durable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

import queueserve as qs
from queueserve.wire.protocol import key_slot, shard_tags
from tests.support.redis_topologies import Cluster, redis_cluster

from ._harness import spawn_module, stop_process


def _noop(xs: list[Any]) -> list[Any]:
    return xs


# Served by ``queueserve worker bench.cluster:<name>`` processes.
noop1 = qs.Serving(_noop, name="noop1", batch_size=256, batch_timeout=0, shards=1)
noop3 = qs.Serving(_noop, name="noop3", batch_size=256, batch_timeout=0, shards=3)
durable1 = qs.Serving(_noop, name="durable1", batch_size=256, batch_timeout=0, shards=1,
                      durable=True)
durable3 = qs.Serving(_noop, name="durable3", batch_size=256, batch_timeout=0, shards=3,
                      durable=True)
SERVINGS = {"noop1": noop1, "noop3": noop3, "durable1": durable1, "durable3": durable3}
THREADS, WINDOW, CLIENTS = 8, 512, 4


def master_cpu(cluster: Cluster) -> dict[int, float]:
    out = {}
    for node in cluster.masters:
        with redis.Redis(port=node.port) as r:
            cpu = r.info("cpu")
        out[node.port] = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return out


def single(clients: list[qs.Client], serving: qs.Serving, n: int) -> None:
    per = n // THREADS
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            for lo in range(i * per, (i + 1) * per, WINDOW):
                items = range(lo, min((i + 1) * per, lo + WINDOW))
                tickets = [clients[i % len(clients)].submit(serving, [x]) for x in items]
                if [t.result(120)[0] for t in tickets] != list(items):
                    raise AssertionError("wrong results")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def packed(clients: list[qs.Client], serving: qs.Serving, n: int) -> None:
    """One map per client, in threads, over n items in all."""
    got: list[int] = []

    def body(client: qs.Client) -> None:
        got.append(sum(1 for _ in client.map(serving, range(n // len(clients)), chunk_size=256,
                                              max_in_flight=8, timeout=120)))

    threads = [threading.Thread(target=body, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if sum(got) != n // len(clients) * len(clients):
        raise AssertionError(f"maps gave {sum(got)} results, wanted {n}")


def measure(cluster: Cluster, clients: list[qs.Client], serving: qs.Serving, path: str,
            n: int) -> dict[str, Any]:
    before = master_cpu(cluster)
    t0 = time.perf_counter()
    if path == "single":
        single(clients, serving, n)
    else:
        packed(clients, serving, n)
    took = time.perf_counter() - t0
    after = master_cpu(cluster)
    cpu = {port: after[port] - before[port] for port in after}
    return {
        "serving": serving.name, "path": path, "items": n, "items_per_s": n / took,
        "redis_cpu_us_per_item": 1e6 * sum(cpu.values()) / n,
        "per_master_us_per_item": [round(1e6 * c / n, 2) for c in cpu.values()],
        "spread_min_over_max": min(cpu.values()) / max(cpu.values()) if max(cpu.values()) else 0,
    }


def round_trip(client: qs.Client, serving: qs.Serving, n: int = 400) -> dict[str, float]:
    for i in range(50):
        client.dispatch(serving, i)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        client.dispatch(serving, i)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_ms": 1000 * statistics.median(times),
            "p99_ms": 1000 * times[int(0.99 * (len(times) - 1))]}


def run(n: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    trips: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, redis_cluster(Path(tmp)) as cluster:
        for name, serving in SERVINGS.items():
            prefix = f"bc{name}"
            worker = spawn_module("queueserve", "worker", f"bench.cluster:{name}",
                                  "--redis-url", cluster.url, "--prefix", prefix)
            try:
                clients = [qs.Client(cluster.url, prefix=prefix) for _ in range(CLIENTS)]
                with contextlib.ExitStack() as stack:
                    for c in clients:
                        stack.enter_context(c)
                    client = clients[0]
                    client.dispatch(serving, 1, timeout=60)  # waits for the worker to start
                    for path, items in (("packed", 10 * n), ("single", n)):
                        row = measure(cluster, clients, serving, path, items)
                        results.append(row)
                        print(_line(row), flush=True)
                    trips[name] = round_trip(client, serving)
                    print(f"{name:<9} round trip p50 {trips[name]['p50_ms']:.2f} ms, p99 "
                          f"{trips[name]['p99_ms']:.2f} ms", flush=True)
            finally:
                stop_process(worker)
    return {"runs": results, "round_trips": trips}


def _line(row: dict[str, Any]) -> str:
    return (f"{row['serving']:<9} {row['path']:<7} {row['items_per_s']:>9.0f} items/s  Redis "
            f"{row['redis_cpu_us_per_item']:.2f} us/item, per master "
            f"{row['per_master_us_per_item']}, min/max {row['spread_min_over_max']:.2f}")


def _send(url: str, serving: qs.Serving, outcomes: dict[int, str], stop: threading.Event,
          first: int) -> None:
    """Send windows of 64 one-item requests until ``stop``; record each one's outcome."""
    with qs.Client(url, prefix="bf") as client:
        n = first
        while not stop.is_set():
            tickets = [(m, client.submit(serving, [m], timeout=20))
                       for m in range(n, n + 64 * 8, 8)]
            for m, ticket in tickets:
                try:
                    outcomes[m] = "answered" if ticket.result()[0] == m + 1 else "wrong"
                except qs.Timeout:
                    outcomes[m] = "lost"  # accepted, never answered
                except (qs.NotReplicated, qs.RedisUnavailable):
                    outcomes[m] = "refused"  # the caller was told
            n += 64 * 8


def failover(durable: bool) -> dict[str, Any]:
    executed: Counter[int] = Counter()
    lock = threading.Lock()

    def record(xs: list[int]) -> list[int]:
        with lock:
            executed.update(xs)
        return [x + 1 for x in xs]

    serving = qs.Serving(record, name="failover", batch_size=64, batch_timeout=0.001, shards=3,
                         durable=durable)
    outcomes: dict[int, str] = {}
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp, redis_cluster(Path(tmp)) as cluster:
        worker = qs.Worker([serving], redis_url=cluster.url, prefix="bf",
                           handle_signals=False).start()
        threads = [threading.Thread(target=_send, args=(cluster.url, serving, outcomes, stop, i),
                                    daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        while len(outcomes) < 5000:
            time.sleep(0.05)
        slot = key_slot(shard_tags("failover", 3)[1])
        victim = cluster.node_of_slot(slot)
        killed = time.monotonic()
        victim.kill()
        while cluster.node_of_slot(slot).port == victim.port:
            time.sleep(0.05)
        promoted_s = time.monotonic() - killed
        victim.restart()
        time.sleep(25)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        worker.stop(timeout=10)
    counts = Counter(outcomes.values())
    out = {"durable": durable, **counts, "executed_twice": sum(1 for m in outcomes
                                                               if executed[m] > 1),
           "promoted_after_s": round(promoted_s, 1)}
    print(out, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=40_960)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--failover", action="store_true",
                        help="kill a master under load instead (see the module docstring)")
    parser.add_argument("--durable", action="store_true", help="with --failover")
    args = parser.parse_args(argv)
    out = failover(args.durable) if args.failover else run(args.items)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

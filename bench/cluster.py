"""One serving on a local Redis Cluster (3 masters, 3 replicas): 1 shard against 3 shards;
and failovers under load, on that cluster and behind Sentinel.

    python -m bench.cluster [--items N] [--servings noop3 ...] [--json out.json]
    python -m bench.cluster --failover [--repeat N] [--after S]
                            [--topology cluster takeover sentinel] [--durable both|yes|no]

For each serving, a ``queueserve worker`` process serves the no-op serving and this process
sends, through 12 ``qs.Client`` (``--clients``; producers are many processes, and each
client's reply inbox lives on one master: see CLIENTS below and docs/scaling.md):

- ``single``: one thread per client, each submitting windows of 512 one-item tickets, then
  collecting them;
- ``packed``: one ``client.map(chunk_size=256, max_in_flight=8)`` per client, in threads, over
  10x as many items in all (Redis spends about 1 us per packed item: fewer would not move
  INFO cpu's counters reliably);
- ``durable1``/``durable3``: the same with ``durable=True`` (each enqueue waits for a replica:
  ``WAIT 1``), and a one-at-a-time round trip for each serving.

Each master's Redis CPU (INFO cpu: used_cpu_user + used_cpu_sys) is read before and after each
run, less what it spends idle (measured first, over 2 s), so the table shows Redis CPU per item
on each master and the spread: min/max of the masters' CPU, "within 20%" when it is >= 0.8 (the
goal of issue 15 for a 3-shard serving). Everything runs on this machine's cores, so items/s
measures the Python ends far more than Redis; the per-item Redis CPU is what scales with nodes.

``--failover`` runs, for each topology and mode, a 3-shard serving on the cluster (1 shard
behind Sentinel) with an in-process worker that records what it executed, 8 threads sending
windows of 64 one-item requests; after 3000 answers it measures how far the replicas trail the
master to be failed (bytes not yet processed, and as time at the write rate), then fails it:
on the cluster the master of shard 1 is SIGKILLed and restarted once its replica is promoted;
with ``takeover`` its replica is promoted by ``CLUSTER FAILOVER TAKEOVER`` while the master
runs on (as when it is cut off from the others: it takes writes until it learns of the new
epoch); behind Sentinel, ``SENTINEL FAILOVER``. It keeps sending ``--after`` seconds and reports per
run: sent, answered, refused (the caller got NotReplicated or RedisUnavailable: it knows),
lost (accepted and never answered within 30 s: qs.Timeout), executed twice, the promotion
time, the longest gap between two answers, and when the lost requests were sent relative to
the failure (the measured window of loss).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
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
from queueserve.wire.shards import key_slot, shard_tags
from tests.support.redis_topologies import Cluster, redis_cluster, sentinel_set

from ._harness import spawn_module, stop_process


def _noop(xs: list[Any]) -> list[Any]:
    return xs


# Served by ``queueserve worker bench.cluster:<name>`` processes.
noop1 = qs.Serving(_noop, name="noop1", batch_size=256, batch_timeout=0, shards=1)
noop3 = qs.Serving(_noop, name="noop3", batch_size=256, batch_timeout=0, shards=3)
durable1 = qs.Serving(
    _noop, name="durable1", batch_size=256, batch_timeout=0, shards=1, durable=True
)
durable3 = qs.Serving(
    _noop, name="durable3", batch_size=256, batch_timeout=0, shards=3, durable=True
)
SERVINGS = {"noop1": noop1, "noop3": noop3, "durable1": durable1, "durable3": durable3}
WINDOW = 512
# Producers: each client's reply inbox lands on one master, as its random id hashes. A real
# deployment has many producer processes, so the reply traffic evens out over the masters;
# with 4 clients, 1 run in 3 put 3 inboxes on one master, which then did a third more work on
# the packed path (large replies). 12 clients stand for "many"; --clients to change it.
CLIENTS = 12


def master_cpu(cluster: Cluster) -> dict[int, float]:
    out = {}
    for node in cluster.masters:
        with redis.Redis(port=node.port) as r:
            cpu = r.info("cpu")
        out[node.port] = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return out


def single(clients: list[qs.Client], serving: qs.Serving, n: int) -> None:
    threads_n = len(clients)  # one sending thread per client
    per = n // threads_n
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

    threads = [threading.Thread(target=body, args=(i,)) for i in range(threads_n)]
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
        got.append(
            sum(
                1
                for _ in client.map(
                    serving, range(n // len(clients)), chunk_size=256, max_in_flight=8, timeout=120
                )
            )
        )

    threads = [threading.Thread(target=body, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if sum(got) != n // len(clients) * len(clients):
        raise AssertionError(f"maps gave {sum(got)} results, wanted {n}")


SPREAD_GOAL = 0.8  # issue 15: the masters' Redis CPU within 20% of each other


def idle_cpu(cluster: Cluster, seconds: float = 2.0) -> dict[int, float]:
    """Each master's Redis CPU per second with nothing to do (its cron, the cluster bus,
    replication pings), subtracted from the runs: it is alike on every master, so left in it
    would make any spread look more even."""
    before = master_cpu(cluster)
    time.sleep(seconds)
    after = master_cpu(cluster)
    return {port: (after[port] - before[port]) / seconds for port in after}


def spread(cpu: dict[int, float]) -> float:
    """min/max of the masters' Redis CPU: 1.0 is perfectly even; >= 0.8 is within 20%."""
    return min(cpu.values()) / max(cpu.values()) if max(cpu.values()) > 0 else 0.0


def measure(
    cluster: Cluster,
    clients: list[qs.Client],
    serving: qs.Serving,
    path: str,
    n: int,
    idle: dict[int, float],
) -> dict[str, Any]:
    before = master_cpu(cluster)
    t0 = time.perf_counter()
    if path == "single":
        single(clients, serving, n)
    else:
        packed(clients, serving, n)
    took = time.perf_counter() - t0
    after = master_cpu(cluster)
    cpu = {port: max(0.0, after[port] - before[port] - idle[port] * took) for port in after}
    even = spread(cpu)
    return {
        "serving": serving.name,
        "shards": serving.shards,
        "path": path,
        "items": n,
        "items_per_s": n / took,
        "redis_cpu_us_per_item": 1e6 * sum(cpu.values()) / n,
        "per_master_us_per_item": [round(1e6 * c / n, 2) for c in cpu.values()],
        "spread_min_over_max": round(even, 2),
        "within_20pct": even >= SPREAD_GOAL,
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
    return {
        "p50_ms": 1000 * statistics.median(times),
        "p99_ms": 1000 * times[int(0.99 * (len(times) - 1))],
    }


def run(n: int, names: list[str], clients_n: int = CLIENTS) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    trips: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, redis_cluster(Path(tmp)) as cluster:
        idle = idle_cpu(cluster)
        print(
            "idle Redis CPU per master (ms/s):",
            {port: round(1000 * v, 2) for port, v in idle.items()},
            flush=True,
        )
        for name in names:
            serving = SERVINGS[name]
            prefix = f"bc{name}"
            worker = spawn_module(
                "queueserve",
                "worker",
                f"bench.cluster:{name}",
                "--redis-url",
                cluster.url,
                "--prefix",
                prefix,
            )
            try:
                clients = [qs.Client(cluster.url, prefix=prefix) for _ in range(clients_n)]
                inboxes = Counter(
                    cluster.node_of_slot(key_slot(c._core.inbox)).port for c in clients
                )
                print(f"{name}: client inboxes per master {dict(inboxes)}", flush=True)
                with contextlib.ExitStack() as stack:
                    for c in clients:
                        stack.enter_context(c)
                    client = clients[0]
                    client.dispatch(serving, 1, timeout=60)  # waits for the worker to start
                    for path, items in (("packed", 10 * n), ("single", n)):
                        row = measure(cluster, clients, serving, path, items, idle)
                        results.append(row)
                        print(_line(row), flush=True)
                    trips[name] = round_trip(client, serving)
                    print(
                        f"{name:<9} round trip p50 {trips[name]['p50_ms']:.2f} ms, p99 "
                        f"{trips[name]['p99_ms']:.2f} ms",
                        flush=True,
                    )
            finally:
                stop_process(worker)
    sharded = [r for r in results if r["shards"] == len(cluster.masters)]
    if sharded:
        print(
            "spread over the masters with one shard per master: "
            + ", ".join(
                f"{r['serving']} {r['path']} {r['spread_min_over_max']:.2f} "
                f"({'within' if r['within_20pct'] else 'NOT within'} 20%)"
                for r in sharded
            )
        )
    return {"runs": results, "round_trips": trips}


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['serving']:<9} {row['path']:<7} {row['items_per_s']:>9.0f} items/s  Redis "
        f"{row['redis_cpu_us_per_item']:.2f} us/item, per master "
        f"{row['per_master_us_per_item']}, spread (min/max) {row['spread_min_over_max']:.2f}"
        f"{'' if row['within_20pct'] else ' (not within 20%)'}"
    )


def _send(
    url: str,
    serving: qs.Serving,
    log: dict[int, tuple[float, str]],
    stop: threading.Event,
    first: int,
    step: int,
) -> None:
    """Send windows of 64 one-item requests until ``stop``; record each one's send time and
    outcome."""
    with qs.Client(url, prefix="bf") as client:
        n = first
        while not stop.is_set():
            tickets = [
                (m, time.monotonic(), client.submit(serving, [m], timeout=FAILOVER_TIMEOUT))
                for m in range(n, n + 64 * step, step)
            ]
            for m, sent, ticket in tickets:
                try:
                    kind = "answered" if ticket.result()[0] == m + 1 else "wrong"
                except qs.Timeout:
                    kind = "lost"  # accepted, never answered
                except (qs.NotReplicated, qs.RedisUnavailable):
                    kind = "refused"  # the caller was told
                log[m] = (sent, kind)
                if kind == "answered":
                    ANSWERED_AT.append(time.monotonic())
            n += 64 * step


FAILOVER_TIMEOUT = 30.0
SENDERS = 8
ANSWERED_AT: list[float] = []


def _replication(port: int) -> tuple[int, int]:
    """(the master's replication offset, how many bytes of it its slowest replica has not
    processed yet). Asked of each replica itself, after the master: the offsets a master
    shows for its replicas are their acknowledgements, sent once a second (or on WAIT), and
    would show a second of writes as lag."""
    with redis.Redis(port=port) as r:
        info = r.info("replication")
    offset = int(info["master_repl_offset"])
    processed = []
    for key, value in info.items():
        if key.startswith("slave") and isinstance(value, dict):
            with redis.Redis(port=int(value["port"])) as replica:
                processed.append(int(replica.info("replication")["slave_repl_offset"]))
    return offset, max(0, offset - min(processed, default=offset))


def replica_lag(port: int, seconds: float = 1.0) -> dict[str, float]:
    """How far the replicas of the master on ``port`` trail it under the load running now:
    bytes not yet processed by the slowest replica, sampled every 10 ms for ``seconds``, and
    the master's write rate; their ratio is the window of writes a failover at that moment
    would lose without durable, in time."""
    samples = []
    first, _ = _replication(port)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        samples.append(_replication(port)[1])
        time.sleep(0.01)
    last, _ = _replication(port)
    rate = (last - first) / (time.monotonic() - t0)
    samples.sort()
    return {
        "write_kb_s": round(rate / 1000, 1),
        "behind_bytes_p50": samples[len(samples) // 2],
        "behind_bytes_max": samples[-1],
        "window_ms_max": round(1000 * samples[-1] / rate, 2) if rate else 0.0,
    }


def _victim_port(kind: str, topology: Any, name: str) -> int:
    if kind == "sentinel":
        return int(topology.current_master_port())
    return int(topology.node_of_slot(key_slot(shard_tags(name, 3)[1])).port)


def _trigger(kind: str, topology: Any, name: str) -> tuple[float, float]:
    """Fail the master of shard 1 (cluster: SIGKILL, then restart it once its replica took
    over) or the Sentinel master (SENTINEL FAILOVER). Returns (when, seconds to promotion)."""
    if kind == "sentinel":
        at = time.monotonic()
        topology.failover()
        return at, time.monotonic() - at
    slot = key_slot(shard_tags(name, 3)[1])
    victim = topology.node_of_slot(slot)
    at = time.monotonic()
    if kind == "takeover":
        # The replica takes the slots without the master's agreement (what an operator does
        # when the master is cut off): the old master keeps taking writes from the clients
        # connected to it until it learns of the new epoch, then turns replica and drops them.
        with redis.Redis(port=_replica_port(victim.port)) as replica:
            replica.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
    else:
        victim.kill()
    while topology.node_of_slot(slot).port == victim.port:
        time.sleep(0.01)
    promoted = time.monotonic() - at
    if kind != "takeover":
        victim.restart()
    return at, promoted


def _replica_port(port: int) -> int:
    with redis.Redis(port=port) as r:
        return int(r.info("replication")["slave0"]["port"])


def failover(kind: str, durable: bool, after_s: float = 10.0) -> dict[str, Any]:
    """Fail a master under load (``kind``: "cluster" or "sentinel"); what became of every
    request sent, and when the lost ones were sent relative to the failure."""
    executed: Counter[int] = Counter()
    lock = threading.Lock()

    def record(xs: list[int]) -> list[int]:
        with lock:
            executed.update(xs)
        return [x + 1 for x in xs]

    shards = 1 if kind == "sentinel" else 3
    serving = qs.Serving(
        record, name="failover", batch_size=64, batch_timeout=0.001, shards=shards, durable=durable
    )
    log: dict[int, tuple[float, str]] = {}
    ANSWERED_AT.clear()
    stop = threading.Event()
    with (
        tempfile.TemporaryDirectory() as tmp,
        sentinel_set(Path(tmp)) if kind == "sentinel" else redis_cluster(Path(tmp)) as topology,
    ):
        worker = qs.Worker(
            [serving], redis_url=topology.url, prefix="bf", handle_signals=False
        ).start()
        threads = [
            threading.Thread(
                target=_send, args=(topology.url, serving, log, stop, i, SENDERS), daemon=True
            )
            for i in range(SENDERS)
        ]
        for t in threads:
            t.start()
        while len(log) < 3000:
            time.sleep(0.05)
        lag = replica_lag(_victim_port(kind, topology, serving.name))
        at, promoted_s = _trigger(kind, topology, serving.name)
        time.sleep(after_s)
        stop.set()
        for t in threads:
            t.join(timeout=FAILOVER_TIMEOUT + 30)
        worker.stop(timeout=10)
    counts = Counter(kind_ for _, kind_ in log.values())
    lost_at = sorted(1000 * (sent - at) for sent, kind_ in log.values() if kind_ == "lost")
    around = sorted(t for t in ANSWERED_AT if t > at - 1)
    stalled = max((b - a for a, b in itertools.pairwise(around)), default=0.0)
    out = {
        "topology": kind,
        "durable": durable,
        "sent": len(log),
        "answered": counts["answered"],
        "refused": counts["refused"],
        "lost": counts["lost"],
        "wrong": counts["wrong"],
        "executed_twice": sum(1 for m in log if executed[m] > 1),
        "promoted_after_s": round(promoted_s, 2),
        "answers_stalled_s": round(stalled, 2),
        "lost_sent_ms_from_failure": [round(lost_at[0]), round(lost_at[-1])] if lost_at else [],
        "lost_but_executed": sum(1 for m, (_, k) in log.items() if k == "lost" and executed[m]),
        "replica_lag_before": lag,
    }
    print(json.dumps(out), flush=True)
    return out


def failovers(
    repeat: int, after_s: float, kinds: list[str], modes: list[bool]
) -> list[dict[str, Any]]:
    rows = [
        failover(kind, durable, after_s)
        for _ in range(repeat)
        for kind in kinds
        for durable in modes
    ]
    print(
        "\ntopology  durable    sent  answered  refused  lost  twice  promoted  stalled  "
        "replica lag max (bytes, ms)  lost sent at (ms from failure)"
    )
    for r in rows:
        lag = r["replica_lag_before"]
        print(
            f"{r['topology']:<9} {r['durable']!s:<7} {r['sent']:>7} {r['answered']:>9} "
            f"{r['refused']:>8} {r['lost']:>5} {r['executed_twice']:>6} "
            f"{r['promoted_after_s']:>7}s {r['answers_stalled_s']:>7}s  "
            f"{lag['behind_bytes_max']:>8} B {lag['window_ms_max']:>6} ms        "
            f"{r['lost_sent_ms_from_failure'] or '-'}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=40_960)
    parser.add_argument(
        "--clients", type=int, default=CLIENTS, help="producer clients (one sending thread each)"
    )
    parser.add_argument(
        "--servings",
        nargs="+",
        choices=sorted(SERVINGS),
        default=list(SERVINGS),
        help="which servings to run (default: all)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--failover",
        action="store_true",
        help="fail a master under load instead (see the module docstring)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="with --failover: rounds")
    parser.add_argument(
        "--topology",
        nargs="+",
        choices=["cluster", "takeover", "sentinel"],
        default=["cluster", "sentinel"],
        help="with --failover: cluster (master SIGKILLed), takeover (CLUSTER "
        "FAILOVER TAKEOVER on its replica, the master left running), "
        "sentinel (SENTINEL FAILOVER)",
    )
    parser.add_argument(
        "--durable",
        choices=["both", "yes", "no"],
        default="both",
        help="with --failover: with durable=True, without, or both",
    )
    parser.add_argument(
        "--after",
        type=float,
        default=10.0,
        help="with --failover: seconds of sending after the failure",
    )
    args = parser.parse_args(argv)
    modes = {"both": [False, True], "yes": [True], "no": [False]}[args.durable]
    out: Any = (
        failovers(args.repeat, args.after, args.topology, modes)
        if args.failover
        else run(args.items, args.servings, args.clients)
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The HTTP gateway against the direct ``AsyncClient``, in one run (docs/gateway.md).

    python -m bench.gateway [--quick] [--json out.json] [--embed]

One private ``redis-server``, one ``queueserve worker bench.servings:noop`` process (with its
metrics port) and one ``queueserve gateway`` process. In this process:

1. ``round trip``: one request at a time against the idle worker, alternating blocks of calls:
   ``AsyncClient.dispatch`` (direct), a POST to ``/v1/servings/noop/dispatch`` on a keep-alive
   connection by a minimal HTTP/1.1 client (``http``: what a Go or Java client costs, next to
   nothing), and the same POST through ``httpx`` (``httpx``: a Python client's own cost
   included). p50 and p99 of each; the budget is http p50 <= direct p50 + 1 ms.
2. ``throughput``: 64 concurrent callers sending one item at a time for a while, each on its own
   keep-alive connection (``http-64``), against 64 coroutines on one ``AsyncClient``
   (``direct-64``); items/s, and the mean batch size the worker ran in each phase (its
   ``queueserve_batch_size`` histogram). The budget is http-64 >= 0.5x direct-64.
3. ``same load``: one item per request at the same offered load both ways (open loop, Poisson
   arrivals at half of http-64's rate, so either path keeps up), over HTTP connections from a
   pool and through ``AsyncClient.dispatch``: the mean batch the worker ran each way. HTTP
   traffic should make batches as large as direct traffic does.
4. ``--embed``: the same with one text per request, ``POST /v1/embeddings`` against
   ``AsyncClient.dispatch`` to the MiniLM serving (tasks/embed.py) in the same worker.

Callers, gateway, worker and Redis share the machine's cores: on 2 cores the callers' CPU
is taken from the gateway's and the worker's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

import queueserve as qs
from bench._harness import (
    RedisServer,
    cpu_times,
    free_port,
    percentile,
    process_tree,
    spawn_module,
    stop_process,
)
from bench._harness import wait_until as wait_for

PREFIX = "benchgw"
CALLERS = 64
CPU_OF = ("gateway", "callers", "worker", "redis")


class RawHttp(asyncio.Protocol):
    """A keep-alive HTTP/1.1 client of a few lines, the load generator: one request at a time
    written in one send, the response taken by its Content-Length as it arrives (the gateway
    answers every dispatch with a length, no chunking).

    A plain asyncio protocol, neither ``asyncio.open_connection``'s streams nor httpx: on a
    small host the callers share the cores with the gateway, so what the generator costs is
    taken from what is measured, and HTTP clients usually run on other machines. Against the
    same gateway, side by side on the loaded 2-core host, streams took 64 us of CPU per
    request and this 53 (0.77x; docs/benchmarks.md). The ``httpx`` round trip shows what a
    full Python client adds."""

    def __init__(self, port: int, path: str) -> None:
        self.port = port
        self.head = (
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            "content-type: application/json\r\ncontent-length: "
        ).encode()
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.answer: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._answer(ConnectionError(f"the gateway closed the connection ({exc})"))

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer = self.buffer + data if self.buffer else data
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = buffer[:end].lower()
        if not head.startswith(b"http/1.1 200"):
            self._answer(RuntimeError(f"the gateway answered {buffer[:200]!r}"))
            return
        at = head.index(b"content-length:") + 15
        line_end = head.find(b"\r\n", at)
        length = int(head[at : line_end if line_end >= 0 else len(head)])
        if len(buffer) - end - 4 >= length:
            self.buffer = buffer[end + 4 + length :]
            self._answer(buffer[end + 4 : end + 4 + length])

    def _answer(self, outcome: bytes | Exception) -> None:
        answer, self.answer = self.answer, None
        if answer is None or answer.done():
            return
        if isinstance(outcome, Exception):
            answer.set_exception(outcome)
        else:
            answer.set_result(outcome)

    async def post(self, body: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        if self.transport is None:
            await loop.create_connection(lambda: self, "127.0.0.1", self.port)
        assert self.transport is not None
        self.answer = answer = loop.create_future()
        self.transport.write(self.head + str(len(body)).encode() + b"\r\n\r\n" + body)
        return await answer

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def batch_totals(metrics_port: int) -> tuple[float, float]:
    """(items, batches) the worker ran so far, from its batch size histogram."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    total = count = 0.0
    for line in text.decode().splitlines():
        if line.startswith("queueserve_batch_size_sum{"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("queueserve_batch_size_count{"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def round_trips(
    calls: dict[str, Callable[[int], Awaitable[Any]]], n: int, block: int
) -> dict[str, list[float]]:
    """Seconds of each call, one at a time, in alternating blocks (after a warm-up)."""
    for call in calls.values():
        for i in range(block):
            await call(i)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for start in range(0, n, block):
        for name, call in calls.items():
            for i in range(start, start + block):
                began = time.perf_counter()
                await call(i)
                times[name].append(time.perf_counter() - began)
    return times


async def rate(send: Callable[[int, int], Awaitable[Any]], seconds: float) -> tuple[float, int]:
    """(items/s, items) of CALLERS concurrent callers, each sending one item after another."""
    stop = time.perf_counter() + seconds
    done = [0] * CALLERS

    async def caller(c: int) -> None:
        i = 0
        while time.perf_counter() < stop:
            await send(c, i)
            i += 1
        done[c] = i

    began = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in range(CALLERS)))
    return sum(done) / (time.perf_counter() - began), sum(done)


async def offered(send: Callable[[int], Awaitable[Any]], per_s: float, seconds: float) -> int:
    """Sends at Poisson arrivals of ``per_s`` a second for ``seconds``, each without waiting
    for those before (open loop), from one seeded schedule; returns how many it sent."""
    arrivals = random.Random(25)
    sends: list[asyncio.Future[Any]] = []
    at = time.perf_counter()
    end = at + seconds
    while at < end:
        at += arrivals.expovariate(per_s)
        if (delay := at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        sends.append(asyncio.ensure_future(send(len(sends))))
    await asyncio.gather(*sends)
    return len(sends)


def cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children (the worker's partition process; this
    process, the callers', has the others as children: counted alone)."""
    tree = [pid] if pid == os.getpid() else process_tree(pid)
    return sum(sum(cpu_times(p)) for p in tree)


async def measure(
    redis_url: str,
    gateway_port: int,
    metrics_port: int,
    pids: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with qs.AsyncClient(redis_url, prefix=PREFIX) as client:
        await round_trip_phase(client, gateway_port, args, out)
        await load_phases(client, gateway_port, metrics_port, pids, args, out)
        await same_load_phases(client, gateway_port, metrics_port, args, out)
        if args.embed:
            await embed_phases(client, gateway_port, args, out)
    return out


async def round_trip_phase(
    client: qs.AsyncClient, gateway_port: int, args: argparse.Namespace, out: dict[str, Any]
) -> None:
    raw = RawHttp(gateway_port, "/v1/servings/noop/dispatch")

    async def direct(i: int) -> Any:
        return await client.dispatch("noop", i)

    async def http(i: int) -> Any:
        return await raw.post(b'{"item": %d}' % i)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway_port}") as hx:

        async def via_httpx(i: int) -> Any:
            return (await hx.post("/v1/servings/noop/dispatch", json={"item": i})).json()

        assert json.loads(await http(7)) == {"result": 7}
        times = await round_trips(
            {"direct": direct, "http": http, "httpx": via_httpx}, args.calls, 250
        )
    raw.close()
    for name, seconds in times.items():
        s = sorted(seconds)
        out[f"rt_{name}_p50_ms"] = percentile(s, 50) * 1000
        out[f"rt_{name}_p99_ms"] = percentile(s, 99) * 1000


async def load_phases(
    client: qs.AsyncClient,
    gateway_port: int,
    metrics_port: int,
    pids: dict[str, int],
    args: argparse.Namespace,
    out: dict[str, Any],
) -> None:
    """Items/s, mean batch, and CPU per item of each process: the gateway's, the callers'
    (this one), and the worker's and Redis's (the same work in both phases)."""
    conns: list[RawHttp] = []

    async def one_http(c: int, i: int) -> Any:
        return await conns[c].post(b'{"item": %d}' % i)

    async def one_direct(c: int, i: int) -> Any:
        return await client.dispatch("noop", i)

    for name, send in (("direct_64", one_direct), ("http_64", one_http)) * args.repeat:
        for conn in conns:  # new connections for each phase: the old ones sat idle
            conn.close()
        conns[:] = [RawHttp(gateway_port, "/v1/servings/noop/dispatch") for _ in range(CALLERS)]
        before = batch_totals(metrics_port)
        cpu_before = {who: cpu_s(pid) for who, pid in pids.items()}
        items_s, items = await rate(send, args.seconds)
        after = batch_totals(metrics_port)
        for who, pid in pids.items():
            out.setdefault(f"{name}_{who}_cpu_us", []).append(
                (cpu_s(pid) - cpu_before[who]) / items * 1e6
            )
        out.setdefault(f"{name}_items_s", []).append(items_s)
        out.setdefault(f"{name}_mean_batch", []).append(
            (after[0] - before[0]) / max(1.0, after[1] - before[1])
        )
    for conn in conns:
        conn.close()


async def same_load_phases(
    client: qs.AsyncClient,
    gateway_port: int,
    metrics_port: int,
    args: argparse.Namespace,
    out: dict[str, Any],
) -> None:
    """The mean batch at one offered load, half of what 64 HTTP callers reached, sent over
    HTTP and directly (batches form from what arrives while the worker runs one)."""
    per_s = statistics.median(out["http_64_items_s"]) / 2
    out["same_load_per_s"] = per_s
    pool: asyncio.Queue[RawHttp] = asyncio.Queue()
    for _ in range(CALLERS):
        pool.put_nowait(RawHttp(gateway_port, "/v1/servings/noop/dispatch"))

    async def http(i: int) -> Any:
        conn = await pool.get()
        try:
            return await conn.post(b'{"item": %d}' % i)
        finally:
            pool.put_nowait(conn)

    async def direct(i: int) -> Any:
        return await client.dispatch("noop", i)

    for name, send in (("same_direct", direct), ("same_http", http)) * args.repeat:
        before = batch_totals(metrics_port)
        await offered(send, per_s, args.seconds)
        after = batch_totals(metrics_port)
        out.setdefault(f"{name}_mean_batch", []).append(
            (after[0] - before[0]) / max(1.0, after[1] - before[1])
        )
    while not pool.empty():
        pool.get_nowait().close()


async def embed_phases(
    client: qs.AsyncClient, gateway_port: int, args: argparse.Namespace, out: dict[str, Any]
) -> None:
    """POST /v1/embeddings, one text per request from 64 callers, against 64 coroutines
    dispatching the same texts to the MiniLM serving directly."""
    conns = [RawHttp(gateway_port, "/v1/embeddings") for _ in range(CALLERS)]

    async def http(c: int, i: int) -> Any:
        return await conns[c].post(b'{"model": "embed", "input": "a text to embed, number %d"}' % i)

    async def direct(c: int, i: int) -> Any:
        return await client.dispatch("embed", f"a text to embed, number {i}")

    await direct(0, 0)  # the model has loaded
    for name, send in (("embed_direct_64", direct), ("embed_http_64", http)) * args.repeat:
        out.setdefault(f"{name}_items_s", []).append((await rate(send, args.seconds))[0])
    for conn in conns:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, shorter runs")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument(
        "--embed",
        action="store_true",
        help="also /v1/embeddings against the MiniLM serving called directly",
    )
    args = parser.parse_args()
    args.calls = 1000 if args.quick else 4000
    args.seconds = 2.0 if args.quick else 5.0
    args.repeat = 1 if args.quick else 3
    redis_server = RedisServer().start()
    gateway_port, metrics_port = free_port(), free_port()
    servings = ["bench.servings:noop", *(["tasks.embed:embed"] if args.embed else [])]
    worker = spawn_module(
        "queueserve",
        "worker",
        *servings,
        "--redis-url",
        redis_server.url,
        "--prefix",
        PREFIX,
        "--partitions",
        "1",
        "--metrics-port",
        str(metrics_port),
        "--log-level",
        "WARNING",
    )
    gateway = spawn_module(
        "queueserve",
        "gateway",
        "--port",
        str(gateway_port),
        "--redis-url",
        redis_server.url,
        "--prefix",
        PREFIX,
        "--log-level",
        "warning",
    )
    try:
        wait_for(lambda: _answers(gateway_port), 60, "the gateway and the worker")
        pids = {
            "gateway": gateway.pid,
            "callers": os.getpid(),
            "worker": worker.pid,
            "redis": redis_server.proc.pid,  # type: ignore[union-attr]
        }
        figures = asyncio.run(measure(redis_server.url, gateway_port, metrics_port, pids, args))
    finally:
        stop_process(gateway)
        stop_process(worker)
        redis_server.stop()
    report(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def _answers(port: int) -> bool:
    try:
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/servings/noop/dispatch", json={"item": 1}, timeout=5
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def report(f: dict[str, Any]) -> None:
    print("round trip, one call at a time (ms)     p50      p99")
    for name in ("direct", "http", "httpx"):
        print(f"  {name:<36} {f[f'rt_{name}_p50_ms']:7.3f}  {f[f'rt_{name}_p99_ms']:7.3f}")
    over = f["rt_http_p50_ms"] - f["rt_direct_p50_ms"]
    print(f"  http p50 over direct: {over:+.3f} ms (budget <= +1 ms)")
    print(
        f"{CALLERS} concurrent callers, one item each: items/s (median), mean batch, CPU us "
        "per item of the gateway, the callers' process, the worker and Redis"
    )
    for name in ("direct_64", "http_64"):
        rates = f[f"{name}_items_s"]
        med = {
            k: statistics.median(f[f"{name}_{k}"])
            for k in ("mean_batch", *(f"{who}_cpu_us" for who in CPU_OF))
        }
        cpu = "  ".join(f"{who} {med[f'{who}_cpu_us']:5.1f}" for who in CPU_OF)
        print(
            f"  {name:<10} {statistics.median(rates):9.0f}/s  batch {med['mean_batch']:5.1f}  "
            f"{cpu}  runs {[round(r) for r in rates]}"
        )
    ratio = statistics.median(f["http_64_items_s"]) / statistics.median(f["direct_64_items_s"])
    print(f"  http-64 / direct-64: {ratio:.2f}x (budget >= 0.5x)")
    direct, http = (statistics.median(f[f"same_{k}_mean_batch"]) for k in ("direct", "http"))
    print(
        f"the same offered load, {f['same_load_per_s']:.0f} items/s (open loop): mean batch "
        f"direct {direct:.1f}, http {http:.1f} ({http / direct:.2f}x; runs direct "
        f"{[round(b, 1) for b in f['same_direct_mean_batch']]}, http "
        f"{[round(b, 1) for b in f['same_http_mean_batch']]})"
    )
    if "embed_http_64_items_s" in f:
        direct, http = (statistics.median(f[f"embed_{k}_64_items_s"]) for k in ("direct", "http"))
        print(
            f"MiniLM, 64 callers, one text each: direct {direct:.0f}/s, /v1/embeddings "
            f"{http:.0f}/s ({http / direct:.2f}x)"
        )


if __name__ == "__main__":
    sys.exit(main())

"""Slowloris against the gateway: half-open connections from one host, authenticated requests
from another (issue 38, finding 1; docs/gateway.md, "Connections").

    python -m bench.slowloris [--connections 2000 20000] [--seconds 20] [--json out.json]

One private ``redis-server``, one ``queueserve worker bench.servings:noop`` and one ``queueserve
gateway --token`` with its default connection options. For each N of ``--connections``: a flood
process keeps N connections open from 127.0.0.1, each having sent part of a request head and
nothing more, and opens again every one the gateway closes (``flood``); meanwhile this process
sends authenticated ``POST /v1/servings/noop/dispatch`` requests from 127.0.0.2 at a steady
rate on kept-alive connections (``measure``), and reports the fraction answered within 1 s and
the p99. Targets: with 2,000 half-open, 99% answered within 1 s; with 20,000 attempted, the
gateway still answers.

``slowloris(url, token=...)`` is the same as a coroutine, against a gateway already running
(bench/tenants.py runs it beside a tenant flood); ``flood`` and ``measure`` are its halves. No
state outside the call: each call starts its own flood process and HTTP clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx

from bench._harness import RedisServer, free_port, percentile, spawn_module, stop_process
from bench._harness import wait_until as wait_for

PREFIX = "benchloris"
TOKEN = "bench-slowloris"
HEAD = b"POST /v1/servings/noop/dispatch HTTP/1.1\r\nhost: gw\r\nx-slowloris: "
ANSWERED_S = 1.0  # what "answered" means here


@dataclass
class FloodCounts:
    """What a flood did: connections it held at the end and at most, how many times it
    opened one (``attempted``: every try, first or again), how many the server closed,
    and how many it could not open at all."""

    held: int = 0
    peak: int = 0
    attempted: int = 0
    closed_by_server: int = 0
    failed_opens: int = 0


@dataclass
class Report:
    """One slowloris run: the flood's counts and the requests of the other address."""

    half_open: int
    flood: FloodCounts
    requests: int = 0
    answered_within_1s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        f = self.flood
        return (
            f"{self.half_open:>6} half-open wanted: held {f.held} (peak {f.peak}), "
            f"{f.attempted} opens attempted, {f.closed_by_server} closed by the gateway, "
            f"{f.failed_opens} failed to open; other address: {self.requests} requests, "
            f"{self.answered_within_1s:.1%} answered within 1 s, p50 {self.p50_ms:.1f} ms, "
            f"p99 {self.p99_ms:.1f} ms, max {self.max_ms:.1f} ms, errors {self.errors}"
        )


# --- the flood (its own process: its sockets and CPU are not the measuring side's) ------
async def flood(
    host: str, port: int, connections: int, source: str, seconds: float, counts: FloodCounts
) -> None:
    """Keeps ``connections`` half-open connections to ``host:port`` from ``source`` for
    ``seconds``, opening again each one the server closes; ``counts`` as it goes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    opening = asyncio.Semaphore(256)  # connects in flight at once

    async def one() -> None:
        while loop.time() < deadline:
            async with opening:
                counts.attempted += 1
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(host, port, local_addr=(source, 0)), 10
                    )
                    writer.write(HEAD)
                except (TimeoutError, OSError):
                    counts.failed_opens += 1
                    await asyncio.sleep(0.5)
                    continue
            counts.held += 1
            counts.peak = max(counts.peak, counts.held)
            try:
                await asyncio.wait_for(reader.read(), max(0.0, deadline - loop.time()))
                counts.closed_by_server += 1  # read to its end: the server closed it
            except OSError:  # reset: closed too
                counts.closed_by_server += 1
            except TimeoutError:  # held to the end
                pass
            finally:
                counts.held -= 1
                writer.transport.abort()

    await asyncio.gather(*(one() for _ in range(connections)))


def flood_main(args: argparse.Namespace) -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    counts = FloodCounts()

    async def run() -> None:
        task = asyncio.create_task(
            flood(args.host, args.port, args.connections, args.source, args.seconds, counts)
        )
        while not task.done():
            print(json.dumps(asdict(counts)), flush=True)
            await asyncio.wait({task}, timeout=0.5)
        await task

    asyncio.run(run())
    print(json.dumps(asdict(counts)), flush=True)
    return 0


@contextlib.asynccontextmanager
async def flooding(
    url: str, connections: int, seconds: float, source: str = "127.0.0.1"
) -> AsyncIterator[FloodCounts]:
    """A flood process against ``url`` for ``seconds``; the counts it last printed, kept up
    to date while the block runs."""
    parts = urlsplit(url)
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "bench.slowloris", "--flood"),
        *(parts.hostname or "127.0.0.1", str(parts.port or 80)),
        *(str(connections), source, str(seconds)),
        stdout=asyncio.subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    counts = FloodCounts()

    async def follow() -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            with contextlib.suppress(ValueError):
                for k, v in json.loads(line).items():
                    setattr(counts, k, v)

    reading = asyncio.create_task(follow())
    try:
        yield counts
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()
        await reading


# --- the other address ------------------------------------------------------------------
async def measure(
    url: str,
    token: str | None,
    seconds: float,
    rate: float = 50.0,
    source: str = "127.0.0.2",
    path: str = "/v1/servings/noop/dispatch",
) -> tuple[list[float], dict[str, int]]:
    """Authenticated requests to ``url`` from ``source``, ``rate`` a second for
    ``seconds`` (a steady schedule: one late does not delay the next); the latency of each
    answered 200 in seconds, and the errors by kind (a request not answered within 10 s is
    one)."""
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    transport = httpx.AsyncHTTPTransport(local_address=source, retries=0)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    async with httpx.AsyncClient(
        base_url=url, headers=headers, transport=transport, timeout=10
    ) as http:

        async def one(i: int) -> None:
            start = time.perf_counter()
            try:
                response = await http.post(path, content=b'{"item": %d}' % i)
                kind = None if response.status_code == 200 else str(response.status_code)
            except httpx.HTTPError as e:
                kind = type(e).__name__
            if kind is None:
                latencies.append(time.perf_counter() - start)
            else:
                errors[kind] = errors.get(kind, 0) + 1

        loop = asyncio.get_running_loop()
        begin, tasks = loop.time(), []
        for i in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, begin + i / rate - loop.time()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return latencies, errors


async def slowloris(
    url: str,
    *,
    token: str | None = None,
    half_open: int = 2000,
    seconds: float = 20.0,
    rate: float = 50.0,
    ramp_s: float = 30.0,
    flood_from: str = "127.0.0.1",
    client_from: str = "127.0.0.2",
    path: str = "/v1/servings/noop/dispatch",
) -> Report:
    """``half_open`` connections held from ``flood_from`` (reopened as the gateway closes
    them) while ``client_from`` sends authenticated requests for ``seconds``, once the flood
    holds what it can (its count stops growing, or ``ramp_s`` passed)."""
    async with flooding(url, half_open, ramp_s + seconds + 5, flood_from) as counts:
        loop = asyncio.get_running_loop()
        until, last = loop.time() + ramp_s, -1
        while loop.time() < until and counts.peak < half_open:
            await asyncio.sleep(1.0)
            if counts.peak == last and counts.attempted >= half_open:
                break  # the gateway keeps it from holding more
            last = counts.peak
        latencies, errors = await measure(url, token, seconds, rate, client_from, path)
        flood = FloodCounts(**asdict(counts))
    ms = sorted(x * 1000 for x in latencies)
    sent = len(latencies) + sum(errors.values())
    return Report(
        half_open=half_open,
        flood=flood,
        requests=sent,
        answered_within_1s=sum(x <= ANSWERED_S * 1000 for x in ms) / sent if sent else 0.0,
        p50_ms=percentile(ms, 50) if ms else float("nan"),
        p99_ms=percentile(ms, 99) if ms else float("nan"),
        max_ms=ms[-1] if ms else float("nan"),
        errors=errors,
    )


# --- the stand-alone run -------------------------------------------------------------------
def _answers(url: str) -> bool:
    try:
        r = httpx.post(
            f"{url}/v1/servings/noop/dispatch",
            json={"item": 1},
            headers={"authorization": f"Bearer {TOKEN}"},
            timeout=5,
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--flood"]:
        host, port, n, source, seconds = argv[1:6]
        return flood_main(
            argparse.Namespace(
                host=host, port=int(port), connections=int(n), source=source, seconds=float(seconds)
            )
        )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--seconds", type=float, default=20.0, help="of requests per N")
    parser.add_argument("--rate", type=float, default=50.0, help="requests a second")
    parser.add_argument("--json", help="write the reports to this file")
    parser.add_argument("gateway_args", nargs="*", help="more `queueserve gateway` flags")
    args = parser.parse_args(argv)
    redis_server = RedisServer().start()
    port = free_port()
    common = ("--redis-url", redis_server.url, "--prefix", PREFIX)
    worker = spawn_module(
        "queueserve", "worker", "bench.servings:noop", *common, "--partitions", "1",
        "--log-level", "WARNING",
    )  # fmt: skip
    gateway = spawn_module(
        "queueserve", "gateway", "--port", str(port), *common, "--log-level", "warning",
        "--token", TOKEN, *args.gateway_args,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    reports = []
    try:
        wait_for(lambda: _answers(url), 60, "the gateway and the worker")
        for n in args.connections:
            report = asyncio.run(
                slowloris(url, token=TOKEN, half_open=n, seconds=args.seconds, rate=args.rate)
            )
            print(report.line(), flush=True)
            reports.append(asdict(report))
            alive = gateway.poll() is None and _answers(url)
            print(f"       the gateway answers after it: {alive}", flush=True)
    finally:
        stop_process(gateway)
        stop_process(worker)
        redis_server.stop()
    print(f"machine: {os.cpu_count()} cores, {socket.gethostname()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

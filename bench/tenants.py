"""Two tenants on one serving, one flooding (issue 38; docs/gateway.md, "Tenants").

    python -m bench.tenants [--quick] [--no-door] [--json FILE]

One private ``redis-server``, one ``queueserve worker bench.tenants:paced bench.tenants:stepped``
(one partition) and one ``queueserve gateway --tenants`` with three tenants of weight 1:
``quiet``, ``flood`` and ``probe``. ``paced``'s batch (up to 16 items) takes BATCH_S and
``stepped``'s decode step takes BATCH_S, so "a batch time" is a known duration on any machine.

Per shape of flood, over HTTP, the way its callers would send it:

- ``small``: 64 callers, each sending one-item dispatches one after another;
- ``big``: 4 callers, each sending ``dispatch_many`` of 256 items one after another;
- ``map``: jobs of 256 items, 8 in flight, each followed to its result;
- ``streams``: 48 callers, each streaming one generation of STEPS steps after another on
  ``stepped`` (16 slots).

the flood alone for SECONDS (its items/s: what the serving gives it), then the flood again with
the quiet tenant's requests beside it, one every 100 ms, from 10x below the flood's rate
(one-item dispatches; for ``streams`` a one-item stream of STEPS steps), each checked against
what it sent. Before the shapes, the quiet tenant alone gives its unloaded p99.

Budgets (issue 38): under every shape, the quiet tenant's p99 is within 2 batch times of its
unloaded p99, and the flood keeps at least 0.9x of its items/s alone. With the door check
(default), during the ``small`` shape one host keeps 2,000 half-open connections open
(reopening those the gateway closes: bench/slowloris.py) while another sends the probe
tenant's requests: 99% answered within 1 s; then 20,000 attempted, and the gateway still
answers. Every answer a figure counts is checked; a wrong or missing one fails the run
(exit 2); a budget missed exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

import queueserve as qs
from bench._harness import RedisServer, free_port, percentile, spawn_module, stop_process
from bench._harness import wait_until as wait_for
from bench._verdict import Verdict, WorkFailed, at_least, at_most, report, run
from bench.gateway import RawHttp
from bench.slowloris import slowloris

PREFIX = "benchten"
BATCH_S = 0.02
BATCH_SIZE = 16
STEPS = 3
TOKENS = {"quiet": "bench-quiet", "flood": "bench-flood", "probe": "bench-probe"}
QUIET_EVERY_S = 0.1
ADDRESSES = {"quiet": "127.0.0.4", "flood": "127.0.0.3", "probe": "127.0.0.2"}


def _paced(items: list[Any]) -> list[Any]:
    time.sleep(BATCH_S)
    return items


paced = qs.Serving(_paced, name="paced", batch_size=BATCH_SIZE, batch_timeout=0.002)


class Stepped(qs.StepServing):
    """Each item ``{"n": N}`` outputs 0..N-1, one per decode step of BATCH_S."""

    name = "stepped"
    max_slots = BATCH_SIZE
    max_batch_tokens = 10**6
    max_prefill_tokens = 10**6

    def tokens(self, item: Any) -> tuple[int, int]:
        return 1, int(item["n"])

    def prefill(self, items: list[Any]) -> list[dict[str, int]]:
        return [{"n": int(item["n"]), "at": 0} for item in items]

    def decode(self, states: list[dict[str, int]]) -> list[Any]:
        time.sleep(BATCH_S)
        out: list[Any] = []
        for s in states:
            if s["at"] >= s["n"]:
                out.append(qs.END)
            else:
                out.append(s["at"])
                s["at"] += 1
        return out


stepped = Stepped()


def tenants_file(folder: Path) -> Path:
    path = folder / "tenants.toml"
    path.write_text(
        "".join(f'[tenants.{name}]\ntoken = "{token}"\n\n' for name, token in TOKENS.items())
    )
    return path


def client(url: str, tenant: str, connections: int = 100) -> httpx.AsyncClient:
    """An HTTP client of ``tenant``, from its own address (ADDRESSES): the door check's
    half-open connections come from 127.0.0.1, whose per-address cap is not theirs."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(
        base_url=url,
        headers={
            "authorization": f"Bearer {TOKENS[tenant]}",
            "content-type": "application/json",
        },
        timeout=60,
        transport=httpx.AsyncHTTPTransport(local_address=ADDRESSES[tenant], limits=limits),
    )


def checked(response: httpx.Response, what: str) -> Any:
    if response.status_code != 200:
        raise WorkFailed(f"{what}: {response.status_code} {response.text[:300]}")
    return response.json()


async def stream_outputs(http: httpx.AsyncClient, items: list[dict[str, int]]) -> list[Any]:
    """A stream's final ``result`` event: each item's outputs."""
    async with http.stream("POST", "/v1/servings/stepped/stream", json={"items": items}) as r:
        if r.status_code != 200:
            raise WorkFailed(f"stream: {r.status_code} {(await r.aread())[:300]!r}")
        event, result = None, None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "result":
                result = json.loads(line[6:])["outputs"]
            elif line.startswith("data: ") and event == "error":
                raise WorkFailed(f"stream failed: {line[6:300]}")
    if result is None:
        raise WorkFailed("a stream ended without its result")
    return list(result)


# --- the flood's shapes: each call sends one request and returns the items it checked ----
async def small(http: RawHttp, i: int) -> int:
    got = json.loads(await http.post(b'{"item": %d}' % i))
    if got != {"result": i}:
        raise WorkFailed(f"small: {got!r:.200} for {i}")
    return 1


async def big(http: httpx.AsyncClient, i: int) -> int:
    items = [f"{i}:{j}" for j in range(256)]
    got = checked(await http.post("/v1/servings/paced/dispatch_many", json={"items": items}), "big")
    if got != {"results": items}:
        raise WorkFailed(f"big: wrong results for request {i}")
    return len(items)


async def mapped(http: httpx.AsyncClient, i: int) -> int:
    items = [f"m{i}:{j}" for j in range(256)]
    submitted = await http.post("/v1/servings/paced/jobs", json={"items": items, "keep": 600})
    if submitted.status_code != 202:
        raise WorkFailed(f"map: {submitted.status_code} {submitted.text[:300]}")
    job = submitted.json()["id"]
    while True:
        done = await http.get(f"/v1/jobs/{job}/result", params={"timeout": 30})
        if done.status_code == 200:
            break
        if done.status_code != 202:
            raise WorkFailed(f"map: {done.status_code} {done.text[:300]}")
    if done.json()["results"] != items:
        raise WorkFailed(f"map: wrong results for job {job}")
    return len(items)


async def streams(http: httpx.AsyncClient, i: int) -> int:
    outputs = await stream_outputs(http, [{"n": STEPS}])
    if outputs != [list(range(STEPS))]:
        raise WorkFailed(f"streams: {outputs!r:.200}")
    return 1


SHAPES: dict[str, tuple[Callable[[Any, int], Awaitable[int]], int]] = {
    "small": (small, 64),
    "big": (big, 4),
    "map": (mapped, 8),
    "streams": (streams, 48),
}


def raw_dispatch(url: str) -> RawHttp:
    """bench/gateway.py's lean keep-alive client, as the flood tenant: a flood of one-item
    requests from httpx is bound by httpx's CPU on a small host, not by the serving."""
    conn = RawHttp(urlsplit(url).port or 80, "/v1/servings/paced/dispatch")
    token = f"authorization: Bearer {TOKENS['flood']}\r\n".encode()
    conn.head = conn.head.replace(b"\r\n", b"\r\n" + token, 1)
    return conn


async def flooding(url: str, shape: str, seconds: float) -> float:
    """The flood's items/s over ``seconds`` (each caller's calls back to back)."""
    call, callers = SHAPES[shape]
    done = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    counter = iter(range(10**9))
    async with client(url, "flood", callers) as http:

        async def caller() -> None:
            nonlocal done
            raw = raw_dispatch(url) if shape == "small" else None
            if raw is not None:
                port = urlsplit(url).port or 80
                local = (ADDRESSES["flood"], 0)
                await loop.create_connection(lambda: raw, "127.0.0.1", port, local_addr=local)
            try:
                while loop.time() < end:
                    n = await call(raw or http, next(counter))
                    if loop.time() <= end:
                        done += n
            finally:
                if raw is not None:
                    raw.close()

        await asyncio.gather(*(caller() for _ in range(callers)))
    return done / seconds


async def quiet_calls(url: str, seconds: float, stream: bool) -> list[float]:
    """The quiet tenant's latencies, one call every QUIET_EVERY_S (a steady schedule)."""
    latencies: list[float] = []
    async with client(url, "quiet", 50) as http:

        async def one(i: int) -> None:
            start = time.perf_counter()
            if stream:
                if await stream_outputs(http, [{"n": STEPS}]) != [list(range(STEPS))]:
                    raise WorkFailed("quiet stream: wrong outputs")
            else:
                got = checked(
                    await http.post("/v1/servings/paced/dispatch", json={"item": f"q{i}"}),
                    "quiet",
                )
                if got != {"result": f"q{i}"}:
                    raise WorkFailed(f"quiet: {got!r:.200}")
            latencies.append(time.perf_counter() - start)

        loop = asyncio.get_running_loop()
        begin, tasks = loop.time(), []
        for i in range(int(seconds / QUIET_EVERY_S)):
            await asyncio.sleep(max(0.0, begin + i * QUIET_EVERY_S - loop.time()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return latencies


def p99_ms(latencies: list[float]) -> float:
    return percentile(sorted(x * 1000 for x in latencies), 99)


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"batch_ms": BATCH_S * 1000, "shapes": {}}
    for stream in (False, True):
        unloaded = await quiet_calls(url, args.seconds, stream)
        figures["unloaded_streams_p99_ms" if stream else "unloaded_p99_ms"] = p99_ms(unloaded)
    for shape in args.shapes:
        alone = await flooding(url, shape, args.seconds)
        beside = asyncio.create_task(flooding(url, shape, args.seconds))
        quiet = await quiet_calls(url, args.seconds, shape == "streams")
        figures["shapes"][shape] = {
            "flood_alone_items_s": alone,
            "flood_beside_items_s": await beside,
            "quiet_p50_ms": percentile(sorted(x * 1000 for x in quiet), 50),
            "quiet_p99_ms": p99_ms(quiet),
        }
        print(f"{shape}: {figures['shapes'][shape]}", flush=True)
    if args.door:  # the small flood goes on while one host holds half-open connections
        for half_open in (2000, 20000):
            flood = asyncio.create_task(flooding(url, "small", args.seconds + 15))
            door = await slowloris(
                url, token=TOKENS["probe"], half_open=half_open, seconds=args.seconds,
                ramp_s=10.0, path="/v1/servings/paced/dispatch",
            )  # fmt: skip
            figures[f"door_{half_open}"] = {**asdict(door), "flood_items_s": await flood}
            print(door.line(), flush=True)
    return figures


def verdicts(f: dict[str, Any]) -> list[Verdict]:
    batch = f["batch_ms"]
    out = []
    for shape, s in f["shapes"].items():
        base = f["unloaded_streams_p99_ms" if shape == "streams" else "unloaded_p99_ms"]
        out.append(
            at_most(
                f"{shape}: quiet tenant p99 - unloaded p99 <= 2 batch times ({2 * batch:.0f} ms)",
                s["quiet_p99_ms"] - base,
                2 * batch,
                fmt="{:.1f} ms",
                positive=False,
            )
        )
        out.append(
            at_least(
                f"{shape}: the flood's items/s beside the quiet tenant >= 0.9x alone",
                s["flood_beside_items_s"] / s["flood_alone_items_s"],
                0.9,
            )
        )
    if "door_2000" in f:
        out.append(
            at_least(
                "2,000 half-open from one host: another host's requests answered within 1 s",
                f["door_2000"]["answered_within_1s"],
                0.99,
                fmt="{:.2%}",
            )
        )
        many = f["door_20000"]
        answered = 1 - sum(many["errors"].values()) / many["requests"] if many["requests"] else 0
        out.append(
            at_least(
                "20,000 half-open attempted: another host's requests still answered",
                answered,
                0.99,
                fmt="{:.2%}",
                note=f"{many['answered_within_1s']:.2%} within 1 s",
            )
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases")
    parser.add_argument("--no-door", dest="door", action="store_false", help="no slowloris")
    parser.add_argument("--only", nargs="+", choices=list(SHAPES), help="these shapes only")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    args.seconds = 5.0 if args.quick else 15.0
    args.shapes = args.only or list(SHAPES)
    redis_server = RedisServer().start()
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        worker = spawn_module(
            "queueserve", "worker", "bench.tenants:paced", "bench.tenants:stepped",
            "--redis-url", redis_server.url, "--prefix", PREFIX, "--partitions", "1",
            "--log-level", "WARNING",
        )  # fmt: skip
        gateway = spawn_module(
            "queueserve", "gateway", "--port", str(port), "--redis-url", redis_server.url,
            "--prefix", PREFIX, "--tenants", str(tenants_file(Path(folder))),
            "--log-level", "warning",
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _ready(url), 60, "the gateway and the worker")
            figures = asyncio.run(measure(url, args))
        finally:
            stop_process(gateway)
            stop_process(worker)
            redis_server.stop()
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return report(verdicts(figures))


def _ready(url: str) -> bool:
    try:
        response = httpx.post(
            f"{url}/v1/servings/paced/dispatch",
            json={"item": 0},
            headers={"authorization": f"Bearer {TOKENS['probe']}"},
            timeout=2,
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


if __name__ == "__main__":
    raise SystemExit(run(main))

"""Redis CPU per item of queueserve's scripts against the plain commands of the hand-written loop.

    python -m bench.script_cost [--rounds 40]

On a private ``redis-server``, rounds of 512 one-item requests go through each step of the
single-item path, and Redis's own CPU clock (``INFO cpu``) is read around each step:

- queueserve: ``enqueue.lua`` (one call for the 512), ``read.lua`` (about 256 per read) and
  ``ack.lua`` (in the reply pipeline, 512 per call), through the broker;
- the loop of ``bench/baseline.py``: a pipeline of 512 ``XADD``, ``XREADGROUP COUNT 256``,
  ``XACK`` + ``XDEL`` of 256 ids.

Only this process talks to that server, so the figures hold on a busy machine too (Redis's CPU
clock counts only its own work). They say where Redis's share of the single-item path goes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import redis

from queueserve.broker.consumer import Consumer
from queueserve.broker.producer import Producer
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, inbox_key
from queueserve.wire.request import encode_request

from ._harness import RedisServer

N = 512


def redis_cpu(client: redis.Redis) -> float:
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class Broker(Producer, Consumer):
    """The client's enqueue and the worker's read and ack, on one connection."""


def queueserve_steps(broker: Broker, rounds: int) -> dict[str, float]:
    keys = Keys("qsb", "noop")
    stream = keys.stream("default")
    broker.ensure_group(stream)
    codec = get_codec("msgpack")
    inbox = inbox_key("qsb", "0123456789abcdef")
    requests = [("default", 1, *encode_request(codec, i, [i], inbox, None), 0) for i in range(N)]
    spent = {"enqueue.lua": 0.0, "read.lua": 0.0, "ack.lua": 0.0}
    for _ in range(rounds):
        c0 = redis_cpu(broker.redis)
        broker.enqueue(keys, requests, 0)
        c1 = redis_cpu(broker.redis)
        ids: list[bytes] = []
        while len(ids) < N:
            read = broker.read_ready(keys, "c", 256, 256, [])
            ids += [entry_id for _, entries in read.entries for entry_id, _ in entries]
        c2 = redis_cpu(broker.redis)
        broker.reply_and_ack(keys, {}, {stream: {1: ids}}, 1000)
        c3 = redis_cpu(broker.redis)
        spent["enqueue.lua"] += c1 - c0
        spent["read.lua"] += c2 - c1
        spent["ack.lua"] += c3 - c2
    return {k: v / (N * rounds) * 1e6 for k, v in spent.items()}


def loop_steps(client: redis.Redis, rounds: int) -> dict[str, float]:
    client.xgroup_create("bl", "g", id="0", mkstream=True)
    inbox = "bl:inbox"
    spent = {"XADD": 0.0, "XREADGROUP": 0.0, "XACK+XDEL": 0.0}
    for _ in range(rounds):
        c0 = redis_cpu(client)
        pipe = client.pipeline(transaction=False)
        for i in range(N):
            pipe.xadd("bl", {"m": msgpack.packb([i, inbox, i])})
        pipe.execute()
        c1 = redis_cpu(client)
        ids: list[bytes] = []
        while len(ids) < N:
            out = client.xreadgroup("g", "c", {"bl": ">"}, count=256)
            ids += [entry_id for entry_id, _ in out[0][1]]
        c2 = redis_cpu(client)
        for i in range(0, N, 256):
            pipe = client.pipeline(transaction=False)
            pipe.xack("bl", "g", *ids[i : i + 256])
            pipe.xdel("bl", *ids[i : i + 256])
            pipe.execute()
        c3 = redis_cpu(client)
        spent["XADD"] += c1 - c0
        spent["XREADGROUP"] += c2 - c1
        spent["XACK+XDEL"] += c3 - c2
    return {k: v / (N * rounds) * 1e6 for k, v in spent.items()}


T = TypeVar("T")


def on_private_redis(
    prog: str, doc: str | None, argv: list[str] | None, measure: Callable[[Broker, int], T]
) -> T:
    """``measure(broker, rounds)`` on a private redis-server, ``--rounds`` from ``argv``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--rounds", type=int, default=40, help="rounds of 512 items")
    args = parser.parse_args(argv)
    server = RedisServer().start()
    try:
        broker = Broker(server.url)
        try:
            return measure(broker, args.rounds)
        finally:
            broker.close()
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ours, theirs = on_private_redis(
        "python -m bench.script_cost",
        __doc__,
        argv,
        lambda broker, rounds: (queueserve_steps(broker, rounds), loop_steps(broker.redis, rounds)),
    )
    print("Redis CPU µs per item")
    for name, us in (
        *ours.items(),
        ("queueserve, all", sum(ours.values())),
        *theirs.items(),
        ("hand-written loop, all", sum(theirs.values())),
    ):
        print(f"  {name:<24} {us:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

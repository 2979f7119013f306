"""Large Redis state for the cost tests (issue 38, finding 5): batch keys with a queued
request each, as enqueue.lua makes them, keys nobody of queueserve wrote, and the commands
Redis ran (``INFO commandstats``: an independent count, not the code's own)."""

from __future__ import annotations

import contextlib
import time

import msgpack
import redis

from queueserve.broker.producer import Producer
from queueserve.wire.keys import Keys, inbox_key

CHUNK = 1000  # requests (one per batch key) per enqueue.lua call


def commands(r: redis.Redis) -> dict[str, int]:
    """Calls per command since the server started (or its last CONFIG RESETSTAT)."""
    stats = r.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def ran(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands run between two ``commands`` readings, by name (the readings' own INFO left
    out)."""
    out = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
    out.pop("info", None)
    return out


def declare(r: redis.Redis, prefix: str, serving: str) -> None:
    """A serving as a worker declares it: its meta hash and its entry in the registry."""
    keys = Keys(prefix, serving)
    r.hset(keys.meta, mapping={"codec": "msgpack", "batch_size": "8", "max_queue": "0"})
    r.zadd(f"{prefix}:servings", {serving: int(time.time() * 1000)})  # wire: servings_key


def fill_batch_keys(url: str, prefix: str, serving: str, start: int, count: int) -> None:
    """Batch keys ``k<start>`` .. ``k<start+count-1>`` of ``serving``, each with one queued
    request of one item (enqueue.lua: its stream, group, ready mark, depth and counters)."""
    keys = Keys(prefix, serving)
    payload = bytes(msgpack.packb([1]))
    reply_to = inbox_key(prefix, "costtest")
    with contextlib.closing(Producer(url)) as broker:
        for first in range(start, start + count, CHUNK):
            requests = []
            for i in range(first, min(first + CHUNK, start + count)):
                header = bytes(msgpack.packb([1, i, 1, reply_to, 0, "msgpack"]))
                requests.append((f"k{i}", 1, header, payload, 0))
            broker.enqueue(keys, requests, 0)


def unrelated_keys(r: redis.Redis, count: int, tag: str = "unrelated") -> None:
    """``count`` string keys outside any prefix of queueserve's (another application's)."""
    for first in range(0, count, 10_000):
        r.mset({f"{tag}:{i}": "x" for i in range(first, min(first + 10_000, count))})

"""fakeredis against a real Redis, for what the fakeredis unit tests rely on.

tests/unit/test_ops.py runs `queueserve stats`, `config` and `dead-letter list|drop` on
fakeredis. That is only worth something while fakeredis answers the broker calls under those
commands as Redis does, so the same scenario runs here on both and every answer is compared:
per-key stats from consumer groups (also after deletions, read and unread), pending counts, queue
and dead-letter depths, the worker registry, SCAN over servings, config and meta hashes, and
dead-letter records.
"""

from __future__ import annotations

from typing import Any

import fakeredis
import redis

from queueserve.ops.deadletter import DeadLetters
from queueserve.wire.keys import GROUP, Keys
from tests.support.broker import RedisBroker


def key_stats(broker: RedisBroker, keys: Keys) -> list[tuple[Any, ...]]:
    """Per-key stats without the oldest item's age (it depends on when each run happens)."""
    return [
        (s.key, s.queued_items, s.last_seen_ms, s.waiting, s.pending, s.read)
        for s in broker.key_stats(keys)
    ]


def answers(r: redis.Redis, prefix: str) -> dict[str, Any]:
    """What the operator-facing broker calls answer, step by step through one scenario."""
    broker = RedisBroker("redis://compared", client=r)
    keys = Keys(prefix, "square")
    out: dict[str, Any] = {}
    broker.declare(keys, {"batch_size": 8, "max_queue": 100})
    for batch_key in ("default", "big"):
        r.zadd(keys.seen, {batch_key: 1_700_000_000_000})  # as enqueue.lua records a key
        r.hincrby(keys.depth, batch_key, 1)
        broker.ensure_group(keys.stream(batch_key))
    stream = keys.stream("default")
    ids = [r.xadd(stream, {"h": b"h", "p": b"p"}) for _ in range(6)]
    r.xadd(keys.stream("big"), {"h": b"h", "p": b"p"})
    out["fresh"] = key_stats(broker, keys)

    read = broker.read("w1", [stream], 3, 0)
    out["read"] = [len(entries) for _, entries in read]
    r.xack(stream, GROUP, ids[0])
    r.xdel(stream, ids[0])  # answered: acked and deleted, as ack.lua does
    out["after ack"] = key_stats(broker, keys)
    r.xdel(stream, ids[4])  # cancelled before anyone read it: Redis loses count of the lag
    out["after cancel"] = key_stats(broker, keys)
    out["depths"] = [row[1:] for row in broker.queue_depths([keys])]

    broker.dead_letter(
        keys,
        stream,
        ids[1],
        {"reason": "boom", "deliveries": 3, "field:h": b"h", "field:p": b"p"},
        ack_now=True,
    )
    out["dead depths"] = [n for _, n in broker.dead_letter_depths([keys])]
    out["pending"] = broker.pending_consumers(stream)
    out["consumers"] = [(name, pending) for name, pending, _ in broker.consumers(stream)]
    records = DeadLetters(broker, prefix, "square").records()
    out["dead"] = [(d.stream, d.reason, d.deliveries, d.header, d.payload) for d in records]
    out["dropped"] = [DeadLetters(broker, prefix, "square").drop(d.id) for d in records * 2]

    broker.heartbeat([keys], "w1", 10_000, {"host": "h"})
    out["alive"] = broker.alive_consumers(keys, 10)
    out["servings"] = broker.servings(prefix)
    broker.set_config(keys, {"batch_size": 16})
    out["config"] = broker.config(keys)
    out["meta"] = broker.meta(keys)
    out["no streams"] = key_stats(broker, Keys(prefix, "nothing"))
    r.zadd(Keys(prefix, "ghost").seen, {"default": 1})  # a key seen, its stream never made
    out["no stream"] = key_stats(broker, Keys(prefix, "ghost"))
    out["no stream depth"] = [row[1:] for row in broker.queue_depths([Keys(prefix, "ghost")])]
    return out


def test_fakeredis_answers_the_operator_broker_calls_as_redis_does(
    redis_client: redis.Redis, prefix: str
) -> None:
    real = answers(redis_client, prefix)
    fake = answers(fakeredis.FakeRedis(), prefix)
    differ = {k: (real[k], fake[k]) for k in real if real[k] != fake[k]}
    assert not differ, f"fakeredis differs from Redis (real, fake): {differ}"
    # the scenario reached the cases it is there for
    assert real["after cancel"] != real["after ack"]  # the deletion was counted
    assert real["dropped"] == [True, False]

"""What keys' states the other partitions of a serving hold, as their heartbeat records say
(worker/pipeline/affinity.py): read after each heartbeat by partitions of a serving with
``load_key``."""

from __future__ import annotations

from typing import cast

from queueserve.broker.common import since_ms, text
from queueserve.broker.consumer import Consumer
from queueserve.broker.redis_errors import redis_errors
from queueserve.wire.keys import Keys, worker_key
from queueserve.wire.timing import DEAD_AFTER_S

HELD_WORKERS = 64  # the most recent heartbeats whose records are read
MAX_KEY_CHARS = 256  # a longer line counts for no key (anyone may write a record)


def held_elsewhere(broker: Consumer, keys: Keys, consumer: str, field: str, limit: int) -> set[str]:
    """The batch keys the serving's other workers say they hold: ``field`` of the registry
    records of its HELD_WORKERS most recent heartbeats within DEAD_AFTER_S (a partition dead
    that long holds nothing), one key per line; at most ``limit`` keys. A record of another
    type, a field that is not UTF-8 text, a line too long for a key and keys past the limit
    count for nothing. Two round trips, whatever the keys."""
    with redis_errors(broker.url):
        alive = since_ms(DEAD_AFTER_S)  # a dead partition's keys are held by nobody
        members = cast(
            list[bytes],
            broker.redis.zrevrangebyscore(keys.workers, "+inf", alive, start=0, num=HELD_WORKERS),
        )
        others = [c for c in (text(m, "replace") for m in members) if c != consumer]
        if not others:
            return set()
        pipe = broker.redis.pipeline(transaction=False)
        for other in others:
            pipe.hget(worker_key(keys.prefix, other), field)
        replies = pipe.execute(raise_on_error=False)
    held: set[str] = set()
    for reply in replies:
        if not isinstance(reply, bytes):
            continue
        try:
            lines = reply.decode().split("\n")
        except UnicodeDecodeError:
            continue
        for line in lines:
            if len(held) >= limit:
                return held
            if 0 < len(line) <= MAX_KEY_CHARS:
                held.add(line)
    return held

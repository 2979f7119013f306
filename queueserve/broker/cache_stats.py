"""The result cache's counts (wire/cache.py's ``P:{S}:cachestats``), read for a worker's
metrics: one round trip for every shard of the servings asked."""

from __future__ import annotations

from collections.abc import Sequence

from queueserve.broker.core import BrokerCore
from queueserve.broker.redis_errors import redis_errors
from queueserve.wire.cache import stats
from queueserve.wire.keys import Keys


def cache_counts(broker: BrokerCore, shards: Sequence[Keys]) -> dict[str, int]:
    """The counts of ``shards`` (one serving's), summed; a hash someone made another type
    counts nothing."""
    with redis_errors(broker.url):
        pipe = broker.redis.pipeline(transaction=False)
        for keys in shards:
            pipe.hgetall(keys.cache_stats())
        replies = pipe.execute(raise_on_error=False)
    total: dict[str, int] = {}
    for reply in replies:
        if isinstance(reply, dict):
            for name, count in stats(reply).items():
                total[name] = total.get(name, 0) + count
    return total

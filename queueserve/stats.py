"""``queueserve stats``: queues, consumers, lag, throughput and dead letters, from Redis."""

from __future__ import annotations

import argparse
import time

from .broker import RedisBroker
from .protocol import Keys
from .settings import Settings

ALIVE_WITHIN = 10.0


def stats_command(args: argparse.Namespace) -> int:
    settings = Settings()
    broker = RedisBroker(args.redis_url or settings.redis_url)
    prefix = args.prefix or settings.prefix
    try:
        servings = [Keys(prefix, s) for s in (args.servings or broker.servings(prefix))]
        if not servings:
            print(f"no servings under prefix {prefix!r}")
            return 0
        before = {k.name: broker.group_stats(k) for k in servings}
        time.sleep(args.interval)  # throughput = entries read over this interval
        print(f"{'serving':<16} {'key':<12} {'waiting':>8} {'pending':>8} {'lag':>8} "
              f"{'req/s':>9} {'workers':>8} {'dead':>6}")
        for keys, (_, dead) in zip(servings, broker.dead_letter_depths(servings), strict=True):
            read_before = {row[0]: row[4] for row in before[keys.name]}
            workers = len(broker.alive_consumers(keys, ALIVE_WITHIN))
            rows = broker.group_stats(keys) or [("-", 0, 0, 0, 0)]
            for key, length, pending, lag, read in rows:
                rate = (read - read_before.get(key, read)) / args.interval
                print(f"{keys.name:<16} {key:<12} {max(0, length - pending):>8} {pending:>8} "
                      f"{'?' if lag is None else lag:>8} {rate:>9.1f} {workers:>8} {dead:>6}")
        return 0
    finally:
        broker.close()

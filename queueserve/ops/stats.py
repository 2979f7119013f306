"""``queueserve stats``: per serving and batch key, what is queued (items, oldest item's age),
in flight, read per second, and when the key last saw a request; consumers and dead letters;
then per serving and priority, the items queued and the oldest request's age.
A sharded serving's shards are summed. Keys with work are all shown, idle ones only the last
enqueued to (``STATS_RECENT_KEYS``), and a line counts the rest: with 100,000 idle keys the
command reads what the busy ones hold, not every key."""

from __future__ import annotations

import argparse
import time

from queueserve.broker.admin import Admin, KeyStats, by_priority
from queueserve.settings import Settings
from queueserve.wire.keys import Keys
from queueserve.wire.timing import ALIVE_WITHIN_S

HEADER = (
    f"{'serving':<16} {'key':<12} {'items':>8} {'waiting':>8} {'pending':>8} "
    f"{'oldest':>8} {'seen':>8} {'req/s':>9} {'workers':>8} {'dead':>6}"
)


def ago(ms: int) -> str:
    """A short age: ``850ms``, ``12.3s``, ``4.0m``, ``2.5h``."""
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m" if seconds < 3600 else f"{seconds / 3600:.1f}h"


def format_row(name: str, row: KeyStats, rate: float, workers: int, dead: int, now_ms: int) -> str:
    oldest = ago(row.oldest_age_ms) if row.oldest_age_ms else "-"
    seen = ago(max(0, now_ms - row.last_seen_ms)) if row.last_seen_ms else "-"
    return (
        f"{name:<16} {row.key:<12} {row.queued_items:>8} {row.waiting:>8} "
        f"{row.pending:>8} {oldest:>8} {seen:>8} {rate:>9.1f} {workers:>8} {dead:>6}"
    )


PRIORITY_HEADER = f"{'serving':<16} {'priority':>8} {'items':>8} {'oldest':>8}"


def priority_lines(broker: Admin, name: str, of: list[Keys], now_ms: int) -> list[str]:
    """Per priority holding work: items admitted and not answered (every batch key), and the
    age of the oldest request not answered."""
    summary = by_priority(broker.priority_items(of), broker.queue_depths(of), now_ms)
    return [
        f"{name:<16} {p:>8} {items:>8} {'-' if age is None else ago(age):>8}"
        for p, (items, age) in summary.items()
    ]


def print_undeclared(broker: Admin, prefix: str, declared: list[str]) -> None:
    """Requests waiting on servings no worker ever declared: a misspelled name, or workers
    not started yet (clients with wait_for_worker=True)."""
    for serving, items in broker.undeclared_waiting(prefix, declared):
        print(
            f"{serving!r}: {items} items waiting, and no worker ever declared this serving "
            f"under prefix {prefix!r} (a misspelled name, or its workers not started)"
        )


def stats_command(args: argparse.Namespace) -> int:
    settings = Settings()
    broker = Admin(args.redis_url or settings.redis_url)
    prefix = args.prefix or settings.prefix
    try:
        names = args.servings
        if not names:
            names = broker.servings(prefix)
            print_undeclared(broker, prefix, names)
        servings = [Keys(prefix, s) for s in names]
        if not servings:
            print(f"no servings under prefix {prefix!r}")
            return 0
        # A serving's shards are summed: one row per serving and batch key, however many.
        shards = {k.name: broker.shards(k) for k in servings}
        before = {
            name: {row.key: row.read for row in broker.summed_key_stats(of)}
            for name, of in shards.items()
        }
        time.sleep(args.interval)  # throughput = entries read over this interval
        print(HEADER)
        priority_rows = []
        for keys in servings:
            of = shards[keys.name]
            dead = sum(n for _, n in broker.dead_letter_depths(of))
            workers = len(broker.alive_consumers(keys, ALIVE_WITHIN_S))
            now_ms = int(time.time() * 1000)
            rows = broker.summed_key_stats(of) or [KeyStats("-", 0, 0)]
            for row in rows:
                rate = (row.read - before[keys.name].get(row.key, row.read)) / args.interval
                print(format_row(keys.name, row, rate, workers, dead, now_ms))
            hidden = max(broker.known_keys(s) for s in of) - len(rows)
            if hidden > 0:
                print(f"{keys.name:<16} ... and {hidden} more known batch keys, idle (not shown)")
            priority_rows += priority_lines(broker, keys.name, of, now_ms)
        if priority_rows:
            print(f"\n{PRIORITY_HEADER}", *priority_rows, sep="\n")
        return 0
    finally:
        broker.close()

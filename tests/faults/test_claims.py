"""Reclaiming from a dead or forged consumer (docs/guarantees.md, "Hostile entries"): anyone
may XREADGROUP in a serving's group under any name, and every live partition then races to
take the entry back. The claim looks and takes in one script (claim.lua), so a partition that
looked while the stranger held an entry never takes it from the live partition that took it
first, however long it was descheduled between the two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import redis

from queueserve.wire.keys import GROUP
from tests.support.broker import RedisBroker
from tests.support.helpers import stream_key, wait_until

IDLE_MS = 100  # the claimers' idle floor here (CLAIM_IDLE_S in a worker)


def owner_and_idle(r: redis.Redis, stream: str, entry_id: bytes) -> tuple[bytes, int] | None:
    found = r.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
    return (found[0]["consumer"], int(found[0]["time_since_delivered"])) if found else None


def held_by_first_past_the_floor(r: redis.Redis, stream: str, entry_id: bytes) -> bool:
    found = owner_and_idle(r, stream, entry_id)
    return found is not None and found[0] == b"first" and found[1] >= 2 * IDLE_MS


@contextlib.contextmanager
def brokers(redis_url: str, n: int) -> Iterator[list[RedisBroker]]:
    made = [RedisBroker(redis_url) for _ in range(n)]
    try:
        yield made
    finally:
        for b in made:
            b.close()


def test_a_claim_never_takes_an_entry_a_live_consumer_took_from_the_dead_owner_meanwhile(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given an entry read, and never acked, by a stranger: a consumer no worker runs
    stream = stream_key(prefix, "raced")
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    entry_id = redis_client.xadd(stream, {"h": b"header", "p": b"payload"})
    redis_client.xreadgroup(GROUP, "stranger", {stream: ">"}, count=1)
    wait_until(
        lambda: (owner_and_idle(redis_client, stream, entry_id) or (b"", 0))[1] >= IDLE_MS,
        "the stranger's entry to be idle past the floor",
    )
    with brokers(redis_url, 2) as (first, late):
        # and a partition whose claim is descheduled right before it takes what it saw: the
        # other partition takes the entry first, and holds it (running it) past the floor
        real = late.redis.execute_command
        interleaved: list[Any] = []

        def descheduled(*args: Any, **options: Any) -> Any:
            if args[0] in ("XCLAIM", "EVALSHA", "EVAL") and not interleaved:
                interleaved.append(first.claim(stream, "stranger", "first", IDLE_MS, 10))
                wait_until(
                    lambda: held_by_first_past_the_floor(redis_client, stream, entry_id),
                    "the first partition to hold it past the floor",
                )
            return real(*args, **options)

        late.redis.execute_command = descheduled  # type: ignore[method-assign]
        # When the late partition's claim goes on
        taken = late.claim(stream, "stranger", "late", IDLE_MS, 10)

    # Then the first partition took the entry, and the late one nothing: one run, not two
    assert interleaved and [e[0] for e in interleaved[0]] == [entry_id]
    assert taken == []
    found = owner_and_idle(redis_client, stream, entry_id)
    assert found is not None and found[0] == b"first"


def test_a_claim_takes_what_a_dead_owner_holds_and_leaves_what_it_is_told_to(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given three entries a dead consumer holds, and one it read but that was deleted since
    stream = stream_key(prefix, "claimed")
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    ids = [redis_client.xadd(stream, {"n": str(i)}) for i in range(4)]
    redis_client.xreadgroup(GROUP, b"dead\xff", {stream: ">"}, count=4)
    redis_client.xdel(stream, ids[3])
    wait_until(
        lambda: all(
            (owner_and_idle(redis_client, stream, i) or (b"", 0))[1] >= IDLE_MS for i in ids[:3]
        ),
        "the entries to be idle past the floor",
    )
    with brokers(redis_url, 1) as (broker,):
        # When a partition claims them, told to leave the second (it holds it already)
        got = broker.claim(
            stream, b"dead\xff".decode(errors="surrogateescape"), "me", IDLE_MS, 10, skip={ids[1]}
        )
    # Then it gets the others with their fields and delivery counts, the second stays
    assert [(i, f, n) for i, f, n in got] == [(ids[0], {b"n": b"0"}, 1), (ids[2], {b"n": b"2"}, 1)]
    assert owner_and_idle(redis_client, stream, ids[1])[0] == b"dead\xff"  # type: ignore[index]
    assert owner_and_idle(redis_client, stream, ids[0])[0] == b"me"  # type: ignore[index]

"""Priority ageing bounds how long a low priority waits under a flood of high priority work on
the same batch key (docs/usage.md, "Batch keys, fairness and priorities"): each level is worth
PRIORITY_AGE_MS of waiting, so priority 0 runs about 9 levels' worth after it was sent, however
long the flood. Measured in the order of service, not in time: a batch function that takes at
least BATCH_S per batch runs at most (9 levels of ageing) / BATCH_S batches while the
priority-0 request ages, whatever the speed of the machine."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve.broker import common, consumer, dead_letters, reads
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, inbox_key
from queueserve.wire.request import encode_request
from tests.support.broker import RedisBroker
from tests.support.helpers import WAIT_S, wait_until
from tests.support.servings import Recording

StartWorker = Callable[..., qs.Worker]

AGE_MS = 100  # each level's worth, for this test (1 s in production): 9 levels are 0.9 s
BATCH_S = 0.05  # the least time one batch takes
FLOOD = 600  # priority-9 requests, one item each: 150 batches, several times the bound


@pytest.fixture
def quick_ageing(monkeypatch: pytest.MonkeyPatch) -> None:
    """PRIORITY_AGE_MS of AGE_MS wherever the client reads it (the worker reads the serving's
    priority_age)."""
    for module in (common, reads, consumer, dead_letters):
        monkeypatch.setattr(module, "PRIORITY_AGE_MS", AGE_MS)


def slow_echo(items: list[Any]) -> list[Any]:
    time.sleep(BATCH_S)
    return items


def flooded(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> tuple[Recording, qs.Client, list[qs.Ticket]]:
    """A worker of serving "aged" running a flood of FLOOD priority-9 requests, and the
    client that sent them."""
    serving = Recording(
        slow_echo, name="aged", batch_size=4, batch_timeout=0, priority_age=AGE_MS / 1000
    )
    start_worker(serving)
    client = qs.Client(redis_url, prefix=prefix)
    flood = [client.submit("aged", [f"h{i}"], priority=9) for i in range(FLOOD)]
    wait_until(lambda: len(serving.item_batches) >= 5, "the flood running")
    return serving, client, flood


@pytest.mark.timeout(120)
def test_a_priority_zero_request_waits_no_more_batches_than_its_ageing_allows(
    quick_ageing: None,
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a worker, and a flood of priority-9 requests on the batch key
    serving, client, flood = flooded(start_worker, redis_url, prefix)

    # When a priority-0 request is sent on the same key
    before = len(serving.item_batches)
    low = client.submit("aged", ["low"])

    # Then it runs after at most the batches its ageing allows: 9 levels of AGE_MS, in which
    # batches of BATCH_S or more start at most 9 * AGE_MS / BATCH_S + 1 times, then the batch
    # taken as the ready set hands it over, and one or two more taken as the worker's ranking
    # (from when each level was last served) catches up with Redis's; not after the flood
    assert low.result(WAIT_S) == ["low"]
    ran = serving.item_batches
    at = next(i for i, items in enumerate(ran) if "low" in items)
    bound = int(9 * AGE_MS / 1000 / BATCH_S) + 4
    assert at - before <= bound, (at - before, bound)
    assert sum(len(b) for b in ran[: at + 1]) < FLOOD
    for ticket in flood:
        ticket.cancel()
    client.close()


@pytest.mark.timeout(120)
def test_every_priority_zero_request_sent_during_the_flood_waits_within_the_bound(
    quick_ageing: None,
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a worker, and a flood of priority-9 requests on the batch key
    serving, client, flood = flooded(start_worker, redis_url, prefix)

    # When priority-0 requests keep coming on the same key, one every 4 batches (faster than
    # the 9 levels of ageing: several wait at once)
    waits, ran = probe(serving, client, count=8, every=4)

    # Then each runs within the bound of the test above, counted from its own send: ageing
    # gives every one its turn, not one per bound (16, 23, 30 ... batch bounds)
    bound = int(9 * AGE_MS / 1000 / BATCH_S) + 4
    assert max(waits.values()) <= bound, (waits, bound)
    assert sum(len(b) for b in ran) < FLOOD
    for ticket in flood:
        ticket.cancel()
    client.close()


@pytest.mark.timeout(120)
def test_priority_zero_requests_waiting_more_than_a_batch_at_once_each_wait_within_the_bound(
    quick_ageing: None,
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a worker, and a flood of priority-9 requests on the batch key
    serving, client, flood = flooded(start_worker, redis_url, prefix)

    # When priority-0 requests keep coming on the same key, one every 2 batches: about 9 wait
    # at once, more than one batch (4) holds, so Redis hands them over a batch at a time
    waits, ran = probe(serving, client, count=16, every=2)

    # Then each runs within the bound counted from its own send: the ones left unread after a
    # batch of them was read keep their own clocks in Redis too (they ran one batch of 4 per
    # bound, most only after the flood)
    bound = int(9 * AGE_MS / 1000 / BATCH_S) + 4
    assert max(waits.values()) <= bound, (waits, bound)
    assert sum(len(b) for b in ran) < FLOOD
    for ticket in flood:
        ticket.cancel()
    client.close()


@pytest.mark.parametrize(
    ("urgent", "waited_ms", "rank"),
    [
        (True, 0, "head"),  # a head that came within the levels' worth keeps its own clock
        (True, 200, "aged"),  # one that fell behind ranks as the urgent level would, read now
        (False, 200, "now"),  # with no more urgent level ready, it ranks from now
    ],
    ids=["fresh-head", "head-fell-behind", "alone"],
)
def test_read_lua_ranks_a_level_left_unread_from_its_head_but_no_earlier_than_the_urgent_level(
    redis_url: str,
    redis_client: redis.Redis,
    prefix: str,
    urgent: bool,
    waited_ms: int,
    rank: str,
) -> None:
    # Given 6 priority-0 requests on a key (ageing of 10 ms per level: 9 levels are 90 ms),
    # and (urgent) priority-9 ones, read.lua's ready set ranking priority 0 first
    keys, age_ms = Keys(prefix, "ranked"), 10
    inbox, codec = inbox_key(prefix, "c1"), get_codec("msgpack")

    def redis_ms() -> int:
        seconds, micros = redis_client.time()
        return seconds * 1000 + micros // 1000

    with contextlib.closing(RedisBroker(redis_url)) as broker:
        for priority in (0, 9) if urgent else (0,):
            broker.ensure_group(keys.stream("k", priority))
            for rid in range(6):
                request = encode_request(codec, rid, ["x"], inbox, None)
                broker.enqueue(keys, [("k", 1, *request, priority)], 0)
        redis_client.zadd(keys.ready, {"0k": 0}, xx=True)
        fifth = redis_client.xrange(keys.stream("k", 0))[4][0]
        head_ms = int(fifth.split(b"-")[0])
        wait_until(lambda: redis_ms() >= head_ms + waited_ms, "the head waiting")

        # When a worker reads a batch (4) of the key: the fifth request is left unread
        before = redis_ms()
        outcome = broker.read_ready(keys, "c", 4, 4, [], age_ms=age_ms)
        after = redis_ms()
        assert [len(entries) for _, entries in outcome.entries] == [4]

    # Then the level ranks as said
    score = redis_client.zscore(keys.ready, "0k")
    assert score is not None
    if rank == "head":
        assert score == head_ms
    elif rank == "aged":
        assert before - 9 * age_ms <= score <= after - 9 * age_ms, (score, before, after)
    else:
        assert before <= score <= after, (score, before, after)


def probe(
    serving: Recording, client: qs.Client, count: int, every: int
) -> tuple[dict[str, int], list[list[Any]]]:
    """``count`` priority-0 requests on the flooded key, one each ``every`` batches; how many
    batches each waited from its send to the batch that ran it, and the batches run."""
    sent_at: dict[str, int] = {}
    lows = []
    for i in range(count):
        sent_at[f"low{i}"] = len(serving.item_batches)
        lows.append(client.submit("aged", [f"low{i}"]))
        wait_until(
            lambda i=i: len(serving.item_batches) >= sent_at[f"low{i}"] + every,
            f"{every} more batches",
        )
    for low in lows:
        low.result(WAIT_S)
    ran = serving.item_batches
    waits = {
        name: next(i for i, items in enumerate(ran) if name in items) - before
        for name, before in sent_at.items()
    }
    return waits, ran

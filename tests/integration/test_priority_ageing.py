"""Priority ageing bounds how long a low priority waits under a flood of high priority work on
the same batch key (docs/usage.md, "Batch keys, fairness and priorities"): each level is worth
PRIORITY_AGE_MS of waiting, so priority 0 runs about 9 levels' worth after it was sent, however
long the flood. Measured in the order of service, not in time: a batch function that takes at
least BATCH_S per batch runs at most (9 levels of ageing) / BATCH_S batches while the
priority-0 request ages, whatever the speed of the machine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve.broker import common, consumer, dead_letters, reads
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

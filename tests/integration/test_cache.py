"""The result cache through a real worker (docs/usage.md, "Result cache"; wire/cache.py):
repeats answered with the workers stopped, errors never cached, cache_version and the byte
bound respected, identical items of one batch run once, forged entries never answering."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.wire.keys import Keys
from queueserve.worker.middleware import Middleware
from tests.support.helpers import WAIT_S, items_waiting, wait_until
from tests.support.servings import Recording, tag_items

StartWorker = Callable[..., qs.Worker]
NAME = "cached"


def entry_of(prefix: str, item: Any, version: str = "", batch_key: str = "default") -> str:
    """The entry an item's result is cached under, from the documented format (BLAKE2b-128 of
    the version, the batch key and the msgpack payload [item], zero bytes between)."""
    h = hashlib.blake2b(version.encode(), digest_size=16)
    for part in (b"\0", batch_key.encode(), b"\0", msgpack.packb([item])):
        h.update(part)
    return Keys(prefix, NAME).cached(h.hexdigest())


def entries(r: redis.Redis, prefix: str) -> int:
    return sum(1 for _ in r.scan_iter(match=f"{prefix}:{{{NAME}*}}:cached:*"))


def stats(r: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(Keys(prefix, NAME).cache_stats()).items()}


def ran(serving: Recording) -> list[Any]:
    return [item for batch in serving.item_batches for item in batch]


def fails_on_x(items: list[Any]) -> list[Any]:
    if "x" in items:
        raise ValueError("no x")
    return tag_items(items)


def test_repeats_are_answered_from_the_cache_even_with_the_workers_stopped(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    serving = Recording(tag_items, name=NAME, batch_timeout=0.001, cache_ttl="10m")
    worker = start_worker(serving)
    assert client.dispatch_many(NAME, ["a", "b"]) == ["r:a", "r:b"]
    wait_until(lambda: entries(redis_client, prefix) == 2, "both results cached")
    # a call of hits and misses: only the miss reaches the worker, answers in the call's order
    assert client.dispatch_many(NAME, ["b", "c", "a"]) == ["r:b", "r:c", "r:a"]
    assert sorted(ran(serving)) == ["a", "b", "c"]
    wait_until(lambda: entries(redis_client, prefix) == 3, "c cached")
    worker.stop(timeout=10)
    # no worker: every repeat still answered, by name and through map, sync and async
    assert client.dispatch(NAME, "c", timeout=WAIT_S) == "r:c"
    assert list(client.map(NAME, ["a", "c", "b", "a"], chunk_size=3)) == [
        "r:a",
        "r:c",
        "r:b",
        "r:a",
    ]

    async def from_async() -> list[Any]:
        async with qs.AsyncClient(client.url, prefix=prefix) as aclient:
            return await aclient.dispatch_many(NAME, ["b", "a"], timeout=WAIT_S)

    assert asyncio.run(from_async()) == ["r:b", "r:a"]
    assert sorted(ran(serving)) == ["a", "b", "c"]
    counted = stats(redis_client, prefix)
    assert counted["hits"] == 2 + 1 + 4 + 2 and counted["misses"] == 2 + 1
    assert counted["bytes"] >= 3 * 17  # a digest and a tag at least, each
    assert 0 < redis_client.pttl(Keys(prefix, NAME).cache_stats()) <= 7 * 86400 * 1000


class Counts(Middleware):
    """The cache's counts the worker reads at each heartbeat, as the metrics see them."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def cache_counts(self, serving: qs.Serving, counts: Mapping[str, int]) -> None:
        self.last = dict(counts)


def test_the_workers_metrics_see_the_hits_and_misses_clients_counted(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Recording(tag_items, name=NAME, batch_timeout=0.001, cache_ttl="10m")
    counts = Counts()
    start_worker(serving, middleware=[counts])
    assert client.dispatch_many(NAME, ["a", "b"]) == ["r:a", "r:b"]
    wait_until(lambda: counts.last.get("stored") == 2, "both stored, told to the middleware")
    assert client.dispatch_many(NAME, ["a", "b", "a"]) == ["r:a", "r:b", "r:a"]
    wait_until(lambda: counts.last.get("hits") == 3, "three hits, told")
    assert counts.last["misses"] == 2 and counts.last["bytes"] > 0
    assert counts.last["too_big"] == 0


def test_errors_are_never_cached(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    serving = Recording(fails_on_x, name=NAME, batch_timeout=0.001, cache_ttl="10m")
    start_worker(serving)
    for _ in range(2):
        got = client.dispatch_many(NAME, ["x", "ok"], return_exceptions=True)
        assert isinstance(got[0], qs.RemoteError) and got[1] == "r:ok"
        wait_until(lambda: entries(redis_client, prefix) == 1, "ok cached")
    # the first call ran [x, ok], then its halves; the second ran x again (its error was not
    # kept) and ok not (its result was)
    assert serving.item_batches == [["x", "ok"], ["x"], ["ok"], ["x"]]
    assert not redis_client.exists(entry_of(prefix, "x"))


def test_a_new_cache_version_misses_the_old_versions_results(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    old = Recording(tag_items, name=NAME, batch_timeout=0.001, cache_ttl="10m", cache_version="1")
    worker = start_worker(old)
    assert client.dispatch(NAME, "a") == "r:a"
    wait_until(lambda: redis_client.exists(entry_of(prefix, "a", "1")), "a cached under 1")
    worker.stop(timeout=10)
    new = Recording(upper_tag, name=NAME, batch_timeout=0.001, cache_ttl="10m", cache_version="2")
    start_worker(new)
    with qs.Client(redis_url, prefix=prefix) as fresh:  # it reads version 2, declared
        assert fresh.dispatch(NAME, "a", timeout=WAIT_S) == "R:A"
    assert client.dispatch(new, "a", timeout=WAIT_S) == "R:A"  # by the object: cached now
    assert ran(new) == ["a"]


def upper_tag(items: list[str]) -> list[str]:
    return [f"R:{s.upper()}" for s in items]


def test_a_result_over_cache_max_bytes_is_not_cached(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    serving = Recording(
        tag_items, name=NAME, batch_timeout=0.001, cache_ttl="10m", cache_max_bytes=100
    )
    start_worker(serving)
    big, small = "y" * 200, "s"
    for _ in range(2):
        assert client.dispatch_many(NAME, [big, small]) == [f"r:{big}", "r:s"]
        wait_until(lambda: entries(redis_client, prefix) == 1, "the small one cached")
    assert ran(serving).count(big) == 2 and ran(serving).count(small) == 1
    assert stats(redis_client, prefix)["too_big"] >= 2  # (a write sent again counts again)
    assert not redis_client.exists(entry_of(prefix, big))


def test_identical_items_waiting_in_one_batch_run_once(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Recording(tag_items, name=NAME, batch_timeout=0.001, cache_ttl="10m", gated=True)
    worker = start_worker(serving)
    held = client.submit(NAME, ["h"])
    wait_until(lambda: len(serving.batches) == 1, "a batch held in the executor")
    tickets = [client.submit(NAME, items) for items in (["d", "e"], ["d"], ["e", "d", "f"])]
    wait_until(lambda: items_waiting(worker) == 6, "all six read into one batch")
    serving.release()
    assert held.result(WAIT_S) == ["r:h"]
    assert [t.result(WAIT_S) for t in tickets] == [["r:d", "r:e"], ["r:d"], ["r:e", "r:d", "r:f"]]
    assert serving.item_batches == [["h"], ["d", "e", "f"]]


def steps(items: list[str]) -> Iterator[list[str]]:
    for step in range(2):
        yield [f"{item}{step}" for item in items]


def test_a_generator_batch_functions_steps_are_neither_cached_nor_deduplicated(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    serving = Recording(steps, name=NAME, batch_timeout=0.001, cache_ttl="10m", gated=True)
    worker = start_worker(serving)
    held = client.submit(NAME, ["h"])
    wait_until(lambda: len(serving.batches) == 1, "a batch held in the executor")
    tickets = [client.submit(NAME, ["g"]) for _ in range(2)]
    wait_until(lambda: items_waiting(worker) == 2, "both read into one batch")
    serving.release()
    expected = qs.Serving(steps).inline_many(["g"])
    assert held.result(WAIT_S) == qs.Serving(steps).inline_many(["h"])
    assert [t.result(WAIT_S) for t in tickets] == [expected, expected]
    assert client.dispatch_many(NAME, ["g"]) == expected
    assert serving.item_batches == [["h"], ["g", "g"], ["g"]]  # each run, none cached
    assert entries(redis_client, prefix) == 0


def test_a_forged_entry_is_a_miss_or_a_clear_error_never_another_items_answer(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    serving = Recording(tag_items, name=NAME, batch_timeout=0.001, cache_ttl="10m")
    start_worker(serving)
    assert client.dispatch(NAME, "b") == "r:b"
    wait_until(lambda: redis_client.exists(entry_of(prefix, "b")), "b cached")
    # b's value copied under a's name: bound to b's digest, so a miss for a
    redis_client.set(entry_of(prefix, "a"), redis_client.get(entry_of(prefix, "b")) or b"")
    redis_client.set(entry_of(prefix, "c"), b"short")  # no digest: a miss
    redis_client.hset(entry_of(prefix, "e"), "f", "v")  # another type: a miss
    assert client.dispatch_many(NAME, ["a", "c", "e"]) == ["r:a", "r:c", "r:e"]
    assert sorted(ran(serving)) == ["a", "b", "c", "e"]
    # a's own digest, then junk: that call alone fails, saying what to do
    digest = bytes.fromhex(entry_of(prefix, "d").rsplit(":", 1)[1])
    redis_client.set(entry_of(prefix, "d"), digest + b"m\xc1junk")
    got = client.dispatch_many(NAME, ["d", "b"], return_exceptions=True)
    assert isinstance(got[0], qs.QueueServeError) and "DEL" in str(got[0]), got
    assert got[1] == "r:b"
    assert client.dispatch(NAME, "f") == "r:f"


def test_calls_of_a_serving_without_a_cache_read_and_write_none(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    serving = Recording(tag_items, name=NAME, batch_timeout=0.001)
    start_worker(serving)
    for _ in range(2):
        assert client.dispatch_many(NAME, ["a", "a"]) == ["r:a", "r:a"]
    assert ran(serving) == ["a", "a", "a", "a"]
    assert not list(redis_client.scan_iter(match=f"{prefix}:{{{NAME}}}:cache*"))


@pytest.mark.parametrize("shards", [3])
def test_a_sharded_serving_finds_each_items_result_on_its_shard(
    start_worker: StartWorker, client: qs.Client, shards: int
) -> None:
    serving = Recording(tag_items, name=NAME, batch_timeout=0.001, cache_ttl="10m", shards=shards)
    worker = start_worker(serving)
    items = [f"i{n}" for n in range(12)]
    assert client.dispatch_many(serving, items) == [f"r:{s}" for s in items]
    r = redis.Redis.from_url(client.url)
    wait_until(lambda: entries(r, client.prefix) == 12, "all twelve cached")
    r.close()
    worker.stop(timeout=10)
    assert client.dispatch_many(serving, items[::-1], timeout=WAIT_S) == [
        f"r:{s}" for s in items[::-1]
    ]

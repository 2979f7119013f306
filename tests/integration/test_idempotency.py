"""Idempotency keys through a real worker (docs/usage.md, "Idempotency keys"): the forms of
``idempotency_key=`` on every method, conflicts, forged records, shards and the asyncio client.
The cross-process and kill scenarios are tests/faults/test_once.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import redis

import queueserve as qs
from queueserve.wire.keys import Keys
from tests.support.helpers import WAIT_S, wait_until
from tests.support.servings import Recording, tag_items

StartWorker = Callable[..., qs.Worker]


def test_a_key_reused_for_other_items_is_refused_and_the_first_answer_stands(
    start_worker: StartWorker, client: qs.Client, redis_url: str, prefix: str
) -> None:
    serving = Recording(tag_items, name="idem", batch_timeout=0.001)
    start_worker(serving)
    assert client.submit("idem", ["a", "b"], idempotency_key="order-7").result(WAIT_S) == [
        "r:a",
        "r:b",
    ]
    with qs.Client(redis_url, prefix=prefix) as other:
        with pytest.raises(qs.IdempotencyConflict, match=r"order-7.*other items"):
            other.submit("idem", ["a", "c"], idempotency_key="order-7").result(WAIT_S)
        with pytest.raises(qs.IdempotencyConflict):  # the same items under another batch key
            other.dispatch_many("idem", ["a", "b"], batch_key="k2", idempotency_key="order-7")
        # the same items again: the first call's answer, not a second run
        assert other.dispatch_many("idem", ["a", "b"], idempotency_key="order-7") == ["r:a", "r:b"]
    assert serving.item_batches == [["a", "b"]]


def test_every_method_takes_a_key_and_the_job_of_a_key_is_the_first_calls(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Recording(tag_items, name="idem", batch_timeout=0.001, gated=True)
    start_worker(serving)
    first = client.submit("idem", ["x"], idempotency_key="k")
    wait_until(lambda: serving.batches, "the first call's batch runs")
    again = client.submit("idem", ["x"], idempotency_key="k")  # running: follows it
    assert again.id == first.id
    assert again.cancel() is False  # a follower's cancel stops its own wait only
    serving.release()
    assert first.result(WAIT_S) == ["r:x"]
    assert client.dispatch("idem", "x", idempotency_key="k") == "r:x"  # done: its answer
    assert client.job(first.id).result(WAIT_S) == ["r:x"]
    # map and dispatch_many with a function of the item: one request, and one run, per key
    items = ["p", "q", "p", "x"]
    assert list(client.map("idem", items, idempotency_key=lambda s: f"m-{s}")) == [
        f"r:{s}" for s in items
    ]
    assert client.dispatch_many("idem", ["q", "p"], idempotency_key=lambda s: f"m-{s}") == [
        "r:q",
        "r:p",
    ]
    with pytest.raises(TypeError, match="function of an item"):
        list(client.map("idem", items, idempotency_key="one-for-all"))  # type: ignore[arg-type]
    assert sorted(x for b in serving.item_batches for x in b) == ["p", "q", "x", "x"]


def test_a_forged_record_fails_its_call_clearly_and_nothing_else(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    serving = Recording(tag_items, name="idem", batch_timeout=0.001)
    start_worker(serving)
    client.dispatch("idem", "warm")
    keys = Keys(prefix, "idem")
    forged = {
        "junk": b"not a record",
        "long": b"0" * 32 + b":" + b"c" * 200 + b"-1",
        "digest": b"abc:client-1",
        "job id": b"0" * 32 + b":../x",
    }
    for name, value in forged.items():
        redis_client.set(keys.once(name), value)
    redis_client.hset(keys.once("hash"), "f", "v")  # another type
    for name in [*forged, "hash"]:
        plain = [client.submit("idem", [f"{name}-plain"]) for _ in range(3)]
        with pytest.raises(qs.QueueServeError, match=r"never writes.*DEL"):
            client.submit("idem", ["k"], idempotency_key=name).result(WAIT_S)
        assert [t.result(WAIT_S) for t in plain] == [[f"r:{name}-plain"]] * 3
    assert redis_client.get(keys.once("junk")) == b"not a record"  # left as it was
    redis_client.delete(keys.once("junk"))  # as the message says
    assert client.dispatch("idem", "k", idempotency_key="junk") == "r:k"


def test_keys_of_a_sharded_serving_live_with_their_requests(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    serving = Recording(tag_items, name="idems", batch_timeout=0.001, shards=3)
    start_worker(serving)
    for i in range(6):
        assert client.dispatch(serving, f"i{i}", idempotency_key=f"s{i}") == f"r:i{i}"
        assert client.dispatch(serving, f"i{i}", idempotency_key=f"s{i}") == f"r:i{i}"
    assert sorted(x for b in serving.item_batches for x in b) == [f"i{i}" for i in range(6)]
    tags = {k.decode().split("}")[0] for k in redis_client.scan_iter(f"{prefix}:{{idems*once*")}
    assert len(tags) > 1  # spread over the shards, each record in its request's slot


def test_the_async_client_takes_keys_as_the_sync_one(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    serving = Recording(tag_items, name="idem", batch_timeout=0.001)
    start_worker(serving)

    async def calls() -> None:
        async with (
            qs.AsyncClient(redis_url, prefix=prefix) as a,
            qs.AsyncClient(redis_url, prefix=prefix) as b,
        ):
            one, two = await asyncio.gather(
                a.dispatch("idem", "z", idempotency_key="az"),
                b.dispatch("idem", "z", idempotency_key="az"),
            )
            assert one == two == "r:z"
            ticket = await b.submit("idem", ["z"], idempotency_key="az")
            assert await ticket.result(WAIT_S) == ["r:z"]
            with pytest.raises(qs.IdempotencyConflict):
                await b.dispatch("idem", "w", idempotency_key="az")
            got = [r async for r in a.map("idem", ["p", "p"], idempotency_key=lambda s: s)]
            assert got == ["r:p", "r:p"]

    asyncio.run(calls())
    assert sorted(x for b in serving.item_batches for x in b) == ["p", "z"]


def test_many_retries_from_many_threads_are_answered_by_the_first_calls(
    start_worker: StartWorker, client: qs.Client, redis_url: str, prefix: str
) -> None:
    # Given 400 keys answered once
    serving = Recording(tag_items, name="idem", batch_timeout=0.001)
    start_worker(serving)
    keys = [f"r{i}" for i in range(400)]
    assert client.dispatch_many("idem", keys, idempotency_key=lambda k: k) == [
        f"r:{k}" for k in keys
    ]
    # When another client retries all of them from 8 threads at once (its follower's reads
    # of the jobs go on while more calls join them)
    with qs.Client(redis_url, prefix=prefix) as other:
        got: list[list[str]] = [[] for _ in range(8)]

        def retry(t: int) -> None:
            mine = keys[t::8]
            tickets = [other.submit("idem", [k], idempotency_key=k) for k in mine]
            got[t] = [ticket.result(WAIT_S)[0] for ticket in tickets]

        threads = [threading.Thread(target=retry, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
    # Then every one got its first call's answer, and nothing ran again
    assert [got[t] for t in range(8)] == [[f"r:{k}" for k in keys[t::8]] for t in range(8)]
    assert sorted(x for b in serving.item_batches for x in b) == sorted(keys)

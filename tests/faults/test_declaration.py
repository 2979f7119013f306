"""A serving's declaration (``P:{S}:meta``) against forged values (docs/guarantees.md, "Values
read from Redis"): enqueue.lua takes a count only as workers write one, and a running worker
writes back what it declared whenever Redis holds something else
(queueserve/worker/pipeline/declaration.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.wire.keys import Keys
from tests.support.broker import RedisBroker
from tests.support.fault_app import RawInbox, header
from tests.support.helpers import wait_until
from tests.support.servings import Recording

StartWorker = Callable[..., qs.Worker]
REQUESTS = 20
WAIT_S = 60.0

# What Lua's tonumber reads as a number and no worker writes (str of an int): '0x10' is 16 to
# it (the 600 s fuzz run's QueueFull for 65 valid calls), ' 16 ', '16.0' and '1.6e1' are 16.
UNWRITTEN = ["0x10", " 16 ", "16.0", "1.6e1", "0X10"]


def send(r: redis.Redis, redis_url: str, keys: Keys, n: int) -> tuple[int, list[bytes | int]]:
    """Enqueue ``n`` one-item requests at once (one enqueue.lua call, with max_queue 0, as a
    client naming a serving passes), as a client would: (limit used, entry id or 0 each)."""
    inbox = RawInbox(r, keys.prefix)
    broker = RedisBroker(redis_url)
    try:
        limit, _, ids = broker.enqueue(
            keys,
            [("default", 1, header(i, 1, inbox.key), msgpack.packb([i]), 0) for i in range(n)],
            0,
        )
    finally:
        broker.close()
    return limit, ids


COUNTS = [
    *(("max_queue", v) for v in UNWRITTEN),
    *(("pack_items", v) for v in [*UNWRITTEN, "inf"]),  # inf: packs up to the bound
]


@pytest.mark.parametrize(("field", "value"), COUNTS, ids=[f"{f}={v!r}" for f, v in COUNTS])
def test_a_count_no_worker_writes_counts_as_undeclared(
    redis_client: redis.Redis, redis_url: str, prefix: str, field: str, value: str
) -> None:
    # Given a serving declared by hand (no worker runs) whose max_queue or pack_items is a
    # number only to Lua
    keys = Keys(prefix, "hexed")
    redis_client.hset(keys.meta, mapping={"codec": "msgpack", field: value})
    # When 20 requests are sent at once, then every one is admitted, against no limit, each
    # an entry of its own (no packs declared)
    limit, ids = send(redis_client, redis_url, keys, REQUESTS)
    assert limit == 0 and all(ids), (limit, ids)
    assert len(set(ids)) == REQUESTS, ids
    assert int(redis_client.get(keys.queued) or 0) == REQUESTS


FORGED = [
    ("max_queue", "1"),  # a valid count: every call of more than one item got QueueFull
    ("max_payload_bytes", "1"),  # clients naming the serving refused their own calls
    ("batch_size", "1"),
    ("codec", "pickle"),  # clients naming the serving refuse it, by design
    ("header_fields", ""),  # clients stop sending trace context and jobs
]


@pytest.mark.parametrize(("field", "value"), FORGED, ids=[f for f, _ in FORGED])
def test_a_valid_looking_forged_declaration_is_written_back_and_calls_succeed(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    field: str,
    value: str,
) -> None:
    # Given a worker that declared its serving
    serving = Recording(name="decl", batch_size=4, batch_timeout=0.005)
    worker = start_worker(serving)
    keys = Keys(prefix, "decl")
    wait_until(lambda: redis_client.hget(keys.meta, "codec"), "the declaration")
    declared = redis_client.hgetall(keys.meta)
    assert declared[field.encode()] != value.encode()

    # When one write changes a field to a value the model takes (it cannot tell who wrote it)
    with caplog.at_level(logging.WARNING, logger="queueserve"):
        redis_client.hset(keys.meta, field, value)
        # Then the worker writes back what it declared, and says so
        wait_until(
            lambda: redis_client.hgetall(keys.meta) == declared, "the declaration written back"
        )
    assert any(f"held {field}=" in r.getMessage() for r in caplog.records), caplog.text
    # and a new client naming the serving gets every call answered
    with qs.Client(redis_url, prefix=prefix) as client:
        tickets = [client.submit("decl", [i, i], timeout=WAIT_S) for i in range(REQUESTS)]
        assert [t.result() for t in tickets] == [[i, i] for i in range(REQUESTS)]
    host = worker._host
    assert host is not None and all(t.is_alive() for r in host.runners for t in r.threads)


@pytest.mark.parametrize("how", ["retyped", "deleted"])
def test_a_meta_key_made_another_type_or_deleted_at_run_time_is_declared_again(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str, how: str
) -> None:
    # Given a running worker, and one write that made its meta hash a string, or deleted it:
    # a client naming the serving read either as no declaration, and raised UnknownServing,
    # until a worker restarted
    start_worker(Recording(name="retyped", batch_size=4, batch_timeout=0.005))
    keys = Keys(prefix, "retyped")
    wait_until(lambda: redis_client.hget(keys.meta, "codec"), "the declaration")
    if how == "retyped":
        redis_client.set(keys.meta, "junk")
    else:
        redis_client.delete(keys.meta)
    # When the worker's next pass comes, then the hash is back, and calls by name succeed
    wait_until(
        lambda: redis_client.type(keys.meta) == b"hash" and redis_client.hget(keys.meta, "codec"),
        "the declaration written back",
    )
    with qs.Client(redis_url, prefix=prefix) as client:
        assert client.dispatch("retyped", "x", timeout=WAIT_S) == "x"


def test_a_field_an_operator_deleted_stays_deleted(
    start_worker: StartWorker, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a running worker whose pack_items an operator deleted (how workers older than packs
    # are kept from receiving them while both run: docs/operations.md, "Upgrading workers")
    worker = start_worker(Recording(name="upgrading", batch_size=4, batch_timeout=0.005))
    keys = Keys(prefix, "upgrading")
    wait_until(lambda: redis_client.hget(keys.meta, "pack_items"), "the declaration")
    redis_client.hdel(keys.meta, "pack_items")
    # When the worker compares the hash with what it declared, then it writes nothing back
    host = worker._host
    assert host is not None
    reader = host.runners[0].reader
    assert reader.declaration.keep(reader._config_seen) == 0
    assert not redis_client.hexists(keys.meta, "pack_items")


def test_the_confirmed_shard_count_is_written_back_too(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a serving of three shards, and a write that changed the last shard's confirmation
    # (clients then ignore shard 0's count and send everything to shard 0)
    start_worker(Recording(name="tri", batch_size=4, batch_timeout=0.005, shards=3))
    last = Keys(prefix, "tri").last_shard(3)
    wait_until(lambda: redis_client.hget(last.meta, "shards") == b"3", "the confirmation")
    redis_client.hset(last.meta, "shards", "2")
    # When the worker's next pass comes, then the confirmation is back, and clients spread
    wait_until(lambda: redis_client.hget(last.meta, "shards") == b"3", "the count written back")
    with qs.Client(redis_url, prefix=prefix) as client:
        assert client.dispatch("tri", "x", timeout=WAIT_S) == "x"
        target = client._core.targets.cached("tri")
        assert target is not None and len(target.shards) == 3


def test_a_config_set_is_not_written_over_by_a_worker_that_has_not_applied_it_yet(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a worker, and an operator's `config set` (config and meta hash, in one write)
    worker = start_worker(Recording(name="conf", batch_size=4, batch_timeout=0.005))
    keys = Keys(prefix, "conf")
    wait_until(lambda: redis_client.hget(keys.meta, "codec"), "the declaration")
    host = worker._host
    assert host is not None
    declaration = host.runners[0].reader.declaration
    seen_before = dict(host.runners[0].reader._config_seen)
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        broker.set_config(keys, {"max_queue": 500})
    # When a pass compares the hash with what the worker declared before applying it
    # Then it writes nothing back (the config it last applied is not the one in Redis)
    assert declaration.keep(seen_before) == 0
    assert redis_client.hget(keys.meta, "max_queue") == b"500"
    # and once the worker applied it, it declares the new value as its own
    wait_until(lambda: host.runners[0].serving.max_queue == 500, "the worker to apply it")
    assert declaration.keep(host.runners[0].reader._config_seen) == 0
    assert redis_client.hget(keys.meta, "max_queue") == b"500"

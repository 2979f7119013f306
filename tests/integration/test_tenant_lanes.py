"""Tenants' lanes (wire/tenants.py; docs/gateway.md, "Tenants"; issue 38): a request sent
with ``tenant=`` waits in its tenant's own stream of its batch key, so another tenant's
backlog of the same key is not ahead of it, and a real worker shares service between the
lanes by the tenants' weights in ``P:tenants``. The batch function sees the batch key alone,
and items of two tenants never share a batch."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import redis

import queueserve as qs
from queueserve.wire.keys import Keys
from queueserve.wire.tenants import MAX_TENANT_WEIGHTS
from tests.support.broker import RedisBroker
from tests.support.fault_app import WorkerProc
from tests.support.helpers import wait_until
from tests.support.redis_server import prefixed_client
from tests.support.servings import Recording

KEY = "k"
StartWorker = Callable[..., qs.Worker]


@pytest.fixture
def own_prefix(redis_server: str) -> Iterator[str]:
    name = f"qslane{uuid4().hex[:10]}"
    with prefixed_client(redis_server, name):
        yield name


def start_worker_process(url: str, prefix: str, log: Path) -> WorkerProc:
    worker = WorkerProc.one_partition(["tests.support.tenant_app:laned"], url, prefix, log)
    r = redis.Redis.from_url(url)
    try:
        wait_until(lambda: r.exists(f"{prefix}:{{laned}}:meta"), "the worker", process=worker)
    finally:
        r.close()
    return worker


def batches(r: redis.Redis, prefix: str) -> list[tuple[str, list[str]]]:
    return [tuple(json.loads(b)) for b in r.lrange(f"{prefix}:fault:batches", 0, -1)]


def tenant_of(items: list[str]) -> str:
    """The tenant whose turn the batch was: its lane's items come first (a batch its lane
    does not fill is filled from other tenants' lanes of the key)."""
    return items[0].split(":")[0]


def test_a_quiet_tenant_is_not_queued_behind_another_tenants_backlog_of_its_key(
    redis_server: str, own_prefix: str, tmp_path: Path
) -> None:
    prefix = own_prefix
    worker = start_worker_process(redis_server, prefix, tmp_path / "worker.log")
    try:
        with (
            qs.Client(redis_server, prefix=prefix) as client,
            redis.Redis.from_url(redis_server) as r,
        ):
            # Given a backlog of 1,200 items (150 batches) of one tenant's, on key k
            flood = client.submit(
                "laned", [f"flood:{i}" for i in range(1200)], batch_key=KEY, tenant="flood"
            )
            wait_until(lambda: len(batches(r, prefix)) >= 3, "the flood's first batches")
            # When another tenant sends one item of the same key
            quiet = client.submit("laned", ["quiet:0"], batch_key=KEY, tenant="quiet")
            assert quiet.result(timeout=60) == ["quiet:0"]
            # Then it ran within a few batches, with most of the backlog still waiting
            ran = batches(r, prefix)
            position = next(i for i, (_, items) in enumerate(ran) if "quiet:0" in items)
            flood_after = 1200 - sum(len(items) for _, items in ran[:position])
            assert flood_after > 600, (position, flood_after)
            assert flood.result(timeout=120) == [f"flood:{i}" for i in range(1200)]
            # And the batch function saw the batch key alone; the quiet tenant's batch was
            # filled up with the other tenant's items of the key (it cost them no capacity)
            assert {key for key, _ in batches(r, prefix)} == {KEY}
            assert len(ran[position][1]) == 8
    finally:
        worker.kill_group()


def slow_echo(items: list[Any]) -> list[Any]:
    time.sleep(0.01)  # longer than a read: each lane holds a batch whenever one is picked
    return items


def backlogs_run(
    start_worker: StartWorker,
    url: str,
    prefix: str,
    backlogs: list[tuple[list[str], str, str]],
) -> list[tuple[str, list[str]]]:
    """The batches a worker ran of ``backlogs`` ((items, batch key, tenant) each), all queued
    while its first batch was held, so that they compete from the start."""
    serving = Recording(slow_echo, name="shared", batch_size=10, batch_timeout=0)
    serving.hold()
    start_worker(serving)
    with qs.Client(url, prefix=prefix) as client:
        first = client.submit(serving, ["first"], batch_key="other")
        wait_until(lambda: len(serving.batches) == 1, "the first batch running, held")
        tickets = [client.submit(serving, i, batch_key=k, tenant=t) for i, k, t in backlogs]
        serving.release()
        assert first.result(60) == ["first"]
        for ticket in tickets:
            ticket.result(60)
    return serving.batches[1:]


def while_both(order: list[str], a: str, b: str) -> list[str]:
    """``order`` while both ``a`` and ``b`` had work (the first 10 batches left out: the
    reads' start)."""
    last = min(len(order) - 1 - order[::-1].index(t) for t in (a, b))
    return order[10 : last + 1]


def test_tenants_share_a_busy_key_by_their_weights(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given weights as a gateway writes them (heavy 4, light 1)
    redis_client.hset(f"{prefix}:tenants", mapping={"heavy": "4", "light": "1"})
    # When both tenants queue a backlog of the same key
    ran = backlogs_run(
        start_worker,
        redis_url,
        prefix,
        [([f"{t}:{i}" for i in range(600)], KEY, t) for t in ("light", "heavy")],
    )
    # Then while both had work, heavy ran about 4 batches to light's 1 (test_weights.py's
    # weight-4 keys read 3.3-3.8x, unweighted 1x), its key the batch key alone
    assert {key for key, _ in ran} == {KEY}
    window = while_both([tenant_of(items) for _, items in ran], "heavy", "light")
    heavy, light = window.count("heavy"), window.count("light")
    assert light > 0 and 2.5 <= heavy / light <= 5.0, (heavy, light)


def test_a_tenant_spread_over_many_keys_gets_one_tenants_share(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    # When one tenant queues a backlog over four batch keys, another over one
    wide = [([f"wide:{k}:{i}" for i in range(300)], k, "wide") for k in ("a", "b", "c", "d")]
    narrow = ([f"narrow:{i}" for i in range(600)], "a", "narrow")
    ran = backlogs_run(start_worker, redis_url, prefix, [*wide, narrow])
    # Then while both had work they ran about as many batches each (fair across tenants
    # before keys; by keys, wide would have run 4 to narrow's 1)
    order = [tenant_of(items) for _, items in ran]
    window = while_both(order, "wide", "narrow")
    wide_n, narrow_n = window.count("wide"), window.count("narrow")
    assert narrow_n > 0 and 0.6 <= wide_n / narrow_n <= 1.6, (wide_n, narrow_n, order)


def test_a_worker_reads_the_tenants_weights_checked_and_bounded(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    key, keys = f"{prefix}:tenants", Keys(prefix, "s")
    broker = RedisBroker(redis_url)
    try:
        # Weights other than 1 that are a tenant's name and a decimal in (0, 1000]
        redis_client.hset(
            key,
            mapping={"a": "2", "b": "1", "c": "nan", "bad name": "3", "d": "1001", "e": "0.5"},
        )
        assert broker.run_time_config(keys) == ({}, {"a": 2.0, "e": 0.5})
        # More fields than a worker reads: none; a key of another type: none
        redis_client.hset(key, mapping={f"t{i}": "2" for i in range(MAX_TENANT_WEIGHTS)})
        assert broker.run_time_config(keys) == ({}, {})
        redis_client.delete(key)
        redis_client.set(key, "x")
        assert broker.run_time_config(keys) == ({}, {})
    finally:
        broker.close()

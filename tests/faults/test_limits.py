"""Limits on batches and partitions (queueserve.worker.watchdog): deaths during a batch are
charged to its requests, not to the worker; a batch past max_batch_seconds is abandoned; a
partition is recycled after max_batches_per_partition batches (taking no more work from the
last one on) or past max_partition_memory. Real worker processes, real signals.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import redis

import queueserve as qs
from queueserve.serving import Partition
from queueserve.worker.partition import PartitionHost
from queueserve.worker.watchdog import BatchClock
from tests.support.fault_app import Workers, serving_consumer
from tests.support.helpers import WAIT_S, wait_until
from tests.support.servings import Recording, tag_items


@pytest.mark.timeout(180)
def test_requests_that_kill_their_partition_are_dead_lettered_and_the_worker_serves_on(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker that tolerates one crash a minute, and a serving that dies on "boom"
    worker = workers.start("crasher", "--max-restarts", "1", "--restart-window", "60s")
    serving_consumer(redis_client, prefix, "crasher", worker)

    # When two poison requests kill the partition up to max_deliveries (2) times each (a request
    # read with the first and left unrun when it died has a delivery counted without a crash)
    poison = [client.submit("crasher", ["boom"]) for _ in range(2)]

    # Then both are dead-lettered and their callers told, and the worker did not exit
    for ticket in poison:
        with pytest.raises(qs.DeadLettered, match="max_deliveries=2"):
            ticket.result(120)
    crashes = redis_client.llen(f"{prefix}:fault:crashes")
    assert 2 <= crashes <= 4
    assert worker.alive, worker.output()
    assert worker.output().count("died while running a batch") == crashes
    # and a healthy request after them is answered
    assert client.dispatch("crasher", "fine", timeout=WAIT_S) == "ok:fine"


@pytest.mark.timeout(180)
def test_a_batch_past_max_batch_seconds_is_abandoned_and_its_request_dead_lettered(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker with max_batch_seconds=1 and a serving that hangs for ever on "hang"
    worker = workers.start("hanger", "--max-batch-seconds", "1s")
    serving_consumer(redis_client, prefix, "hanger", worker)

    # When "hang" is sent, then a healthy request
    stuck = client.submit("hanger", ["hang"])
    wait_until(lambda: redis_client.llen(f"{prefix}:fault:hangs") >= 1, "the first hang")
    healthy = client.submit("hanger", ["fine"])

    # Then the hung batch is abandoned each time (its partition killed and restarted), and after
    # max_deliveries (2) runs its caller gets DeadLettered
    with pytest.raises(qs.DeadLettered, match="max_deliveries=2"):
        stuck.result(150)
    assert redis_client.llen(f"{prefix}:fault:hangs") == 2
    assert worker.output().count("over max_batch_seconds=1") == 2
    # and the healthy request is answered, and the worker still serves
    assert healthy.result(WAIT_S) == ["ok:fine"]
    assert worker.alive
    assert client.dispatch("hanger", "after", timeout=WAIT_S) == "ok:after"


@pytest.mark.timeout(180)
def test_a_partition_is_recycled_after_max_batches_and_nothing_is_lost(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker whose partition is recycled after 3 batches
    worker = workers.start("hoarder", "--max-batches-per-partition", "3")
    serving_consumer(redis_client, prefix, "hoarder", worker)

    # When 9 requests are sent one after another, each a batch of its own
    pids = [client.dispatch("hoarder", i, timeout=WAIT_S) for i in range(9)]

    # Then every one was answered, by successive partition processes, each of which stopped
    # taking work after its third batch (and answered the one request it may have read by then)
    assert len(pids) == 9
    runs = {pid: pids.count(pid) for pid in pids}
    assert len(runs) >= 3 and max(runs.values()) <= 4, runs
    assert "recycling: it ran 3 batches (max_batches_per_partition=3)" in worker.output()
    assert "restarting" not in worker.output() and worker.alive


@pytest.mark.timeout(180)
def test_a_partition_past_max_partition_memory_is_recycled(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a serving that leaks 64 MiB per batch, and a 400 MiB limit
    worker = workers.start("hoarder", "--max-partition-memory", "400MiB")
    serving_consumer(redis_client, prefix, "hoarder", worker)

    # When requests keep coming
    first = client.dispatch("hoarder", 0, timeout=WAIT_S)
    wait_until(
        lambda: client.dispatch("hoarder", 1, timeout=WAIT_S) != first,
        "a fresh partition to answer",
    )

    # Then the leaking partition was recycled (drained and replaced), not crashed
    assert "max_partition_memory=400 MiB" in worker.output()
    assert "restarting" not in worker.output() and worker.alive


def test_a_partition_at_max_batches_takes_no_more_work_before_it_is_drained(
    redis_url: str,
    prefix: str,
    client: qs.Client,
) -> None:
    # Given a partition allowed 3 batches, whose main thread (which drains it once woken)
    # never comes: a busy machine may run it several batches late
    serving = Recording(tag_items, name="counted", batch_size=1, batch_timeout=0)
    wake = threading.Event()
    clock = BatchClock(multiprocessing.get_context("spawn").RawArray("d", 2), wake, 3)
    host = PartitionHost([serving], redis_url, prefix, Partition(), middleware=[clock])
    clock.on_limit = host.stop_reading
    host.start()
    try:
        # When 3 requests are answered one after another, and 3 more are sent
        assert [client.dispatch("counted", i, timeout=WAIT_S) for i in range(3)] == [
            "r:0",
            "r:1",
            "r:2",
        ]
        later = [client.submit("counted", [i]) for i in range(3, 6)]

        # Then the partition stops reading by itself, woken to recycle, having taken at most
        # the one request a read already under way may have brought; the others wait in Redis
        # for a fresh partition
        wait_until(lambda: not host.runners[0].reading, "the partition to stop reading")
        assert wake.is_set()
        assert len(serving.items_run) <= 4, serving.items_run
    finally:
        host.stop(timeout=10)
    fresh = PartitionHost([serving], redis_url, prefix, Partition())
    fresh.start()
    try:
        assert [t.result(WAIT_S) for t in later] == [["r:3"], ["r:4"], ["r:5"]]
    finally:
        fresh.stop(timeout=10)

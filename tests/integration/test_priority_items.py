"""The backlog per priority in items (``P:{S}:pdepth``, docs/operations.md "Metrics"): what
``queueserve_priority_queued_items``, ``queueserve stats`` and the dashboard report is items
admitted and not answered, not stream entries (an entry holds one request of up to thousands
of items, or a pack of many requests), against a real worker and Redis; every release path
(ack, cancel) takes its items back, and a hash anyone may write never fails a script."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve.broker.admin import Admin
from queueserve.broker.fleet import Fleet
from queueserve.dashboard.board import Board
from queueserve.ops import stats
from queueserve.wire.codec import get_codec
from queueserve.wire.job_record import placings
from queueserve.wire.keys import Keys
from queueserve.wire.request import encode_request
from tests.support.broker import RedisBroker
from tests.support.fault_app import RawInbox
from tests.support.helpers import REPO, metric_sample, wait_until

StartWorker = Callable[..., qs.Worker]
MSGPACK = get_codec("msgpack")
BACKLOG = 40  # items admitted elsewhere: the per-priority counts then go through the
# increments and releases, not the reset that a counter at 0 makes


def request(rid: int, items: list[int], inbox: RawInbox, priority: int) -> tuple[Any, ...]:
    """enqueue_arguments' form of one request."""
    encoded = encode_request(MSGPACK, rid, items, inbox.key, None, priority=priority)
    return ("default", len(items), *encoded, priority)


def test_the_backlog_per_priority_counts_items_of_requests_and_packs_then_goes_to_zero(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a worker whose batches wait on a gate (packs of up to 8 items: its batch size)
    gate = threading.Event()

    def gated(xs: list[int]) -> list[int]:
        gate.wait(60)
        return xs

    worker = start_worker(
        qs.Serving(gated, name="prio", batch_size=8, batch_timeout=0), metrics_port=0
    )
    keys = Keys(prefix, "prio")
    assert redis_client.hget(keys.meta, "pack_items") == b"8"
    inbox = RawInbox(redis_client, prefix)
    broker = RedisBroker(redis_url)

    # When, in one enqueue, priority 0 gets two requests of 8 items (an entry each) and six of
    # one item (one pack), and priority 5 one of 8 items and three of 2 items (one pack)
    sent = [request(1, list(range(8)), inbox, 0), request(2, list(range(8)), inbox, 0)]
    sent += [request(3 + i, [i], inbox, 0) for i in range(6)]
    sent += [request(9, list(range(8)), inbox, 5)]
    sent += [request(10 + i, [i, i], inbox, 5) for i in range(3)]
    try:
        _, _, ids = broker.enqueue(keys, sent, 0)
    finally:
        broker.close()
    entries = {(r[4], entry_id) for r, entry_id in zip(sent, ids, strict=True)}
    assert len(entries) == 5, "3 entries at priority 0, 2 at priority 5 (ids: per stream)"

    # Then the metric, stats and the dashboard count items per priority: 22 and 14, whatever
    # the worker read ahead, not the 3 and 2 entries
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return str(r.read().decode())

    text = scrape()
    assert (
        metric_sample(text, "queueserve_priority_queued_items", serving="prio", priority="0") == 22
    )
    assert (
        metric_sample(text, "queueserve_priority_queued_items", serving="prio", priority="5") == 14
    )
    admin = Fleet(redis_url)
    try:
        now_ms = int(time.time() * 1000)
        lines = [line.split() for line in stats.priority_lines(admin.admin, "prio", [keys], now_ms)]
        assert [line[:3] for line in lines] == [["prio", "0", "22"], ["prio", "5", "14"]]
        assert all(line[3] != "-" for line in lines), "each priority's oldest request's age"
        (serving,) = Board(admin, prefix).overview()["servings"]
        assert [(p["priority"], p["items"]) for p in serving["priorities"]] == [(0, 22), (5, 14)]

        # and once everything is answered, every count is gone
        gate.set()
        wait_until(lambda: inbox.answered(range(1, 13)), "every request answered")
        wait_until(lambda: redis_client.get(keys.queued) == b"0", "the admitted items released")
        assert not redis_client.exists(keys.pdepth)
        assert admin.priority_items([keys]) == [(keys, 0, {})]
        assert "queueserve_priority_queued_items{" not in scrape()
    finally:
        gate.set()  # a failed check leaves no batch waiting 60 s at the worker's stop
        admin.close()


def test_a_cancelled_request_releases_its_priority_items(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given requests at priority 3 of a serving no worker reads yet, with a backlog elsewhere
    keys = Keys(prefix, "unread")
    redis_client.set(keys.queued, BACKLOG)
    inbox = RawInbox(redis_client, prefix)
    broker = RedisBroker(redis_url)
    try:
        _, _, ids = broker.enqueue(
            keys, [request(1, [1, 2, 3], inbox, 3), request(2, [4, 5], inbox, 3)], 0
        )
        assert redis_client.hgetall(keys.pdepth) == {b"3": b"5"}

        # When one is cancelled before any worker read it, then its items leave the count
        assert broker.cancel(keys, keys.stream("default", 3), ids[0], 3, 1, inbox.key)
        assert redis_client.hgetall(keys.pdepth) == {b"3": b"2"}
        assert broker.cancel(keys, keys.stream("default", 3), ids[1], 2, 2, inbox.key)
        assert not redis_client.exists(keys.pdepth)
    finally:
        broker.close()


@pytest.mark.parametrize("forged", ["field", "wrong_type"])
def test_a_forged_priority_count_is_reset_and_nothing_fails(
    forged: str,
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a serving whose per-priority hash someone overwrote: a field that holds no count
    # (with a backlog elsewhere, so no counter reaches 0 and clears it), or a key of another
    # type (and nothing admitted)
    start_worker(qs.Serving(lambda xs: xs, name="forged", batch_size=8, batch_timeout=0))
    keys = Keys(prefix, "forged")
    if forged == "field":
        redis_client.set(keys.queued, BACKLOG)
        redis_client.hset(keys.pdepth, "5", "junk")
    else:
        redis_client.set(keys.pdepth, "junk")

    # When requests at priority 5 are answered, then each ran, the counts are right again
    assert client.dispatch_many("forged", [1, 2, 3], priority=5, timeout=30) == [1, 2, 3]
    wait_until(
        lambda: int(redis_client.get(keys.queued) or 0) == (BACKLOG if forged == "field" else 0),
        "the admitted items released",
    )
    if forged == "field":  # reset by the enqueue, released by the ack
        assert redis_client.hget(keys.pdepth, "5") is None
    else:  # nothing admitted is left: the key of another type went
        assert not redis_client.exists(keys.pdepth)


def test_the_reported_counts_are_clamped_to_the_admission_counter(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a hash holding drift (a producer or worker that predates it, forged fields)
    keys = Keys(prefix, "drift")
    redis_client.set(keys.queued, 5)
    redis_client.hset(
        keys.pdepth, mapping={"0": "999", "3": "2", "x": "4", "12": "3", "07": "1", "4": "-2"}
    )
    admin = Admin(redis_url)
    try:
        # Then each priority reads at most the admitted items, and what is no priority's
        # count is left out
        assert admin.priority_items([keys]) == [(keys, 5, {0: 5, 3: 2})]
    finally:
        admin.close()


def test_an_enqueue_without_the_priority_key_still_works_and_a_job_key_is_not_taken_for_it(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given enqueue.lua called as producers written before the per-priority hash call it
    # (docs/protocol.md: its KEY is optional and last), with a job record group key last
    # instead
    keys = Keys(prefix, "older")
    inbox = RawInbox(redis_client, prefix)
    enqueue = redis_client.register_script(
        (REPO / "queueserve" / "broker" / "lua" / "enqueue.lua").read_text()
    )
    job = f"{prefix}:jobs:j1:0"
    head = [keys.queued, keys.seen, keys.meta, keys.ready, keys.wake, keys.depth]
    stream = keys.stream("default", 1)
    per_request = [1, 2, *encode_request(MSGPACK, 1, [1, 2], inbox.key, None, priority=1)]
    old = enqueue(keys=[*head, stream], args=[0, "qs", 1000, 1, "default", 1, *per_request])
    with_job = enqueue(
        keys=[*head, stream, job],
        args=[0, "qs", 1000, 1, "default", 1, *per_request, placings("older", [[1, "1", 60000]])],
    )
    # and once as queueserve calls it now
    broker = RedisBroker(redis_url)
    try:
        broker.enqueue(keys, [request(2, [3, 4, 5], inbox, 1)], 0)
    finally:
        broker.close()

    # Then all three are admitted, the job's record written, and only the last call's items
    # are in the per-priority count
    assert old[2] and with_job[2] and redis_client.get(keys.queued) == b"7"
    assert redis_client.hget(job, "1").startswith(b"2:60000:older:")
    assert redis_client.hgetall(keys.pdepth) == {b"1": b"3"}


def test_an_admission_counter_of_another_type_reads_as_none_and_the_scrape_goes_on(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    keys = Keys(prefix, "wrongtype")
    redis_client.rpush(keys.queued, "x")  # a list where a count belongs
    redis_client.hset(keys.pdepth, "0", "3")
    admin = Admin(redis_url)
    try:
        assert admin.priority_items([keys]) == [(keys, 0, {})]
    finally:
        admin.close()


def test_any_other_error_reading_the_counts_is_raised_not_read_as_an_empty_queue(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a backlog, and an operator whose Redis user may not GET (NOPERM)
    keys = Keys(prefix, "denied")
    redis_client.set(keys.queued, 7)
    user = f"{prefix}-noget"
    redis_client.acl_setuser(
        user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-get"]
    )
    admin = Admin(redis_url.replace("redis://", f"redis://{user}:pw@"))
    try:
        # Then reading the counts fails, saying why: a scrape showing 0 items would tell an
        # autoscaler (KEDA scales on this gauge) that the backlog is gone
        with pytest.raises(qs.RedisCommandError, match=r"NOPERM|no permissions"):
            admin.priority_items([keys])
    finally:
        admin.close()
        redis_client.acl_deluser(user)

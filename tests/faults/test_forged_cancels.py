"""A cancel withdraws only its own request (issue 38, finding 6): cancel.lua checks what it is
told (a job's record, which anyone may write, names a stream, an entry id and an item count)
against the entry itself, as the reply path checks reply addresses, and the admission counter
never goes below 0. Before, a forged record naming a victim's queued entry with 67,108,864
items made ``POST /v1/jobs/forged-1/cancel`` delete the victim's entry (its caller timed out)
and take the counter to -67,108,823."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import redis

import queueserve as qs
from queueserve.wire import job_record as J
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, inbox_key
from queueserve.wire.request import encode_request
from tests.support.broker import RedisBroker
from tests.support.fault_app import RawInbox
from tests.support.helpers import WAIT_S, wait_until
from tests.support.servings import Recording

StartWorker = Callable[..., qs.Worker]


def request(rid: int, items: list[int], inbox: RawInbox) -> tuple[Any, ...]:
    """enqueue.lua's arguments for one request of ``items`` answered to ``inbox``."""
    return (
        "default",
        len(items),
        *encode_request(get_codec("msgpack"), rid, items, inbox.key, None),
        0,
    )


def test_a_cancel_naming_another_callers_entry_withdraws_nothing(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a victim's queued request of 3 items (no worker reads the serving yet)
    keys = Keys(prefix, "victims")
    victim = RawInbox(redis_client, prefix, "victim")
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        _, _, (entry,) = broker.enqueue(keys, [request(7, [1, 2, 3], victim)], 0)
        stream = keys.stream("default")
        # When others name its entry: another client, another request id, another count
        for rid, n, inbox in (
            (7, 3, inbox_key(prefix, "attacker")),  # its id and count, another client's inbox
            (8, 3, victim.key),  # its client, another request
            (7, 67_108_864, victim.key),  # its request, a forged count
            (7, 3, f"{victim.key}x"),  # an inbox that only starts as its does
        ):
            assert broker.cancel(keys, stream, entry, n, rid, inbox) is False
        # Then it is still queued, and still counted
        assert redis_client.xlen(stream) == 1
        assert int(redis_client.get(keys.queued) or 0) == 3
        # and its own client's cancel withdraws it
        assert broker.cancel(keys, stream, entry, 3, 7, victim.key) is True
        assert redis_client.xlen(stream) == 0
        assert int(redis_client.get(keys.queued) or 0) == 0


def test_a_request_answered_to_a_threads_inbox_is_its_clients_to_cancel(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # (a client's blocking calls from other threads are answered to P:inbox:C.<thread>)
    keys = Keys(prefix, "threads")
    thread_inbox = RawInbox(redis_client, prefix, "c1.140")
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        _, _, (entry,) = broker.enqueue(keys, [request(2, [1], thread_inbox)], 0)
        stream = keys.stream("default")
        assert broker.cancel(keys, stream, entry, 1, 2, inbox_key(prefix, "c1")) is True
        assert redis_client.xlen(stream) == 0


def test_the_admission_counter_never_goes_below_zero(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    keys = Keys(prefix, "counted")
    inbox = RawInbox(redis_client, prefix)
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        _, _, (entry,) = broker.enqueue(keys, [request(1, [1, 2, 3], inbox)], 0)
        redis_client.set(keys.queued, 1)  # written by anyone: less than the request holds
        assert broker.cancel(keys, keys.stream("default"), entry, 3, 1, inbox.key) is True
        assert int(redis_client.get(keys.queued) or 0) == 0


def test_a_forged_job_record_cancels_no_other_callers_request(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a victim's job waiting in its stream (the serving's worker is stopped)
    serving = Recording(name="victims", batch_size=4, batch_timeout=0)
    start_worker(serving).stop(timeout=10)
    keys = Keys(prefix, "victims")
    with qs.Client(redis_url, prefix=prefix) as client:
        victim = client.submit("victims", ["mine"], keep=60)
        stream = keys.stream("default")
        wait_until(lambda: redis_client.xlen(stream) == 1, "the victim's request queued")
        ((entry, _),) = redis_client.xrange(stream)
        before = int(redis_client.get(keys.queued) or 0)
        # When an attacker writes a record that names the victim's entry, with 2**26 items
        forged = "attacker0000000000-1"
        group, rid = J.job_place(prefix, forged)
        redis_client.hset(
            group,
            mapping={rid: f"67108864:60000:victims:{entry.decode()}:{stream}", "live": 1},
        )
        # and cancels it
        client.job(forged).cancel()
        # Then the victim's entry is still queued and counted as it was
        assert redis_client.xlen(stream) == 1
        assert int(redis_client.get(keys.queued) or 0) == before
        # and its job runs once a worker comes
        start_worker(serving)
        assert victim.result(WAIT_S) == ["mine"]

"""What callers get when things go wrong: remote errors, poison items, admission, deadlines,
cancellation (docs/design.md §2, §5), against a real worker and Redis."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

import queueserve as qs
from tests.support.helpers import stream_key, wait_until
from tests.support.servings import Recording, fail_on_negative, tag_items

RESULT_WAIT_S = 10.0

StartWorker = Callable[..., qs.Worker]
Pending = Callable[..., int]


def queued(redis_client: redis.Redis, prefix: str, serving: str) -> int:
    """The serving's admission counter: items admitted and not acked yet."""
    return int(redis_client.get(f"{prefix}:{{{serving}}}:queued") or 0)


# --- remote errors and poison isolation ------------------------------------------------------


def test_remote_exception_becomes_remote_error(
    start_worker: StartWorker, client: qs.Client
) -> None:
    start_worker(Recording(fail_on_negative, name="poison", batch_size=10, batch_timeout=0.005))

    with pytest.raises(qs.RemoteError) as info:
        client.dispatch("poison", -3, timeout=RESULT_WAIT_S)

    e = info.value
    assert isinstance(e, qs.QueueServeError)
    assert e.remote_type == "ValueError"
    assert e.remote_message == "negative item -3 is not allowed"
    assert "fail_on_negative" in e.remote_traceback
    assert "ValueError: negative item -3" in e.remote_traceback
    assert "ValueError" in str(e) and "negative item -3" in str(e)


def test_return_exceptions_puts_errors_in_place(
    start_worker: StartWorker, client: qs.Client
) -> None:
    start_worker(Recording(fail_on_negative, name="poison", batch_size=10, batch_timeout=0.005))

    results = client.dispatch_many(
        "poison", [1, -2, 3, -4], timeout=RESULT_WAIT_S, return_exceptions=True
    )

    assert results[0] == 10 and results[2] == 30
    for pos, value in ((1, -2), (3, -4)):
        error = results[pos]
        assert isinstance(error, qs.RemoteError), error
        assert error.remote_message == f"negative item {value} is not allowed"
    # without return_exceptions the first error is raised
    with pytest.raises(qs.RemoteError, match="negative item -2"):
        client.dispatch_many("poison", [1, -2, 3, -4], timeout=RESULT_WAIT_S)


def test_isolate_fails_only_the_poison_item_of_one_request(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a batch of exactly 10 items (one request) with one poison item, on_error="isolate"
    serving = Recording(fail_on_negative, name="poison", batch_size=10, batch_timeout=3600)
    assert serving.on_error == "isolate"
    start_worker(serving)
    items = [1, 2, 3, 4, 5, 6, -7, 8, 9, 10]

    results = client.dispatch_many(serving, items, timeout=RESULT_WAIT_S, return_exceptions=True)

    # Then only the poison item fails; every healthy item gets its result
    assert serving.item_batches[0] == items  # they did run as one batch first
    for x, r in zip(items, results, strict=True):
        if x < 0:
            assert isinstance(r, qs.RemoteError) and r.remote_message.startswith("negative item")
        else:
            assert r == x * 10


def test_isolate_fails_only_the_caller_with_the_poison_item(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given ten callers whose single items make one batch of 10, one of them poison
    serving = Recording(fail_on_negative, name="poison", batch_size=10, batch_timeout=3600)
    start_worker(serving)
    items = [1, 2, 3, -4, 5, 6, 7, 8, 9, 10]
    tickets = [client.submit(serving, [x]) for x in items]

    # Then only that caller gets the error
    for x, ticket in zip(items, tickets, strict=True):
        if x < 0:
            with pytest.raises(qs.RemoteError, match="negative item -4"):
                ticket.result(RESULT_WAIT_S)
        else:
            assert ticket.result(RESULT_WAIT_S) == [x * 10]
    assert sorted(serving.item_batches[0]) == sorted(items)


def test_on_error_fail_fails_the_whole_batch(start_worker: StartWorker, client: qs.Client) -> None:
    serving = Recording(
        fail_on_negative, name="failall", batch_size=4, batch_timeout=3600, on_error="fail"
    )
    start_worker(serving)
    healthy = client.submit(serving, [1, 2])
    poisoned = client.submit(serving, [3, -4])

    for ticket in (healthy, poisoned):
        results = ticket.result(RESULT_WAIT_S, return_exceptions=True)
        assert all(isinstance(r, qs.RemoteError) for r in results), results
        assert all(r.remote_message == "negative item -4 is not allowed" for r in results)
    assert serving.item_batches == [[1, 2, 3, -4]]  # run once, not bisected


# --- admission: QueueFull --------------------------------------------------------------------


def test_queue_full_rejects_past_max_queue_items_without_counting_them(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a serving with max_queue=5 whose executor is held, so nothing is acked
    serving = Recording(
        tag_items, name="bounded", batch_size=10, batch_timeout=0.005, max_queue=5, gated=True
    )
    start_worker(serving)

    # When requests of 3, 3, 2 and 1 items arrive (by name: the worker declared the limit)
    first = client.submit("bounded", [1, 2, 3])
    with pytest.raises(qs.QueueFull) as info:
        client.dispatch_many("bounded", [4, 5, 6], timeout=RESULT_WAIT_S)
    second = client.submit("bounded", [7, 8])
    with pytest.raises(qs.QueueFull):
        client.dispatch("bounded", 9, timeout=RESULT_WAIT_S)

    # Then the ones passing 5 items are rejected, with a message naming the limit
    assert isinstance(info.value, qs.QueueServeError)
    assert "max_queue=5" in str(info.value) and "bounded" in str(info.value)
    # and rejected requests did not inflate the counter, nor reach the stream
    assert queued(redis_client, prefix, "bounded") == 5
    assert redis_client.xlen(stream_key(prefix, "bounded")) == 2

    # When the executor is released, the admitted ones are answered and the room comes back
    serving.release()
    assert first.result(RESULT_WAIT_S) == ["r:1", "r:2", "r:3"]
    assert second.result(RESULT_WAIT_S) == ["r:7", "r:8"]
    wait_until(lambda: queued(redis_client, prefix, "bounded") == 0, what="the counter to drop")
    assert client.dispatch_many("bounded", [10, 11, 12, 13, 14], timeout=RESULT_WAIT_S) == [
        "r:10",
        "r:11",
        "r:12",
        "r:13",
        "r:14",
    ]
    assert 4 not in serving.items_run and 9 not in serving.items_run


def test_queue_full_without_a_worker_uses_the_serving_objects_limit(
    client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given no worker at all, and the Serving object (it carries max_queue=5)
    serving = qs.Serving(tag_items, name="nowork", batch_size=10, max_queue=5)
    admitted = [client.submit(serving, [i]) for i in range(5)]

    with pytest.raises(qs.QueueFull, match="max_queue=5"):
        client.dispatch(serving, 99, timeout=RESULT_WAIT_S)

    assert queued(redis_client, prefix, "nowork") == 5
    assert not any(t.done() for t in admitted)


def test_a_request_larger_than_max_queue_is_rejected_whole(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    start_worker(Recording(tag_items, name="small", batch_size=10, max_queue=5))

    with pytest.raises(qs.QueueFull, match="this call has 6"):
        client.dispatch_many("small", list(range(6)), timeout=RESULT_WAIT_S)
    assert queued(redis_client, prefix, "small") == 0
    assert client.dispatch_many("small", list(range(5)), timeout=RESULT_WAIT_S) == [
        f"r:{i}" for i in range(5)
    ]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_call_cut_into_requests_is_admitted_whole_or_refused_whole(
    kind: str,
    start_worker: StartWorker,
    client: qs.Client,
    redis_url: str,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a serving of batch_size 2 and max_queue 5: a call of 6 items goes as 3 requests,
    # of which the first two would fit
    serving = Recording(tag_items, name="cutfull", batch_size=2, max_queue=5)
    start_worker(serving)
    client.dispatch("cutfull", 0, timeout=RESULT_WAIT_S)  # the client learns the declaration

    # When the call is sent
    if kind == "sync":
        with pytest.raises(qs.QueueFull, match="this call has 6"):
            client.dispatch_many("cutfull", list(range(1, 7)), timeout=RESULT_WAIT_S)
    else:

        async def call() -> None:
            async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
                with pytest.raises(qs.QueueFull, match="this call has 6"):
                    await aclient.dispatch_many("cutfull", list(range(1, 7)), timeout=RESULT_WAIT_S)

        asyncio.run(call())

    # Then none of it was admitted, nor ran: refused whole, as one request of 6 would be
    assert queued(redis_client, prefix, "cutfull") == 0
    assert serving.items_run == [0]
    # and a call that fits runs whole
    assert client.dispatch_many("cutfull", [7, 8, 9], timeout=RESULT_WAIT_S) == [
        "r:7",
        "r:8",
        "r:9",
    ]


# --- deadlines: Timeout ----------------------------------------------------------------------


def test_timeout_without_a_worker_says_none_is_alive(client: qs.Client) -> None:
    with pytest.raises(qs.Timeout) as info:
        client.dispatch("nobody", 1, timeout=0.3)

    assert isinstance(info.value, qs.QueueServeError)
    message = str(info.value)
    assert "'nobody'" in message and "0.3s" in message
    assert "no worker is alive" in message


def test_timeout_with_a_busy_worker_says_workers_are_alive(
    start_worker: StartWorker, client: qs.Client
) -> None:
    start_worker(Recording(tag_items, name="busy", batch_size=4, batch_timeout=0, gated=True))

    with pytest.raises(qs.Timeout) as info:
        client.dispatch("busy", 1, timeout=0.3)

    message = str(info.value)
    assert "1 worker(s) alive" in message, message
    assert "no worker is alive" not in message


def test_expired_request_held_by_the_worker_is_never_executed(
    start_worker: StartWorker,
    client: qs.Client,
    pending: Pending,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given an executor busy with a first batch
    serving = Recording(tag_items, name="late", batch_size=4, batch_timeout=0.005)
    start_worker(serving)
    serving.hold()
    blocker = client.submit(serving, ["blocker"])
    wait_until(lambda: serving.batches, what="the blocker batch to start")

    # When a request with a short deadline is read by the worker, and its deadline passes
    doomed = client.submit(serving, ["doomed"], timeout=0.5)
    wait_until(lambda: pending("late") == 2, what="the worker to read the doomed request")
    with pytest.raises(qs.Timeout):
        doomed.result()
    serving.release()

    # Then the worker goes on, never runs the expired item, and acks it
    assert blocker.result(RESULT_WAIT_S) == ["r:blocker"]
    assert client.dispatch(serving, "after", timeout=RESULT_WAIT_S) == "r:after"
    assert "doomed" not in serving.items_run
    wait_until(
        lambda: redis_client.xlen(stream_key(prefix, "late")) == 0, what="the stream to empty"
    )


def test_request_expired_before_any_worker_read_it_is_never_executed(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a request whose deadline passed while no worker was running
    serving = Recording(tag_items, name="early", batch_size=4, batch_timeout=0.005)
    doomed = client.submit(serving, ["doomed"], timeout=0.2)
    with pytest.raises(qs.Timeout, match="no worker is alive"):
        doomed.result()

    # When a worker starts
    start_worker(serving)

    # Then it drops the expired request and serves the next
    assert client.dispatch(serving, "fresh", timeout=RESULT_WAIT_S) == "r:fresh"
    assert serving.items_run == ["fresh"]
    wait_until(lambda: queued(redis_client, prefix, "early") == 0, what="the counter to drop")


# --- cancellation ----------------------------------------------------------------------------


def test_cancelled_before_any_worker_read_it_never_runs(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a request sent while no worker runs
    serving = Recording(tag_items, name="cancel", batch_size=4, batch_timeout=0.005)
    ticket = client.submit(serving, ["gone", "too"])

    # When it is cancelled
    assert ticket.cancel() is True

    # Then it leaves the queue, a worker started later never runs it, and result() says why
    assert queued(redis_client, prefix, "cancel") == 0
    start_worker(serving)
    assert client.dispatch(serving, "kept", timeout=RESULT_WAIT_S) == "r:kept"
    assert serving.items_run == ["kept"]
    assert ticket.done()
    with pytest.raises(qs.Cancelled):
        ticket.result(RESULT_WAIT_S)


def test_cancel_after_a_worker_read_it_returns_false_and_drops_the_result(
    start_worker: StartWorker, client: qs.Client, pending: Pending
) -> None:
    # Given a request the worker has read while its executor is busy
    serving = Recording(tag_items, name="held", batch_size=4, batch_timeout=0.005)
    start_worker(serving)
    serving.hold()
    blocker = client.submit(serving, ["blocker"])
    wait_until(lambda: serving.batches, what="the blocker batch to start")
    ticket = client.submit(serving, ["held"])
    wait_until(lambda: pending("held") == 2, what="the worker to read the request")

    # When it is cancelled, cancel() says it may still run
    assert ticket.cancel() is False
    serving.release()

    # Then its caller gets Cancelled, whatever the worker does with it
    assert blocker.result(RESULT_WAIT_S) == ["r:blocker"]
    assert client.dispatch(serving, "next", timeout=RESULT_WAIT_S) == "r:next"
    with pytest.raises(qs.Cancelled):
        ticket.result(RESULT_WAIT_S)


class HeldSend:
    """Patches a client's enqueue so that its first send, once Redis answered it, waits for
    the test (``on_its_way``, then ``go_on``) before the client reads the entry ids: a cancel
    meanwhile finds the request sent and not yet placed."""

    def __init__(self, client: qs.Client, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on_its_way = threading.Event()
        self.go_on = threading.Event()
        real = client._broker.enqueue

        def enqueue_then_wait(*args: Any, **kwargs: Any) -> Any:
            reply = real(*args, **kwargs)
            if not self.on_its_way.is_set():
                self.on_its_way.set()
                assert self.go_on.wait(RESULT_WAIT_S), "the test never let the send go on"
            return reply

        monkeypatch.setattr(client._broker, "enqueue", enqueue_then_wait)


@pytest.mark.parametrize("read_first", [False, True], ids=["unread", "read"])
def test_a_request_cancelled_while_its_send_is_on_its_way_never_runs(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    pending: Pending,
    monkeypatch: pytest.MonkeyPatch,
    read_first: bool,
) -> None:
    # Given a request whose send Redis answered, and whose entry id the client has not read
    # yet (unread by any worker, or already read ahead of a busy executor)
    serving = Recording(tag_items, name="onway", batch_size=1, batch_timeout=0, gated=True)
    blocker = worker = None
    if read_first:
        worker = start_worker(serving)
        blocker = client.submit(serving, ["blocker"])
        wait_until(lambda: serving.batches, what="the blocker batch to start")
    send = HeldSend(client, monkeypatch)
    ticket = client.submit(serving, ["cancelled"])
    assert send.on_its_way.wait(RESULT_WAIT_S)
    if read_first:
        wait_until(lambda: pending("onway") == 2, what="the worker to read it ahead")

    # When its caller cancels it then (cancel() cannot know yet: False), and the send goes on
    assert ticket.cancel() is False
    send.go_on.set()

    # Then the send withdraws it as it learns its entry: the worker never runs it, and its
    # caller gets Cancelled (it used to run: the cancel found no entry to name and was lost)
    if worker is None:
        wait_until(lambda: queued(redis_client, prefix, "onway") == 0, what="it to leave")
        start_worker(serving)
    else:
        ledger = worker._host.runners[0].ledger  # type: ignore[union-attr]
        wait_until(lambda: ledger.cancelled, what="the worker to learn of the cancel")
    serving.release()
    if blocker is not None:
        assert blocker.result(RESULT_WAIT_S) == ["r:blocker"]
    assert client.dispatch(serving, "next", timeout=RESULT_WAIT_S) == "r:next"
    with pytest.raises(qs.Cancelled):
        ticket.result(RESULT_WAIT_S)
    assert serving.items_run == (["blocker"] if read_first else []) + ["next"]
    wait_until(lambda: pending("onway") == 0, what="the worker to ack everything")


def test_a_late_withdrawal_that_redis_refuses_is_logged_and_the_sender_lives_on(
    start_worker: StartWorker,
    client: qs.Client,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a request cancelled while its send is on its way, and Redis failing as the send
    # then withdraws it
    serving = Recording(tag_items, name="onway2", batch_size=1, batch_timeout=0)
    send = HeldSend(client, monkeypatch)
    ticket = client.submit(serving, ["cancelled"])
    assert send.on_its_way.wait(RESULT_WAIT_S)
    assert ticket.cancel() is False

    def refused(*args: Any, **kwargs: Any) -> bool:
        raise qs.RedisUnavailable("injected: Redis went away")

    monkeypatch.setattr(client._broker, "cancel", refused)
    with caplog.at_level(logging.WARNING, logger="queueserve.client"):
        send.go_on.set()
        # Then the caller has its Cancelled, the failure is said once, naming the request,
        # and the sender sends on: the request runs (its result dropped), the next is answered
        with pytest.raises(qs.Cancelled):
            ticket.result(RESULT_WAIT_S)
        start_worker(serving)
        assert client.dispatch(serving, "next", timeout=RESULT_WAIT_S) == "r:next"
    said = [r.getMessage() for r in caplog.records if "was not withdrawn" in r.getMessage()]
    assert len(said) == 1 and "injected: Redis went away" in said[0], said
    wait_until(lambda: serving.items_run == ["cancelled", "next"], what="both to run")


def test_a_bug_while_sending_fails_those_callers_at_once_and_the_sender_lives_on(
    start_worker: StartWorker,
    client: qs.Client,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a client whose next send hits a bug (not a Redis failure)
    serving = Recording(tag_items, name="tag", batch_size=8, batch_timeout=0)
    start_worker(serving)
    real = client._broker.enqueue
    broken = [True]

    def enqueue_once_broken(*args: Any, **kwargs: Any) -> Any:
        if broken.pop() if broken else False:
            raise ValueError("a bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(client._broker, "enqueue", enqueue_once_broken)

    # When a request goes out through the sender thread
    doomed = client.submit(serving, ["a"], timeout=RESULT_WAIT_S)

    # Then its caller gets the error at once, and the thread sends the next request
    with pytest.raises(qs.QueueServeError, match="could not be sent: ValueError: a bug"):
        doomed.result()
    assert client.submit(serving, ["b"], timeout=RESULT_WAIT_S).result() == ["r:b"]

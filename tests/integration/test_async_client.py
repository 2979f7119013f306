"""``qs.AsyncClient``: the sync client's methods, awaitable, over the asyncio broker:
submit/result, cancel, timeouts and riding out Redis faults (restart, UNBLOCKED, dropped
connections), with the outage logged once at each end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis

import queueserve as qs
from tests.support.helpers import wait_until
from tests.support.redis_server import RedisServer
from tests.support.servings import Recording, tag_items

StartWorker = Callable[..., qs.Worker]


def run(coro: Callable[[qs.AsyncClient], Coroutine[Any, Any, Any]], url: str, prefix: str) -> Any:
    async def main() -> Any:
        async with qs.AsyncClient(url, prefix=prefix) as client:
            return await coro(client)

    return asyncio.run(main())


def outage_lines(caplog: pytest.LogCaptureFixture, owner: str) -> list[str]:
    return [
        r.levelname
        for r in caplog.records
        if r.name == "queueserve.broker.retry"
        and r.getMessage().startswith(f"queueserve client {owner}:")
    ]


def test_dispatch_submit_map_and_errors(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    serving = Recording(tag_items, name="tag", batch_size=8, batch_timeout=0.005)
    start_worker(serving)

    async def use(client: qs.AsyncClient) -> dict[str, Any]:
        ticket = await client.submit(serving, ["a", "b"], timeout=30)
        return {
            "dispatch": await client.dispatch("tag", "x", timeout=30),
            "many": await client.dispatch_many(serving, ["y", "z"], timeout=30),
            "ticket": await ticket.result(),
            "done": ticket.done(),
            "map": [r async for r in client.map(serving, range(20), chunk_size=3, timeout=30)],
        }

    got = run(use, redis_url, prefix)
    assert got["dispatch"] == "r:x"
    assert got["many"] == ["r:y", "r:z"]
    assert got["ticket"] == ["r:a", "r:b"] and got["done"]
    assert got["map"] == [f"r:{i}" for i in range(20)]


def test_remote_errors_raise_or_come_back_per_item(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    def fail_odd(xs: list[int]) -> list[int]:
        if any(x % 2 for x in xs):
            raise ValueError(f"odd item in {xs}")
        return xs

    serving = qs.Serving(fail_odd, name="even", batch_size=4, batch_timeout=0.005)
    start_worker(serving)

    async def use(client: qs.AsyncClient) -> list[Any]:
        with pytest.raises(qs.RemoteError, match="odd item"):
            await client.dispatch(serving, 1, timeout=30)
        return await client.dispatch_many(serving, [2, 3], timeout=30, return_exceptions=True)

    two, three = run(use, redis_url, prefix)
    assert two == 2
    assert isinstance(three, qs.RemoteError) and three.remote_type == "ValueError"


def test_cancel_withdraws_a_queued_request_that_then_never_runs(
    start_worker: StartWorker,
    redis_url: str,
    prefix: str,
    pending: Callable[..., int],
) -> None:
    # Given an executor busy with a gated batch, one request read ahead of it and one queued
    serving = Recording(name="held", batch_size=1, batch_timeout=0, gated=True)
    start_worker(serving)

    async def use(client: qs.AsyncClient) -> dict[str, Any]:
        blocker = await client.submit(serving, ["blocker"], timeout=30)
        await asyncio.to_thread(wait_until, lambda: serving.batches, "the blocker to run")
        read_ahead = await client.submit(serving, ["read ahead"], timeout=30)
        await asyncio.to_thread(
            wait_until, lambda: pending("held") == 2, "the worker to read ahead"
        )
        queued = await client.submit(serving, ["queued"], timeout=30)
        # When the caller cancels the queued request
        never_runs = await queued.cancel()
        with pytest.raises(qs.Cancelled):
            await queued.result()
        serving.release()
        done = [await blocker.result(), await read_ahead.result()]
        return {
            "never_runs": never_runs,
            "again": await queued.cancel(),
            "after_done": await blocker.cancel(),
            "done": done,
        }

    got = run(use, redis_url, prefix)
    # Then it is withdrawn, its caller gets Cancelled, and the worker never runs it
    assert got["never_runs"] and not got["again"] and not got["after_done"]
    assert got["done"] == [["blocker"], ["read ahead"]]
    wait_until(lambda: pending("held") == 0, "the worker to ack everything")
    assert serving.items_run == ["blocker", "read ahead"]


def test_a_request_cancelled_while_another_callers_send_carries_it_never_runs(
    start_worker: StartWorker,
    redis_url: str,
    prefix: str,
    pending: Callable[..., int],
) -> None:
    # Given an executor busy with a gated batch, and a request that another caller's send
    # carries to Redis, read ahead by the worker before the client has read its entry id
    # (batches of two: the worker reads a batch of two ahead of its one executor)
    serving = Recording(name="onway", batch_size=2, batch_timeout=0, gated=True)
    worker = start_worker(serving)

    async def use(client: qs.AsyncClient) -> list[Any]:
        blocker = await client.submit(serving, ["blocker"], timeout=30)
        await asyncio.to_thread(wait_until, lambda: serving.batches, "the blocker to run")
        real = client._broker.enqueue
        first_sending, on_its_way, go_on = asyncio.Event(), asyncio.Event(), asyncio.Event()
        sends = []

        async def enqueue_then_wait(*args: Any, **kwargs: Any) -> Any:
            sends.append(args)
            first_sending.set()
            reply = await real(*args, **kwargs)
            if len(sends) == 2:  # the send that carries the second caller's request
                on_its_way.set()
                await go_on.wait()
            return reply

        client._broker.enqueue = enqueue_then_wait  # type: ignore[method-assign]
        first = asyncio.create_task(client.submit(serving, ["first"], timeout=30))
        await asyncio.wait_for(first_sending.wait(), 30)  # the first caller waits for Redis
        carried = await client.submit(serving, ["cancelled"], timeout=30)  # queued: it is sent
        await asyncio.wait_for(on_its_way.wait(), 30)
        await asyncio.to_thread(wait_until, lambda: pending("onway") == 3, "the reads ahead")
        # When its caller cancels it then (False: cancel() cannot know yet), and the send goes on
        cancelled = await carried.cancel()
        go_on.set()
        ledger = worker._host.runners[0].ledger  # type: ignore[union-attr]
        await asyncio.to_thread(wait_until, lambda: ledger.cancelled, "the worker to hear it")
        serving.release()
        with pytest.raises(qs.Cancelled):
            await carried.result()
        return [cancelled, await blocker.result(), await (await first).result()]

    # Then the send withdraws it as it learns its entry: the worker never runs it
    assert run(use, redis_url, prefix) == [False, ["blocker"], ["first"]]
    wait_until(lambda: pending("onway") == 0, "the worker to ack everything")
    assert serving.items_run == ["blocker", "first"]


def test_timeouts_say_whether_a_worker_is_alive(redis_url: str, prefix: str) -> None:
    async def use(client: qs.AsyncClient) -> None:
        # A request's own deadline: it is over, and the caller is told no worker is alive
        with pytest.raises(qs.Timeout, match="no worker is alive"):
            await client.dispatch("nobody", 1, timeout=0.2)
        # A shorter wait on a ticket: the request itself is still live afterwards
        ticket = await client.submit("nobody", [1], timeout=30)
        with pytest.raises(qs.Timeout, match=r"within 0\.1s"):
            await ticket.result(timeout=0.1)
        assert not ticket.done()

    run(use, redis_url, prefix)


def test_a_cancelled_wait_leaves_the_ticket_to_be_awaited_again(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    # Given a request whose batch is held back, and a caller task awaiting its result
    serving = Recording(tag_items, name="held", batch_size=1, batch_timeout=0, gated=True)
    start_worker(serving)

    async def use(client: qs.AsyncClient) -> list[Any]:
        ticket = await client.submit(serving, ["x"], timeout=30)
        await asyncio.to_thread(wait_until, lambda: serving.batches, "the batch to start")
        waiter = asyncio.create_task(ticket.result())
        await asyncio.sleep(0)  # its first step runs: it awaits the answer
        # When that task is cancelled, and another wait times out, before the answer comes
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ticket.result(), 0.05)
        serving.release()
        # Then the ticket still gives its answer to whoever awaits it next
        return await ticket.result()

    assert run(use, redis_url, prefix) == ["r:x"]


def test_an_unblocked_inbox_read_does_not_end_the_reader(
    start_worker: StartWorker,
    redis_url: str,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    serving = Recording(tag_items, name="tag", batch_size=8, batch_timeout=0.005)
    start_worker(serving)

    async def use(client: qs.AsyncClient) -> list[Any]:
        first = await client.dispatch(serving, "before", timeout=30)

        def blocked_reads() -> list[int]:  # inbox reads (workers read with XREADGROUP)
            return [int(c["id"]) for c in redis_client.client_list() if c["cmd"] == "blmpop"]

        # What a REPLICAOF does to a blocked read: UNBLOCKED
        for reader in await asyncio.to_thread(wait_until, blocked_reads, "the inbox read"):
            redis_client.client_unblock(reader, error=True)
        return [first, await client.dispatch(serving, "after", timeout=30)]

    assert run(use, redis_url, prefix) == ["r:before", "r:after"]


@pytest.mark.timeout(120)
def test_the_client_rides_out_a_redis_restart_and_logs_it_once(
    start_worker: Any,
    redis_tmp_server: RedisServer,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="queueserve")
    url = redis_tmp_server.url
    serving = Recording(tag_items, name="tag", batch_size=8, batch_timeout=0.005)
    worker = qs.Worker([serving], redis_url=url, prefix=prefix, handle_signals=False).start()
    try:

        async def use(client: qs.AsyncClient) -> tuple[str, list[Any]]:
            assert await client.dispatch(serving, "before", timeout=30) == "r:before"
            # When Redis goes away (and comes back without its data) while requests are sent
            redis_tmp_server.stop()
            sending = [
                asyncio.ensure_future(client.dispatch(serving, f"during{i}", timeout=60))
                for i in range(5)
            ]
            await asyncio.to_thread(
                wait_until,
                lambda: "WARNING" in outage_lines(caplog, client.client_id),
                "the client to log the outage",
            )
            redis_tmp_server.start()
            return client.client_id, await asyncio.gather(*sending)

        client_id, results = run(use, url, prefix)
    finally:
        worker.stop(timeout=10)
    # Then every request is answered, and the outage was logged once at each end
    assert results == [f"r:during{i}" for i in range(5)]
    assert outage_lines(caplog, client_id) == ["WARNING", "INFO"]


def test_a_bug_while_sending_fails_those_callers_and_the_client_sends_on(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    serving = Recording(tag_items, name="tag", batch_size=8, batch_timeout=0)
    start_worker(serving)

    async def use(client: qs.AsyncClient) -> Any:
        # Given a client whose next send hits a bug (not a Redis failure)
        real = client._broker.enqueue
        broken = [True]

        async def enqueue_once_broken(*args: Any, **kwargs: Any) -> Any:
            if broken.pop() if broken else False:
                raise ValueError("a bug")
            return await real(*args, **kwargs)

        client._broker.enqueue = enqueue_once_broken  # type: ignore[method-assign]
        # Then its caller gets it as a queueserve error, and the next call is sent
        with pytest.raises(qs.QueueServeError, match="could not be sent: ValueError: a bug"):
            await client.dispatch(serving, "a", timeout=10)
        return await client.dispatch(serving, "b", timeout=10)

    assert run(use, redis_url, prefix) == "r:b"

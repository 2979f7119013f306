"""A durable serving's enqueue waits for a replica (up to DURABLE_WAIT_MS, then NotReplicated);
that wait never holds up the same client's sends to other servings (docs/guarantees.md,
"Durable enqueue"). Here Redis has no replica, and the wait is made long, so the order of
events proves it: the other serving's answer comes while the durable request still waits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import queueserve as qs
from queueserve.broker import common, replies
from tests.support.helpers import WAIT_S

StartWorker = Callable[..., qs.Worker]

WAIT_MS = 3000  # a durable enqueue waits this long here for the replica that never comes
# (under redis-py's socket timeout of 5 s)


@pytest.fixture
def long_durable_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (common, replies):
        monkeypatch.setattr(module, "DURABLE_WAIT_MS", WAIT_MS)


def servings() -> tuple[qs.Serving, qs.Serving]:
    durable = qs.Serving(lambda xs: xs, name="kept", durable=True)
    return durable, qs.Serving(lambda xs: [f"r:{x}" for x in xs], name="quick", batch_timeout=0)


def test_a_durable_wait_does_not_hold_up_other_servings_sends(
    long_durable_wait: None,
    start_worker: StartWorker,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a client sending to a durable serving on a Redis without replicas, and to a
    # plain serving that a worker runs
    durable, quick = servings()
    start_worker(quick)
    with qs.Client(redis_url, prefix=prefix) as client:
        # When a durable request is sent, and then plain calls
        waiting = client.submit(durable, ["x"])
        answers = [client.dispatch(quick, i) for i in range(3)]
        answered_first = not waiting.done()

        # Then the plain calls are answered while the durable one still waits for a replica
        assert answers == ["r:0", "r:1", "r:2"] and answered_first
        # and the durable one gets NotReplicated, as documented
        with pytest.raises(qs.NotReplicated, match=r"no replica acknowledged it within"):
            waiting.result(WAIT_S)


def test_an_async_durable_wait_does_not_hold_up_other_servings_sends(
    long_durable_wait: None,
    start_worker: StartWorker,
    redis_url: str,
    prefix: str,
) -> None:
    durable, quick = servings()
    start_worker(quick)

    async def scenario() -> None:
        async with qs.AsyncClient(redis_url, prefix=prefix) as client:
            waiting = await client.submit(durable, ["x"])
            answers = [await client.dispatch(quick, i) for i in range(3)]
            answered_first = not waiting.done()
            assert answers == ["r:0", "r:1", "r:2"] and answered_first
            with pytest.raises(qs.NotReplicated, match=r"no replica acknowledged it within"):
                await waiting.result(WAIT_S)

    asyncio.run(scenario())


@pytest.mark.parametrize("side", ["sync", "async"])
def test_an_answer_that_comes_before_the_replica_wait_ends_stands(
    long_durable_wait: None, start_worker: StartWorker, redis_url: str, prefix: str, side: str
) -> None:
    # Given a durable serving that a worker runs, on a Redis without replicas
    durable, _ = servings()
    start_worker(durable)
    # When a caller sends to it, the worker answers long before the wait for a replica ends
    if side == "sync":
        with qs.Client(redis_url, prefix=prefix) as client:
            answers = [client.dispatch(durable, i) for i in range(3)]
    else:

        async def calls() -> list[object]:
            async with qs.AsyncClient(redis_url, prefix=prefix) as client:
                return [await client.dispatch(durable, i) for i in range(3)]

        answers = asyncio.run(calls())
    # Then the calls return their answers (the requests ran: nothing is left to lose), as
    # docs/scaling.md says; only a call still unanswered when the wait ends gets NotReplicated
    assert answers == [0, 1, 2]

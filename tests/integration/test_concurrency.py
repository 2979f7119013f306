"""Many independent producers against one worker: threads, asyncio tasks and processes each get
exactly their own results, while the worker coalesces their items into shared batches."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import queueserve as qs
from tests.support.servings import Recording, client_process_job, tag_items

RESULT_WAIT_S = 30.0

StartWorker = Callable[..., qs.Worker]

THREADS = 20
TASKS = 20
CALLS_EACH = 40


def caller_of(item: str) -> str:
    """Items are ``"<caller>-<n>"``: the caller that sent it."""
    return item.rsplit("-", 1)[0]


def test_threads_and_async_tasks_each_get_their_own_results(
    start_worker: StartWorker, client: qs.Client, redis_url: str, prefix: str
) -> None:
    # Given one worker whose batches can hold items of many callers
    serving = Recording(tag_items, name="shared", batch_size=64, batch_timeout=0.01)
    start_worker(serving)

    # When 20 threads (one shared sync client) and 20 asyncio tasks (one async client) each
    # dispatch their own distinct values, one at a time and as small requests
    outcomes: dict[str, list[str]] = {}
    failures: list[BaseException] = []

    def thread_caller(caller: str) -> None:
        try:
            got = [
                client.dispatch("shared", f"{caller}-{i}", timeout=RESULT_WAIT_S)
                for i in range(CALLS_EACH)
            ]
            got += client.dispatch_many(
                "shared",
                [f"{caller}-{i}" for i in range(CALLS_EACH, CALLS_EACH + 5)],
                timeout=RESULT_WAIT_S,
            )
            outcomes[caller] = got
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    async def task_caller(aclient: qs.AsyncClient, caller: str) -> tuple[str, list[str]]:
        got = [
            await aclient.dispatch("shared", f"{caller}-{i}", timeout=RESULT_WAIT_S)
            for i in range(CALLS_EACH)
        ]
        got += await aclient.dispatch_many(
            "shared",
            [f"{caller}-{i}" for i in range(CALLS_EACH, CALLS_EACH + 5)],
            timeout=RESULT_WAIT_S,
        )
        return caller, got

    async def async_callers() -> list[tuple[str, list[str]]]:
        async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
            return await asyncio.gather(*(task_caller(aclient, f"task{t}") for t in range(TASKS)))

    threads = [
        threading.Thread(target=thread_caller, args=(f"thread{t}",), name=f"caller{t}")
        for t in range(THREADS)
    ]
    for t in threads:
        t.start()
    try:
        from_tasks = asyncio.run(async_callers())
    finally:
        for t in threads:
            t.join(timeout=2 * RESULT_WAIT_S)

    # Then every caller got exactly its own results, in order
    assert not failures, failures
    assert not any(t.is_alive() for t in threads)
    outcomes.update(from_tasks)
    assert len(outcomes) == THREADS + TASKS
    for caller, got in outcomes.items():
        assert got == [f"r:{caller}-{i}" for i in range(CALLS_EACH + 5)], caller

    # and each item ran exactly once
    ran = serving.items_run
    assert len(ran) == len(set(ran)) == (THREADS + TASKS) * (CALLS_EACH + 5)
    # and the worker coalesced items of different callers into shared batches
    batches = serving.item_batches
    assert max(len(items) for items in batches) > 1
    assert any(len({caller_of(x) for x in items}) > 1 for items in batches)
    assert any({caller_of(x)[:4] for x in items} == {"thre", "task"} for items in batches), (
        "no batch mixed sync and async callers"
    )


def test_client_processes_each_get_their_own_results(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    # Given one worker, and three client processes (spawned: fresh interpreters)
    serving = Recording(tag_items, name="procs", batch_size=32, batch_timeout=0.005)
    start_worker(serving)
    n = 60

    # When they dispatch concurrently, each its own values
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=3, mp_context=context) as pool:
        futures = [
            pool.submit(client_process_job, redis_url, prefix, "procs", caller, n)
            for caller in range(3)
        ]
        outcomes = [f.result(timeout=120) for f in futures]

    # Then each got exactly its own results, one by one and as one request
    assert sorted(caller for caller, _, _ in outcomes) == [0, 1, 2]
    for _caller, values, results in outcomes:
        expected = [f"r:{v}" for v in values]
        assert results == expected + expected
    ran = serving.items_run
    assert len(ran) == 3 * 2 * n
    assert {caller_of(x) for x in ran} == {"p0", "p1", "p2"}

"""A long-lived thread of a partition that dies of a bug takes its partition down at once
(issue 23, class 2; docs/guarantees.md "A dead thread ends its partition").

Real worker processes serve ``tests.support.thread_app``, whose setup() breaks one thread of the
partition process (``QS_TEST_BREAK``) once the test sets a key. The partition must log the
death CRITICAL with its traceback and exit with EXIT_THREAD_DIED; the supervisor restarts it;
what it held is reclaimed and answered. It must never live on half-dead: a reader that died while
an executor held its lent read used to wait for that read in a ``finally`` for ever, while the
heartbeat kept the partition looking alive and its sweeps and reclaims had stopped.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

import queueserve as qs
from queueserve.wire.keys import Keys
from queueserve.worker.watchdog import EXIT_THREAD_DIED
from tests.support.fault_app import WorkerProc, serving_consumer
from tests.support.helpers import WAIT_S, wait_until
from tests.support.step_app import expected
from tests.support.thread_app import Plain


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("serving", "broken", "thread", "item", "answer"),
    [
        # the reader dies while an idle executor holds its lent blocking read
        ("plain", "reader", r"reader", 3, [6]),
        # the reply of a request's batch raises (on the replier, or on the idle executor that
        # sends its own reply): that request is held by the dying partition
        ("plain", "reply", r"(replier|executor0)", 3, [6]),
        ("plain", "heartbeat", r"heartbeat", 3, [6]),
        # the cancel listener dies on the next message of its channel
        ("plain", "cancels", r"cancels", 3, [6]),
        # a step serving's executor dies with a request taken in
        ("steps", "stepper", r"stepper", {"n": 3}, [expected({"n": 3})]),
    ],
)
def test_a_thread_that_dies_of_a_bug_ends_its_partition_which_is_restarted_and_answers(
    redis_url: str,
    prefix: str,
    client: qs.Client,
    redis_client: redis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    serving: str,
    broken: str,
    thread: str,
    item: object,
    answer: object,
) -> None:
    # Given a worker whose partition will break its `broken` thread once told, warmed up
    monkeypatch.setenv("QS_TEST_BREAK", broken)
    worker = WorkerProc.one_partition(
        [f"tests.support.thread_app:{serving}"], redis_url, prefix, tmp_path / "worker.log"
    )
    try:
        first = serving_consumer(redis_client, prefix, serving, worker)
        [pid] = worker.partition_pids()
        assert client.dispatch_many(serving, [item], timeout=30) == answer
        # When the thread dies of a bug (for the reply and the stepper, on a request's way)
        redis_client.set(f"{prefix}:break", 1)
        held = client.submit(serving, [item], timeout=60)
        if broken == "cancels":
            redis_client.publish(Keys(prefix, serving).cancel, b"any message")
        # Then the partition says so, CRITICAL with the traceback, and exits with the
        # documented code; the supervisor starts a new one, which answers what the dead one
        # held, and serves on
        exited = f"partition 0 (pid {pid}) exited with code {EXIT_THREAD_DIED}"
        wait_until(lambda: exited in worker.output(), "the partition to exit", process=worker)
        log = worker.output()
        assert re.search(rf"CRITICAL .*{thread} thread died; ending the partition", log), log
        assert "Traceback" in log and "InjectedBug: injected bug" in log, log
        assert serving_consumer(redis_client, prefix, serving, worker) != first
        assert held.result(WAIT_S) == answer
        assert client.dispatch_many(serving, [item], timeout=30) == answer
        assert worker.alive
    finally:
        worker.kill_group()


def test_an_in_process_worker_whose_thread_died_stops_and_its_work_goes_to_another(
    start_worker: Callable[..., qs.Worker],
    client: qs.Client,
) -> None:
    # Given a worker started in this process (Worker.start(): it cannot exit for its
    # partition), whose reply path raises: the thread sending a reply dies, a request held
    first = start_worker(Plain())
    host = first._host
    assert host is not None
    runner = host.runners[0]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected bug in the reply path")

    runner._send = broken  # type: ignore[method-assign]
    held = client.submit("plain", [3], timeout=60)
    wait_until(lambda: not host.alive(), "a thread of the first worker to die")
    # When another worker serves the serving
    start_worker(Plain())
    # Then the first stopped heartbeating, so the other reclaims and answers what it held
    assert held.result(WAIT_S) == [6]
    assert client.dispatch_many("plain", [4], timeout=30) == [8]

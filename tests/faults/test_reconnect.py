"""docs/design.md §5 "Reconnects": workers and clients ride out a Redis restart (with AOF, so
accepted requests survive it) or dropped connections, with backoff and a log line; a caller waiting
through an outage gets its result, or a clear error at its deadline, never a hang.

Every test here runs against a private redis-server of its own, so restarting it or killing its
connections touches nobody else's tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import queueserve as qs
from tests.support.fault_app import WorkerProc, Workers, consumer_of, serving_consumer, start_gate
from tests.support.helpers import pending_requests, requests_in, stream_key, wait_until
from tests.support.redis_server import RedisServer, start_redis_server

RESULT_WAIT_S = 60.0


@pytest.fixture
def aof_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private Redis with AOF and appendfsync always: whatever it acknowledged survives a
    crash (SIGKILL) of the server."""
    server = start_redis_server(
        tmp_path / "redis", appendonly=True, extra_args=("--appendfsync", "always")
    )
    try:
        yield server
    finally:
        server.stop()


Connect = Callable[[str], tuple[Workers, qs.Client]]


@pytest.fixture
def connect(prefix: str, tmp_path: Path) -> Iterator[Connect]:
    """``connect(url)``: a place to start workers on ``url`` and a client of it, both closed
    after the test (before the Redis servers the test asked for earlier)."""
    made: list[tuple[Workers, qs.Client]] = []

    def make(url: str) -> tuple[Workers, qs.Client]:
        made.append((Workers(url, prefix, tmp_path), qs.Client(url, prefix=prefix)))
        return made[-1]

    yield make
    for workers, client in made:
        client.close()
        workers.close()


def started_worker(workers: Workers, url: str, prefix: str, serving: str) -> WorkerProc:
    worker = workers.start(serving, url=url)
    r = redis.Redis.from_url(url)
    try:
        serving_consumer(r, prefix, serving, worker)
    finally:
        r.close()
    return worker


def outage_logged(worker: WorkerProc) -> bool:
    return "is unavailable" in worker.output()


@pytest.mark.timeout(180)
def test_requests_accepted_before_a_redis_crash_are_answered_after_it(
    aof_server: RedisServer,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    connect: Connect,
) -> None:
    caplog.set_level(logging.INFO, logger="queueserve")
    url = aof_server.url
    workers, client = connect(url)
    r = redis.Redis.from_url(url)
    try:
        # Given a worker in the middle of a batch that waits for a gate, more requests queued
        # behind it (prefetched and still in the stream), and a caller with a short deadline
        worker = started_worker(workers, url, prefix, "held")
        running = client.submit("held", ["wait"])
        wait_until(lambda: b"wait" in r.lrange(f"{prefix}:fault:exec", 0, -1), "the batch")
        queued = [client.submit("held", [f"q{i}"]) for i in range(20)]
        short = client.submit("held", ["short"], timeout=1.5)
        wait_until(lambda: requests_in(r, stream_key(prefix, "held")) == 22, "all to be accepted")
        # (and the client to have read that: Redis may write XLEN's reply before the script's)
        wait_until(
            lambda: all(c.entry_id for t in [*queued, short] for c in t._each),
            "the client to hear they were accepted",
        )

        # When Redis crashes (SIGKILL), and the worker notices and says so
        aof_server.kill()
        wait_until(lambda: outage_logged(worker), "the worker to log the outage")

        # Then the caller with the short deadline gets a clear Timeout at its deadline
        with pytest.raises(qs.Timeout, match="Redis could not be asked"):
            short.result()

        # When Redis comes back (same port, its AOF replayed) and the batch may finish
        aof_server.start()
        r.set(f"{prefix}:fault:go", 1)

        # Then every request accepted before the crash is answered: the running batch, the
        # prefetched ones and the ones still in the stream
        assert running.result(RESULT_WAIT_S) == ["r:wait"]
        assert [t.result(RESULT_WAIT_S) for t in queued] == [[f"r:q{i}"] for i in range(20)]
        # and the expired one was never run
        wait_until(lambda: r.xlen(stream_key(prefix, "held")) == 0, "every entry acked")
        assert b"short" not in r.lrange(f"{prefix}:fault:exec", 0, -1)
        # and the client logged the outage and the recovery
        client_log = caplog.text
        assert "Redis unavailable" in client_log and "retrying" in client_log, client_log
        assert "is reachable again" in client_log, client_log
        assert worker.alive and "restarting" not in worker.output()
    finally:
        r.close()


def test_a_waiting_worker_logs_the_outage_and_the_recovery(
    aof_server: RedisServer,
    prefix: str,
    connect: Connect,
) -> None:
    url = aof_server.url
    workers, client = connect(url)
    # Given a worker waiting for requests
    worker = started_worker(workers, url, prefix, "sturdy")

    # When Redis restarts (keeping its data)
    aof_server.stop()
    wait_until(
        lambda: "Redis unavailable" in worker.output(), "the outage log line", process=worker
    )
    aof_server.start()

    # Then the worker says it is back, and serves
    wait_until(
        lambda: "Redis is reachable again" in worker.output(), "the recovery line", process=worker
    )
    assert client.dispatch("sturdy", "x", timeout=RESULT_WAIT_S) == "r:x"
    assert "retrying" in worker.output()


def test_a_partition_whose_start_meets_an_outage_waits_it_out_and_serves(
    aof_server: RedisServer,
    prefix: str,
    connect: Connect,
) -> None:
    url = aof_server.url
    workers, client = connect(url)
    gate = start_gate(prefix)
    try:
        # Given a worker whose partition is still loading its model (Redis answered the
        # supervisor's check already)
        worker = workers.start("late_start", url=url)
        wait_until(
            lambda: "partition 0 (cpu) started" in worker.output(),
            "the partition process",
            process=worker,
        )

        # When Redis is down just as the partition finishes loading and registers
        aof_server.stop()
        gate.touch()
        wait_until(
            lambda: "Redis unavailable" in worker.output(), "the outage log line", process=worker
        )
        aof_server.start()

        # Then the partition waits the outage out instead of stopping the worker, and serves
        assert client.dispatch("late-start", "x", timeout=RESULT_WAIT_S) == "r:x"
        assert worker.alive, worker.output()
    finally:
        gate.unlink(missing_ok=True)


@pytest.mark.timeout(120)
def test_a_worker_serves_again_after_redis_lost_its_data(
    redis_tmp_server: RedisServer,
    prefix: str,
    connect: Connect,
) -> None:
    url = redis_tmp_server.url
    workers, client = connect(url)
    # Given a worker, and a Redis without persistence
    worker = started_worker(workers, url, prefix, "sturdy")
    assert client.dispatch("sturdy", "before", timeout=RESULT_WAIT_S) == "r:before"

    # When Redis restarts empty (its streams and consumer groups are gone)
    redis_tmp_server.stop()
    wait_until(
        lambda: "Redis unavailable" in worker.output(), "the outage log line", process=worker
    )
    redis_tmp_server.start()

    # Then the worker still serves new requests
    assert client.dispatch("sturdy", "after", timeout=10) == "r:after"
    assert worker.alive


@pytest.mark.timeout(120)
def test_an_idle_worker_serves_on_after_redis_flushed_its_scripts(
    redis_tmp_server: RedisServer,
    prefix: str,
    connect: Connect,
) -> None:
    url = redis_tmp_server.url
    workers, client = connect(url)
    # Given an idle worker, whose next read went out behind its last reply
    worker = started_worker(workers, url, prefix, "sturdy")
    assert [client.dispatch("sturdy", f"a{i}", timeout=RESULT_WAIT_S) for i in range(5)] == [
        f"r:a{i}" for i in range(5)
    ]

    # When Redis forgets every script meanwhile (the read's, the ack's, the enqueue's)
    r = redis.Redis.from_url(url)
    r.script_flush()
    r.close()

    # Then each request is still answered with its own result
    assert [client.dispatch("sturdy", f"b{i}", timeout=RESULT_WAIT_S) for i in range(5)] == [
        f"r:b{i}" for i in range(5)
    ]
    assert worker.alive


@pytest.mark.timeout(120)
def test_a_busy_worker_logs_the_recovery_too(
    aof_server: RedisServer,
    prefix: str,
    connect: Connect,
) -> None:
    url = aof_server.url
    workers, client = connect(url)
    r = redis.Redis.from_url(url)
    try:
        # Given a worker running a gated batch with its prefetch full
        worker = started_worker(workers, url, prefix, "held")
        consumer = consumer_of(r, prefix, "held", worker.partition_pids()[0])
        running = client.submit("held", ["wait"])
        wait_until(lambda: b"wait" in r.lrange(f"{prefix}:fault:exec", 0, -1), "the batch")
        queued = [client.submit("held", [f"q{i}"]) for i in range(8)]
        wait_until(lambda: pending_requests(r, stream_key(prefix, "held")) == 9, "prefetch")

        # When Redis restarts under it
        aof_server.stop()
        wait_until(lambda: outage_logged(worker), "the outage log line")
        aof_server.start()
        wait_until(lambda: r.zscore(f"{prefix}:{{held}}:workers", consumer), "a heartbeat")
        r.set(f"{prefix}:fault:go", 1)
        assert running.result(RESULT_WAIT_S) == ["r:wait"]
        del queued

        # Then its log says Redis is back
        wait_until(
            lambda: "reachable again" in worker.output(), "the recovery log line", process=worker
        )
    finally:
        r.close()


@pytest.mark.timeout(120)
def test_a_caller_sending_while_redis_is_down_gets_an_error_at_its_deadline(
    tmp_path: Path,
    prefix: str,
) -> None:
    # Given a client whose Redis went away (the serving object: no lookup before the send)
    server = start_redis_server(tmp_path / "redis")
    client = qs.Client(server.url, prefix=prefix)
    serving = qs.Serving(lambda xs: xs, name="gone")
    outcome: list[BaseException | object] = []
    try:
        server.stop()

        # When a caller dispatches with a 1 s deadline
        def call() -> None:
            try:
                outcome.append(client.dispatch(serving, "x", timeout=1.0))
            except BaseException as e:
                outcome.append(e)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(6.0)  # six times its deadline

        # Then it has its answer by then: a queueserve error, never a hang
        assert not caller.is_alive(), "dispatch(timeout=1) still blocked after 6 s"
        assert isinstance(outcome[0], qs.Timeout | qs.RedisUnavailable), outcome
    finally:
        client.close()
        server.stop()


@pytest.mark.timeout(180)
def test_dropped_connections_are_ridden_out(
    redis_tmp_server: RedisServer,
    prefix: str,
    connect: Connect,
) -> None:
    url = redis_tmp_server.url
    workers, client = connect(url)
    admin = redis.Redis.from_url(url)
    answered: list[str] = []
    wrong: list[object] = []
    lock = threading.Lock()
    try:
        # Given a worker and four callers sending one request after another
        worker = started_worker(workers, url, prefix, "sturdy")

        def caller(c: int) -> None:
            for i in range(150):
                value = f"c{c}-{i}"
                try:
                    got = client.dispatch("sturdy", value, timeout=RESULT_WAIT_S)
                except qs.QueueServeError as e:
                    got = e
                with lock:
                    (answered if got == f"r:{value}" else wrong).append(got)

        callers = [threading.Thread(target=caller, args=(c,), daemon=True) for c in range(4)]
        for t in callers:
            t.start()

        # When every normal connection to Redis is killed, five times while they run
        killed = 0
        for k in range(5):
            wait_until(lambda k=k: len(answered) >= 100 * (k + 1), f"answers before kill {k}")
            killed += int(admin.execute_command("CLIENT", "KILL", "TYPE", "normal"))
        for t in callers:
            t.join(RESULT_WAIT_S * 2)

        # Then every caller got exactly its own answers, and the worker kept serving
        assert killed >= 5
        assert not wrong, wrong[:5]
        assert len(answered) == 600
        assert worker.alive and "restarting" not in worker.output()
        assert client.dispatch("sturdy", "after", timeout=RESULT_WAIT_S) == "r:after"
    finally:
        admin.close()

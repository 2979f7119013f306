"""The worker's metrics port under hostile clients (docs/guarantees.md, "Idle keys and metrics
cost nothing"; the port's writers are the ``http.metrics_server`` surface of
tests/faults/fuzz/, which tests/faults/test_fuzz.py also runs under traffic): bad paths,
methods, headers, requests, clients that reset before their answer, and more slow clients than
the server serves at once.
Every scrape is answered, within SCRAPE_WITHIN_S, and the worker's log holds no traceback. A key
of another type under one serving's name leaves the other servings' gauges and the probes'
answers.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from queueserve.wire.keys import Keys
from queueserve.worker.metrics_server import MAX_CONNECTIONS
from tests.faults.fuzz.surfaces import (
    HTTP_ATTACKS,
    SLOW_HELD,
    Target,
    http_slow,
    scrape,
    trickle,
)
from tests.faults.fuzz.values import FAMILIES
from tests.support.fault_app import WorkerProc
from tests.support.helpers import wait_until

SEED = 37
ROUNDS = 4  # of each attack with a value of each family
SCRAPES = 4  # while slow clients hold every place the server has


@pytest.fixture
def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def worker(redis_url: str, prefix: str, tmp_path: Path, port: int) -> Iterator[WorkerProc]:
    proc = WorkerProc(
        [
            *("tests.faults.fuzz.app:plain", "tests.faults.fuzz.app:victim"),
            *("--redis-url", redis_url, "--prefix", prefix, "--partitions", "1"),
            *("--metrics-port", str(port)),
        ],
        redis_url,
        prefix,
        tmp_path / "worker.log",
    )
    try:
        wait_until(lambda: _answers(port), "the metrics port", process=proc)
        yield proc
    finally:
        proc.kill_group()


def _answers(port: int) -> bool:
    try:
        return scrape(port, "/readyz")[0] == 200
    except AssertionError:
        return False


def _no_traceback(worker: WorkerProc) -> None:
    log = worker.output()
    assert worker.alive, log[-3000:]
    assert "Traceback" not in log, log[-5000:]


def test_hostile_requests_and_slow_clients_never_keep_a_scrape_out(
    worker: WorkerProc, redis_client: redis.Redis, prefix: str, port: int
) -> None:
    # Given a worker with a metrics port
    target = Target(redis_client, prefix, random.Random(SEED), metrics_port=port)
    try:
        # When every hostile request is sent with values of every family (the 10 MB one too)
        for attack in HTTP_ATTACKS:
            for family in FAMILIES.values():
                for _ in range(ROUNDS):
                    attack.write(target, family(target.rng))
        # and more slow clients than the server serves at once hold connections, each
        # sending a byte now and then (a silence timeout alone never drops them)
        while len(target.slow) < SLOW_HELD:
            http_slow(target, b"slow")
        assert SLOW_HELD > MAX_CONNECTIONS

        # Then every scrape among them is answered, at once
        for _ in range(SCRAPES):
            trickle(target)
            status, body = scrape(port)
            assert status == 200 and b"queueserve_queue_depth" in body, (status, body[:300])
            assert scrape(port, "/healthz")[0] == 200
    finally:
        target.close()

    # and the worker logged no traceback (a client that reset before its answer printed one)
    _no_traceback(worker)


def test_a_servings_key_of_another_type_leaves_the_others_gauges_and_the_probes_answer(
    worker: WorkerProc, redis_client: redis.Redis, prefix: str, port: int
) -> None:
    # Given a worker of two servings, whose dead letters are counted in its gauges
    plain, victim = Keys(prefix, "fz"), Keys(prefix, "fzx")

    # When one serving's dead-letter stream and workers set are made strings (anyone may)
    redis_client.set(victim.dead, "wrong type")
    redis_client.set(victim.workers, "wrong type")

    # Then a scrape still has the other serving's gauges (it failed whole: no answer at all)
    status, body = scrape(port)
    assert status == 200, (status, body[:300])
    assert f'queueserve_dead_letter_depth{{serving="{plain.name}"}}'.encode() in body
    assert f'queueserve_dead_letter_depth{{serving="{victim.name}"}}'.encode() not in body

    # and /readyz answers: not ready, since that serving's workers cannot be read
    assert scrape(port, "/readyz")[0] == 503
    assert scrape(port, "/healthz")[0] == 200
    _no_traceback(worker)

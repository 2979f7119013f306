"""Open endpoints cost what is asked, not what Redis holds (issue 38, finding 5;
docs/operations.md, "The servings registry" and "Dashboard").

Costs are counted, never timed: the commands Redis ran (``INFO commandstats``) on a server of
the test's own. The servings list comes from the registry workers keep (P:servings), never a
SCAN of the keyspace; the dashboard's overview reads a page of each serving's queues, the same
number of commands with 100,000 batch keys as with 100, and concurrent callers share one
computation. Timings live in bench/overview_cost.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from queueserve.broker.admin import Admin
from queueserve.broker.fleet import Fleet
from queueserve.dashboard.board import Board
from queueserve.dashboard.exporter import exposition
from queueserve.ops import cli
from tests.support.dashboard_proc import DashboardProc
from tests.support.fault_app import WorkerProc
from tests.support.gateway_app import GatewayProc
from tests.support.helpers import wait_until
from tests.support.listing_cost import (
    commands,
    declare,
    fill_batch_keys,
    ran,
    unrelated_keys,
)
from tests.support.redis_server import RedisServer

LARGE = 100_000
# (wire/timing.py's SERVINGS_FORGET_S and board.py's TOP_KEYS, written out: the tests run
# against code that predates them too)
FORGET_MS = 7 * 24 * 3600 * 1000
TOP_KEYS = 10


@pytest.fixture
def own(redis_tmp_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the test's own server: its command counts are this test's alone."""
    with contextlib.closing(redis.Redis.from_url(redis_tmp_server.url)) as r:
        yield r


def servings_key(prefix: str) -> str:
    return f"{prefix}:servings"  # wire/keys.py's servings_key


def score(r: redis.Redis, prefix: str, serving: str) -> float | None:
    return r.zscore(servings_key(prefix), serving)


def test_a_worker_keeps_its_servings_in_the_registry_and_they_age_out(
    redis_url: str, redis_client: redis.Redis, prefix: str, tmp_path: Path
) -> None:
    # Given a worker process serving square and cube
    worker = WorkerProc.one_partition(
        ["tests.support.cli_app:square", "tests.support.cli_app:cube"],
        redis_url,
        prefix,
        tmp_path / "worker.log",
    )
    admin = Admin(redis_url)
    try:
        # Then it lists both in the registry, and its heartbeat keeps refreshing them
        wait_until(lambda: score(redis_client, prefix, "cube"), "cube listed", process=worker)
        first = score(redis_client, prefix, "square")
        assert first is not None
        refreshed = lambda: (score(redis_client, prefix, "square") or 0) > first  # noqa: E731
        wait_until(refreshed, "a refresh", process=worker)
        assert admin.servings(prefix) == ["cube", "square"]
        listed, total = admin.listing(prefix)
        assert total == 2 and abs(listed["square"] - time.time() * 1000) < 10_000, listed
    finally:
        worker.kill_group()

    # When its workers are gone, the servings stay listed (with their last refresh)
    assert admin.servings(prefix) == ["cube", "square"]

    # and once an entry is older than SERVINGS_FORGET_S, no reader lists it
    now_ms = int(time.time() * 1000)
    registry = servings_key(prefix)
    redis_client.zadd(registry, {"square": now_ms - FORGET_MS - 60_000, "ghost": 1.0})
    assert admin.servings(prefix) == ["cube"]

    # and the next worker of the prefix drops such entries at its heartbeat
    worker = WorkerProc.one_partition(
        ["tests.support.cli_app:cube"], redis_url, prefix, tmp_path / "worker2.log"
    )
    try:
        wait_until(
            lambda: redis_client.zscore(registry, "ghost") is None, "ghost dropped", process=worker
        )
        assert redis_client.zscore(registry, "square") is None
        assert redis_client.zscore(registry, "cube") is not None
    finally:
        worker.kill_group()
        admin.close()


def test_hostile_registry_entries_are_skipped_and_reads_stay_bounded(
    own: redis.Redis, redis_tmp_server: RedisServer
) -> None:
    # Given a registry holding names no serving can have, forged scores and 20,000 entries
    prefix = "qsh"
    now_ms = int(time.time() * 1000)
    registry = servings_key(prefix)
    own.zadd(registry, {"good": now_ms, "a:b": now_ms, "x" * 201: now_ms, "{t}": now_ms})
    own.zadd(registry, {b"\xff\xfe": now_ms, "future": now_ms + 10 * FORGET_MS})
    own.zadd(registry, {f"s{i}": now_ms - 1000 for i in range(20_000)})
    admin = Admin(redis_tmp_server.url)
    try:
        listed, total = admin.listing(prefix, limit=50)
        # Then a read lists at most its limit, the newest first, and skips the forged ones
        assert len(listed) <= 50 and "good" in listed, sorted(listed)[:5]
        assert not {"a:b", "x" * 201, "{t}", "future"} & listed.keys()
        assert total >= 20_000
        # and a registry of another type lists nothing, without an error
        own.delete(registry)
        own.set(registry, "wrong type")
        assert admin.listing(prefix) == ({}, 0)
    finally:
        admin.close()


def test_models_list_issues_no_scan_with_many_unrelated_keys(
    own: redis.Redis, redis_tmp_server: RedisServer, tmp_path: Path
) -> None:
    # Given a serving a worker declared, and 100,000 keys of another application
    url = redis_tmp_server.url
    declare(own, "qsm", "square")
    unrelated_keys(own, LARGE)
    gateway = GatewayProc(url, "qsm", tmp_path / "gateway.log")
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            # When GET /v1/models is asked ten times
            before = commands(own)
            for _ in range(10):
                response = http.get("/v1/models")
                assert response.status_code == 200, response.text[:500]
            during = ran(before, commands(own))
        # Then it lists the serving, and Redis ran no SCAN (nor KEYS) for it, and a few
        # commands per call
        assert [m["id"] for m in response.json()["data"]] == ["square"]
        assert "scan" not in during and "keys" not in during, during
        assert sum(during.values()) <= 10 * 4, during
    finally:
        gateway.stop()


def overview_commands(own: redis.Redis, url: str, prefix: str) -> dict[str, int]:
    """The commands one computation of the dashboard's overview runs."""
    board = Board(Fleet(url), prefix)
    try:
        before = commands(own)
        overview = board.overview()
        after = commands(own)
    finally:
        board.fleet.close()
    [serving] = overview["servings"]
    assert serving["queues"] and "error" not in serving, serving
    return ran(before, after)


def test_the_overview_runs_as_many_commands_with_100000_batch_keys_as_with_100(
    own: redis.Redis, redis_tmp_server: RedisServer
) -> None:
    # Given a serving with 100 batch keys, each holding a queued request
    url, prefix = redis_tmp_server.url, "qso"
    declare(own, prefix, "square")
    fill_batch_keys(url, prefix, "square", 0, 100)
    small = overview_commands(own, url, prefix)

    # When it holds 100,000 such keys
    fill_batch_keys(url, prefix, "square", 100, LARGE - 100)
    large = overview_commands(own, url, prefix)

    # Then an overview runs no more commands than with 100 (within a constant: the streams
    # of the keys shown, which are the same page), and never a SCAN
    assert sum(large.values()) <= sum(small.values()) + 4 * TOP_KEYS, (small, large)
    assert "scan" not in large and "keys" not in large, large
    # and what it shows says how many there are
    board = Board(Fleet(url), prefix)
    try:
        [serving] = board.overview()["servings"]
    finally:
        board.fleet.close()
    counts = serving["queue_counts"]
    assert counts["keys_with_work"] == LARGE and counts["streams_waiting"] == LARGE, counts
    assert len({q["key"] for q in serving["queues"]}) <= 3 * TOP_KEYS, len(serving["queues"])
    assert serving["priorities"] == [
        {"priority": 0, "items": LARGE, "age_ms": serving["priorities"][0]["age_ms"]}
    ]


def test_concurrent_overview_callers_share_one_computation(
    own: redis.Redis, redis_tmp_server: RedisServer, tmp_path: Path
) -> None:
    # Given a dashboard over a serving with 1,000 batch keys holding work
    url, prefix = redis_tmp_server.url, "qsc"
    declare(own, prefix, "square")
    fill_batch_keys(url, prefix, "square", 0, 1000)
    proc = DashboardProc(url, prefix, tmp_path / "dashboard.log")
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            # (one caller's read of a page not read before: what one computation costs)
            before = commands(own)
            assert http.get("/api/overview?filter=squ").status_code == 200
            one = sum(ran(before, commands(own)).values())

            # When 12 callers read another page at once
            statuses: list[int] = []
            start = threading.Barrier(12)

            def read() -> None:
                start.wait()
                statuses.append(http.get("/api/overview?filter=squa").status_code)

            callers = [threading.Thread(target=read) for _ in range(12)]
            before = commands(own)
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join(60)
            many = sum(ran(before, commands(own)).values())
        # Then all are answered, and Redis ran one computation's commands, not twelve
        assert statuses == [200] * 12
        assert many <= one + one // 2, (one, many)
    finally:
        proc.stop()


def test_servings_of_workers_before_the_registry_are_named_and_listed_by_a_rebuild(
    redis_url: str, redis_client: redis.Redis, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a serving declared by a worker that predates the registry (its meta hash alone)
    redis_client.hset(f"{prefix}:{{old}}:meta", mapping={"codec": "msgpack", "batch_size": "4"})
    common = ["--redis-url", redis_url, "--prefix", prefix]

    # Then the listings do not show it, but naming it works (its own declaration is read)
    assert cli.main(["servings", *common]) == 0
    assert "old" not in capsys.readouterr().out
    assert cli.main(["config", "get", "old", *common]) == 0
    assert "batch_size = 4" in capsys.readouterr().out
    assert cli.main(["config", "get", "nosuch", *common]) == 1
    assert "no worker has declared serving 'nosuch'" in capsys.readouterr().err

    # When an operator rebuilds the registry, one SCAN lists it
    assert cli.main(["servings", "--rebuild", *common]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("old  refreshed "), out
    assert "listed 1 declared servings" in out.err
    assert redis_client.zscore(servings_key(prefix), "old") is not None


def exposition_commands(own: redis.Redis, url: str, prefix: str) -> tuple[dict[str, int], str]:
    """The commands one scrape of the dashboard's /metrics runs, and its text."""
    fleet = Fleet(url)
    try:
        before = commands(own)
        text = exposition(fleet, prefix).decode()
        return ran(before, commands(own)), text
    finally:
        fleet.close()


def test_the_dashboards_backlog_metric_runs_as_many_commands_with_100000_keys_as_with_one(
    own: redis.Redis, redis_tmp_server: RedisServer
) -> None:
    # Given a serving with no worker and one batch key holding a request
    url, prefix = redis_tmp_server.url, "qsb"
    declare(own, prefix, "square")
    fill_batch_keys(url, prefix, "square", 0, 1)
    small, text = exposition_commands(own, url, prefix)
    assert 'queueserve_queued_items{serving="square"} 1.0' in text, text

    # When it holds 100,000 keys with work
    fill_batch_keys(url, prefix, "square", 1, LARGE - 1)
    large, text = exposition_commands(own, url, prefix)

    # Then a scrape reports them all, with the same commands, and never a SCAN
    assert f'queueserve_queued_items{{serving="square"}} {float(LARGE)}' in text, text
    assert 'queueserve_live_workers{serving="square"} 0.0' in text, text
    assert large == small, (small, large)
    assert "scan" not in large and "keys" not in large, large

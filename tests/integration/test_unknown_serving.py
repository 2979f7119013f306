"""A call to a serving no worker ever declared under the prefix fails at once with
qs.UnknownServing naming the declared servings, closest first, unless the client waits for
its workers (wait_for_worker=True, QUEUESERVE_WAIT_FOR_WORKER)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import redis

import queueserve as qs
from tests.support.helpers import REPO, child_env, stream_key, wait_until
from tests.support.servings import tag_items

StartWorker = Callable[..., qs.Worker]


def servings(start_worker: StartWorker, *names: str) -> None:
    start_worker(*(qs.Serving(tag_items, name=n, batch_size=4, batch_timeout=0) for n in names))


def test_a_misspelled_serving_fails_at_once_naming_the_declared_ones_closest_first(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    servings(start_worker, "embed", "square", "summarize")
    with qs.Client(redis_url, prefix=prefix, wait_for_worker=False) as client:
        with pytest.raises(qs.UnknownServing) as raised:
            client.dispatch("sqaure", 2)
        message = str(raised.value)
        assert "no worker has declared a serving named 'sqaure'" in message
        assert "closest first: 'square', " in message and "'embed'" in message
        assert "wait_for_worker=True" in message
        # nothing was sent: its stream does not exist
        assert client.dispatch("square", 2) == "r:2"


async def test_the_async_client_fails_at_once_too(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    servings(start_worker, "square")
    async with qs.AsyncClient(redis_url, prefix=prefix, wait_for_worker=False) as client:
        with pytest.raises(qs.UnknownServing, match="closest first: 'square'"):
            await client.submit("squares", [1])
        assert await client.dispatch("square", 3) == "r:3"


def test_with_no_serving_declared_the_error_says_none_yet(redis_url: str, prefix: str) -> None:
    with (
        qs.Client(redis_url, prefix=prefix, wait_for_worker=False) as client,
        pytest.raises(qs.UnknownServing, match="declared servings, closest first: none yet"),
    ):
        client.submit("anything", [1])


def test_a_client_that_waits_for_its_worker_is_served_once_it_starts(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    with qs.Client(redis_url, prefix=prefix, wait_for_worker=True) as client:
        ticket = client.submit("later", ["a"])
        servings(start_worker, "later")
        assert ticket.result(timeout=30) == ["r:a"]


def test_stats_lists_requests_waiting_on_a_serving_no_worker_declared(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    servings(start_worker, "square")
    with qs.Client(redis_url, prefix=prefix, wait_for_worker=True) as client:
        client.submit("sqaure", [1, 2, 3])
        wait_until(lambda: redis_client.exists(stream_key(prefix, "sqaure")), "it is sent")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "queueserve",
                "stats",
                "--redis-url",
                redis_url,
                "--prefix",
                prefix,
                "--interval",
                "10ms",
            ],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    assert "'sqaure': 3 items waiting, and no worker ever declared this serving" in done.stdout, (
        done.stdout
    )
    assert "'square': " not in done.stdout


def test_what_is_sent_to_an_undeclared_serving_lives_at_most_key_idle_ttl(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    default_ttl_ms = int(qs.Serving(tag_items, name="x").key_idle_ttl * 1000)
    stream = stream_key(prefix, "unborn")
    with qs.Client(redis_url, prefix=prefix, wait_for_worker=True) as client:
        first = client.submit("unborn", ["a"])
        wait_until(lambda: redis_client.exists(stream), "it is sent")
        for key in (stream, f"{prefix}:{{unborn}}:queued", f"{prefix}:{{unborn}}:seen"):
            assert 0 < redis_client.pttl(key) <= default_ttl_ms, key
        # Once a worker declares it, the next send takes the TTLs off
        servings(start_worker, "unborn")
        assert first.result(timeout=30) == ["r:a"]
        assert client.dispatch("unborn", "b", timeout=30) == "r:b"
        for key in (stream, f"{prefix}:{{unborn}}:queued", f"{prefix}:{{unborn}}:seen"):
            assert redis_client.pttl(key) == -1, key

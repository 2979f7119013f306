"""Many models behind one serving, through a real worker: each batch runs with its own key's
state (``load_key``), a partition holds at most ``max_loaded_keys`` states and
``max_loaded_bytes``, a key whose batch is in flight is never evicted, every eviction is
followed by ``unload_key``, and a load that raises fails that key's requests alone and is tried
again (queueserve/key_states.py; docs/usage.md, "Many models behind one serving")."""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve import key_states
from tests.support.fault_app import Workers
from tests.support.helpers import WAIT_S, metric_sample, wait_until
from tests.support.key_app import Keyed

StartWorker = Callable[..., qs.Worker]


def answered_from_their_keys(client: qs.Client, keys: list[str], per_key: int) -> None:
    """Send ``per_key`` requests of each key, interleaved at random; every answer must be
    ``<key>:<item>``."""
    rng = random.Random(41)
    calls = [(key, f"{key}-{i}") for key in keys for i in range(per_key)]
    rng.shuffle(calls)
    tickets = [(key, item, client.submit("keyed", [item], batch_key=key)) for key, item in calls]
    for key, item, ticket in tickets:
        assert ticket.result(WAIT_S) == [f"{key}:{item}"]


def check_evictions(serving: Keyed) -> None:
    with serving.lock:
        assert not serving.problems, serving.problems
        # every state that left was unloaded once, and every state loaded and not held now left
        loaded = len(serving.loads) - len(serving.failed)
        assert loaded == len(serving.unloads) + len(serving.live)


@pytest.mark.parametrize("way", ["keyword", "class attribute"])
def test_results_come_from_their_keys_state_and_at_most_max_loaded_keys_are_held(
    way: str, start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a serving of 6 models holding 2 at most (set either way), on a partition that
    # prepares 2 batches ahead
    options: dict[str, Any] = {"batch_size": 4, "prepare_concurrency": 2}
    if way == "keyword":
        serving = Keyed(max_loaded_keys=2, **options)
    else:
        serving = type("TwoModels", (Keyed,), {"max_loaded_keys": 2})(**options)
    assert serving.max_loaded_keys == 2
    start_worker(serving, max_concurrent_batches=2)
    # When requests of all 6 keys come interleaved
    answered_from_their_keys(client, [f"m{i}" for i in range(6)], 15)
    # Then each ran with its own key's state, never more than 2 held (4 by default), and
    # every state evicted was unloaded
    assert serving.most["live"] == 2
    assert len(serving.loads) > 6  # keys were evicted and loaded again
    check_evictions(serving)


@pytest.mark.parametrize("way", ["keyword", "class attribute"])
def test_the_states_held_never_pass_max_loaded_bytes(
    way: str, start_worker: StartWorker, client: qs.Client
) -> None:
    # Given states of 100 bytes, 250 bytes at most (and keys enough for 10)
    options: dict[str, Any] = {"batch_size": 4, "max_loaded_keys": 10, "state_size": 100}
    if way == "keyword":
        serving = Keyed(max_loaded_bytes=250, **options)
    else:
        serving = type("Bounded", (Keyed,), {"max_loaded_bytes": 250})(**options)
    start_worker(serving)
    answered_from_their_keys(client, [f"m{i}" for i in range(5)], 8)
    # Then 2 states at most were ever held (5 without the bound)
    assert serving.most == {"live": 2, "bytes": 200}
    check_evictions(serving)


def test_a_state_larger_than_max_loaded_bytes_fails_its_key_alone(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Keyed(batch_size=4, state_size=100, max_loaded_bytes=50)
    start_worker(serving)
    with pytest.raises(qs.RemoteError, match="more than max_loaded_bytes=50"):
        client.dispatch("keyed", "x", batch_key="big", timeout=WAIT_S)
    check_evictions(serving)  # unloaded as it was refused


def test_a_key_with_a_batch_in_flight_is_never_evicted(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given two states at most, and a batch of key a held in the executor
    serving = Keyed(batch_size=1, max_loaded_keys=2, hold=["a-held"], prepare_concurrency=2)
    start_worker(serving, max_concurrent_batches=2)
    held = client.submit("keyed", ["a-held"], batch_key="a")
    wait_until(lambda: "a" in serving.running, "a's batch running")
    # When other keys' requests come, each needing a load (and an eviction)
    answered_from_their_keys(client, ["b", "c", "d"], 3)
    # Then a was never evicted while its batch ran: the others took turns in the one slot left
    assert serving.loads.count("a") == 1 and not any(m.key == "a" for m in serving.unloads)
    assert serving.loads.count("b") > 1  # b, c and d evicted one another
    serving.release()
    assert held.result(WAIT_S) == ["a:a-held"]
    check_evictions(serving)


def test_a_partition_loads_a_quarter_of_its_room_at_once_whatever_its_preparers(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given room for 4 states (so one load at a time) and three preparers, loads of 30 ms
    serving = Keyed(batch_size=2, max_loaded_keys=4, prepare_concurrency=3, load_s=0.03)
    start_worker(serving, max_concurrent_batches=2)
    # When requests of 8 keys come interleaved, each key loaded more than once
    answered_from_their_keys(client, [f"m{i}" for i in range(8)], 6)
    # Then no two loads ran at once (three preparers would have loaded three keys at once,
    # evicting the states in use as soon as their batches ran), and each answer is its key's
    assert len(serving.loads) > 8 and serving.most_loading == [1], serving.loads
    check_evictions(serving)


def test_a_load_that_raises_fails_that_keys_requests_alone_and_is_tried_again(
    start_worker: StartWorker, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(key_states, "BACKOFF_FIRST_S", 0.05)
    # Given a model whose first two loads raise
    serving = Keyed(batch_size=4, fail={"bad": 2})
    start_worker(serving)
    # When its requests come, and other keys' meanwhile
    with pytest.raises(qs.RemoteError, match=r"load_key\(.bad.\) raised: no model for bad"):
        client.dispatch("keyed", "x", batch_key="bad", timeout=WAIT_S)
    assert client.dispatch("keyed", "y", batch_key="good", timeout=WAIT_S) == "good:y"

    # Then the worker lives on, and the key is tried again, until it loads
    def served() -> bool:
        try:
            return client.dispatch("keyed", "z", batch_key="bad", timeout=WAIT_S) == "bad:z"
        except qs.RemoteError:
            return False

    wait_until(served, "bad loaded")
    assert serving.loads.count("bad") == 3 and serving.failed == ["bad", "bad"]
    check_evictions(serving)


def test_within_its_backoff_a_key_that_failed_to_load_fails_at_once(
    start_worker: StartWorker, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(key_states, "BACKOFF_FIRST_S", 20.0)
    serving = Keyed(batch_size=4, fail={"bad": 1})
    start_worker(serving)
    with pytest.raises(qs.RemoteError, match="no model for bad"):
        client.dispatch("keyed", "x", batch_key="bad", timeout=WAIT_S)
    # A second request within the backoff is not loaded for: it fails, saying when the next
    # try is (without the backoff it would load, and answer)
    with pytest.raises(qs.RemoteError, match=r"failed 1x; next try in (20\.0|19\.[0-9])s"):
        client.dispatch("keyed", "x", batch_key="bad", timeout=WAIT_S)
    assert serving.loads == ["bad"]
    assert client.dispatch("keyed", "y", batch_key="good", timeout=WAIT_S) == "good:y"


@pytest.mark.timeout(120)
def test_a_sigkilled_partitions_keys_are_loaded_again_elsewhere_and_nothing_is_lost(
    workers: Workers, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    rec = f"{prefix}:fault"
    # Given a worker process holding keys a and b, a batch of a running and more queued
    first = workers.start("tests.support.key_app:keyed")
    with qs.Client(redis_url, prefix=prefix) as client:
        running = client.submit("keyed", ["long"], batch_key="a")
        wait_until(lambda: redis_client.lrange(f"{rec}:exec", 0, -1), "a's batch running")
        queued = [
            (key, item, client.submit("keyed", [item], batch_key=key))
            for key in ("a", "b")
            for item in (f"{key}1", f"{key}2")
        ]
        loaded_first = {x.decode() for x in redis_client.lrange(f"{rec}:loads", 0, -1)}
        # When its partition is SIGKILLed mid-batch, and another worker takes over
        first.kill_group()
        redis_client.set(f"{rec}:go", 1)
        second = workers.start("tests.support.key_app:keyed")
        # Then every request is answered from its own key's state, loaded again there
        assert running.result(WAIT_S) == ["model-a:long"]
        for key, item, ticket in queued:
            assert ticket.result(WAIT_S) == [f"model-{key}:{item}"]
    pid = second.partition_pids()[0]
    loads = [x.decode() for x in redis_client.lrange(f"{rec}:loads", 0, -1)]
    assert f"a@{pid}" in loads and f"b@{pid}" in loads, (loaded_first, loads)


def test_loads_evictions_and_hits_are_counted_in_the_metrics(
    redis_url: str, prefix: str, client: qs.Client
) -> None:
    # Given a worker with metrics, holding 2 states at most
    serving = Keyed(batch_size=4, max_loaded_keys=2, load_s=0.01)
    worker = qs.Worker(
        serving, redis_url=redis_url, prefix=prefix, metrics_port=0, handle_signals=False
    ).start()
    try:
        # When a, b, a, then c come (c evicts b: a was used since)
        for key in ("a", "b", "a", "c"):
            assert client.dispatch("keyed", 1, batch_key=key, timeout=WAIT_S) == f"{key}:1"
        url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    finally:
        worker.stop()
    # Then 3 loads, 1 eviction, 1 hit in 4 uses, 2 states held, and the loads' time
    name = {"serving": "keyed"}
    assert metric_sample(text, "queueserve_key_loads_total", outcome="ok", **name) == 3
    assert metric_sample(text, "queueserve_key_evictions_total", **name) == 1
    assert metric_sample(text, "queueserve_key_state_uses_total", result="hit", **name) == 1
    assert metric_sample(text, "queueserve_key_state_uses_total", result="miss", **name) == 3
    assert metric_sample(text, "queueserve_keys_held", partition="0", **name) == 2
    assert metric_sample(text, "queueserve_key_load_seconds_count", **name) == 3
    assert serving.unloads[0].key == "b"

"""Many models behind one step serving, through a real worker: every prefill, decode and result
call runs one key's sequences with that key's state (``key_state``), a partition holds at most
``max_loaded_keys`` states, a key with running sequences is never evicted (the load of another
waits for them to leave), a load runs while other keys' sequences step on, a load that raises
fails that key's requests alone and is tried again, and prefix-cache entries never cross keys
and go with their key's state (queueserve/worker/stepping/key_loads.py; docs/generation.md,
"Many models")."""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve import key_states
from queueserve.wire.keys import Keys, worker_key
from queueserve.worker.stepping.joins import StepQueue
from tests.support.helpers import WAIT_S, metric_sample, wait_until
from tests.support.step_key_app import KeyedSteps

StartWorker = Callable[..., qs.Worker]


def send(client: qs.Client, key: str, item: dict[str, Any], timeout: float | None = None) -> Any:
    """A request of one item under batch key ``key`` (the item names its key too)."""
    return client.submit("ksteps", [{"key": key, **item}], batch_key=key, timeout=timeout)


def ask(client: qs.Client, key: str, item: dict[str, Any]) -> Any:
    return client.dispatch("ksteps", {"key": key, **item}, batch_key=key, timeout=WAIT_S)


def check(serving: KeyedSteps, withdrawn: tuple[str, ...] = ()) -> None:
    """No call ran with a state not its own or unloaded, no state was unloaded while a sequence
    of its key ran (but those of ``withdrawn`` keys: their sequences left without ending), and
    every eviction was followed by unload_key."""
    with serving.lock:
        left = {f"{key} unloaded with 1 sequences running" for key in withdrawn}
        assert set(serving.problems) == left, serving.problems
        # every state that left was unloaded once, and every state loaded and not held now left
        loaded = len(serving.loads) - len(serving.failed)
        assert loaded == len(serving.unloads) + len(serving.live)


def steps_of(serving: KeyedSteps, key: str) -> Callable[[], int]:
    def count() -> int:
        with serving.lock:
            return serving.steps.get(key, 0)

    return count


def test_each_key_runs_with_its_state_and_at_most_max_loaded_keys_are_held(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a step serving of 5 models holding 2 at most
    serving = KeyedSteps(max_loaded_keys=2, max_slots=6)
    start_worker(serving)
    # When requests of all 5 keys come interleaved, of different lengths
    rng = random.Random(41)
    calls = [(f"m{k}", rng.randint(1, 6)) for k in range(5) for _ in range(8)]
    rng.shuffle(calls)
    tickets = [(key, n, send(client, key, {"n": n})) for key, n in calls]
    # Then each request ran from its own key's state (prefill, every decode and its result),
    # never with another key's sequences, never more than 2 states held, keys were evicted
    # and loaded again, and every eviction was followed by unload_key
    for key, n, ticket in tickets:
        assert ticket.result(WAIT_S) == [f"{key}/{n}"]
    assert serving.most["live"] == 2
    assert len(serving.loads) > 5
    check(serving)


def a_running_in_room_for_one(
    start_worker: StartWorker, client: qs.Client
) -> tuple[KeyedSteps, Any]:
    """A worker with room for one key state, held by key a, whose one sequence runs (until the
    serving's gate opens); the serving and a's ticket."""
    serving = KeyedSteps(max_loaded_keys=1)
    start_worker(serving)
    held = send(client, "a", {"n": 1, "hold": True})
    a_steps = steps_of(serving, "a")
    wait_until(lambda: a_steps() > 0, "a running")
    return serving, held


def test_a_key_with_running_sequences_is_never_evicted_the_load_waits(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given room for one state, held by key a whose sequence runs until the gate opens
    serving, held = a_running_in_room_for_one(start_worker, client)
    a_steps = steps_of(serving, "a")
    # When a request of key b comes
    b = send(client, "b", {"n": 2})
    # Then while a's sequence runs (20 more of its steps), b is not loaded: a is not evicted
    seen = a_steps()
    wait_until(lambda: a_steps() > seen + 20, "a stepping on")
    assert serving.loads == ["a"] and not b.done()
    # and once it ended, a leaves, b is loaded and answered
    serving.gate.set()
    assert held.result(WAIT_S)[0].startswith("a/")
    assert b.result(WAIT_S) == ["b/2"]
    assert serving.loads == ["a", "b"] and [m.key for m in serving.unloads] == ["a"]
    check(serving)


def test_a_key_is_loaded_while_other_keys_sequences_step_on(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given key a's sequence running, and key slow whose load_key waits for its gate
    serving = KeyedSteps(max_loaded_keys=2, slow=["slow"])
    start_worker(serving)
    held = send(client, "a", {"n": 1, "hold": True})
    a_steps = steps_of(serving, "a")
    wait_until(lambda: a_steps() > 0, "a running")
    # When a request of slow comes and its load begins
    slow = send(client, "slow", {"n": 2})
    wait_until(lambda: serving.loading == ["slow"], "slow loading")
    # Then a's sequence steps on during the load, and a request of a joins and is answered
    seen = a_steps()
    wait_until(lambda: a_steps() > seen + 20, "a stepping during the load")
    assert ask(client, "a", {"n": 3}) == "a/3"
    assert serving.loading == ["slow"] and not slow.done()
    # and once loaded, slow's request joins and is answered
    serving.load_gate.set()
    assert slow.result(WAIT_S) == ["slow/2"]
    serving.gate.set()
    assert held.result(WAIT_S)[0].startswith("a/")
    check(serving)


def test_a_request_leaving_releases_its_key_cancelled_or_expired(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given room for one state, held by key a whose sequence runs until the gate opens
    serving, held = a_running_in_room_for_one(start_worker, client)
    b = send(client, "b", {"n": 2})
    # When a's caller cancels it (its sequence never ends by itself: the gate stays shut)
    held.cancel()
    # Then a's state is released with it: b is loaded (a evicted) and answered
    assert b.result(WAIT_S) == ["b/2"]
    assert [m.key for m in serving.unloads] == ["a"]
    # And the same for a request that expires while it runs
    expiring = send(client, "c", {"n": 1, "hold": True}, timeout=1.0)
    wait_until(lambda: steps_of(serving, "c")() > 0, "c running")
    d = send(client, "d", {"n": 1})
    with pytest.raises(qs.Timeout):
        expiring.result(WAIT_S)
    assert d.result(WAIT_S) == ["d/1"]
    assert [m.key for m in serving.unloads] == ["a", "b", "c"]
    check(serving, withdrawn=("a", "c"))


def test_a_load_that_raises_fails_that_keys_requests_alone_and_is_tried_again(
    start_worker: StartWorker, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(key_states, "BACKOFF_FIRST_S", 0.05)
    # Given a model whose first two loads raise, and key a's sequence running
    serving = KeyedSteps(fail={"bad": 2})
    start_worker(serving)
    held = send(client, "a", {"n": 1, "hold": True})
    wait_until(lambda: steps_of(serving, "a")() > 0, "a running")
    # When bad's requests come
    with pytest.raises(qs.RemoteError, match=r"load_key\(.bad.\) raised: no model for bad"):
        ask(client, "bad", {"n": 1})
    # Then only they fail: a runs on, another key is served, and bad is tried again until
    # it loads
    assert ask(client, "good", {"n": 2}) == "good/2"

    def served() -> bool:
        try:
            return ask(client, "bad", {"n": 1}) == "bad/1"
        except qs.RemoteError:
            return False

    wait_until(served, "bad loaded")
    assert serving.loads.count("bad") == 3 and serving.failed == ["bad", "bad"]
    assert not held.done()
    serving.gate.set()
    assert held.result(WAIT_S)[0].startswith("a/")
    check(serving)


def test_prefix_cache_entries_never_cross_keys_and_go_with_their_keys_state(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a step serving with a prefix cache and room for one state
    serving = KeyedSteps(max_loaded_keys=1, prefix_cache_bytes=1000)
    start_worker(serving)

    def run(key: str) -> None:
        assert ask(client, key, {"n": 1, "prompt": "abcd"})

    # When the same prompt comes under key a, a again, then b, then a
    for key in ("a", "a", "b", "a"):
        run(key)
    # Then a's second run resumed from a's cached prompt; b's did not resume from a's
    # entries, and a's last did not either: they went when b's load evicted a's state
    assert serving.resumed == [("a", 0), ("a", 4), ("b", 0), ("a", 0)]
    check(serving)


def test_loads_evictions_and_uses_are_counted_in_the_metrics(
    redis_url: str, prefix: str, client: qs.Client
) -> None:
    # Given a worker with metrics, holding 2 states at most
    serving = KeyedSteps(max_loaded_keys=2)
    worker = qs.Worker(
        serving, redis_url=redis_url, prefix=prefix, metrics_port=0, handle_signals=False
    ).start()
    try:
        # When a, b, a, then c come one by one (c evicts b: a was used since)
        for key in ("a", "b", "a", "c"):
            assert ask(client, key, {"n": 1}) == f"{key}/1"
        url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    finally:
        worker.stop()
    # Then 3 loads, 1 eviction, 2 states held
    name = {"serving": "ksteps"}
    assert metric_sample(text, "queueserve_key_loads_total", outcome="ok", **name) == 3
    assert metric_sample(text, "queueserve_key_evictions_total", **name) == 1
    assert metric_sample(text, "queueserve_key_state_uses_total", result="miss", **name) == 3
    assert metric_sample(text, "queueserve_keys_held", partition="0", **name) == 2
    assert serving.unloads[0].key == "b"


def test_a_partitions_heartbeat_names_the_keys_it_holds(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a step serving holding 2 states at most, which ran keys a, b, then c
    serving = KeyedSteps(max_loaded_keys=2)
    start_worker(serving)
    for key in ("a", "b", "c"):
        assert ask(client, key, {"n": 1}) == f"{key}/1"

    def held() -> list[str] | None:
        for name in redis_client.scan_iter(f"{prefix}:*", _type="hash"):
            value = redis_client.hget(name, "held:ksteps")
            if value is not None:
                return sorted(value.decode().split("\n"))
        return None

    # Then its heartbeat record says it holds b and c (a was evicted), as the dashboard shows
    wait_until(lambda: held() == ["b", "c"], "the keys held in the heartbeat")


def test_a_step_partition_reads_with_the_keys_it_holds_and_those_others_hold(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a worker of a step serving whose loads take 20 ms
    worker = start_worker(KeyedSteps(max_loaded_keys=4, load_s=0.02))
    keys = Keys(prefix, "ksteps")
    # And another partition of it (a record of its own, alive) that holds z and a
    redis_client.hset(worker_key(prefix, "other-p0"), "held:ksteps", "z\na")
    redis_client.zadd(keys.workers, {"other-p0": 2**52})
    # When the worker loads a and b
    for key in ("a", "b"):
        assert ask(client, key, {"n": 1}) == f"{key}/1"
    # Then its reads carry what it holds first ('@'), z (held by the other alone) two leans
    # later ('^'), the lean from its loads' time (20 ms x 4 slots, and more), as a batch
    # serving's do (tests/integration/test_affinity.py)
    host = worker._host
    assert host is not None
    queue = host.runners[0].assembler
    assert isinstance(queue, StepQueue)
    wait_until(lambda: "^z" in list(queue.affinity_marks), "the other partition's keys learnt")
    marks = list(queue.affinity_marks)
    assert marks[0].startswith("!") and 80 <= int(marks[0][1:]) <= 500, marks
    assert sorted(marks[1:-1]) == ["@a", "@b", "^z"] and marks[-1] == "*", marks
    assert set(marks) <= set(queue.read_marks()), queue.read_marks()

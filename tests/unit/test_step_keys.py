"""Many models behind one step serving, without Redis: which waiting requests may join and what
to load (stepping/key_loads.plan), joins skipping requests whose key is loading, prefix-cache
tries per key, and ``key_state`` in inline runs."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

import queueserve as qs
from queueserve.steps import keyed
from queueserve.worker.pipeline.batching import Request, Slice
from queueserve.worker.stepping.joins import Limits, Scheduler, Waiting
from queueserve.worker.stepping.key_loads import plan
from queueserve.worker.stepping.prefix_cache import PrefixCache


@pytest.mark.parametrize(
    ("waiting", "held", "room", "ready", "loads"),
    [
        # held keys join; others are loaded, in the order first needed, once each
        (["a", "b", "a", "c", "b"], {"a"}, 4, [True, False, True, False, False], ["b", "c"]),
        # no room beside the held key for b: what came after b waits, a's too, so a drains
        (["a", "b", "a"], {"a"}, 1, [True, False, False], ["b"]),
        # b fits beside a, c does not: what came after c waits
        (["b", "c", "a", "a"], {"a"}, 2, [False, False, False, False], ["b", "c"]),
        (["b", "a", "c", "a"], {"a"}, 2, [False, True, False, False], ["b", "c"]),
        # nothing held: every key is loaded; a key seen twice takes room once
        (["a", "a", "b"], set(), 2, [False, False, False], ["a", "b"]),
        (["a", "a"], {"a", "b"}, 2, [True, True], []),
        ([], {"a"}, 1, [], []),
    ],
)
def test_plan_joins_held_keys_and_loads_the_others_in_arrival_order(
    waiting: list[str], held: set[str], room: int, ready: list[bool], loads: list[str]
) -> None:
    assert plan(waiting, held, room) == (ready, loads)


def waiting_of(key: str, items: int = 1, ready: bool = True) -> Waiting:
    request = Request(b"1-0", "s", 1, "inbox", 0.0, items)
    return Waiting(key, Slice(request, 0, [0] * items), 0.0, budget=10, ready=ready)


def test_a_join_skips_requests_whose_key_is_loading_and_takes_the_rest() -> None:
    scheduler = Scheduler(Limits(4, 1000, 1000, 0.0, 20))
    loading = waiting_of("b", ready=False)
    first, after = waiting_of("a"), waiting_of("c", 2)
    queue = deque([first, loading, after])
    assert scheduler.admit(queue) == [first, after]
    assert list(queue) == [loading]
    loading.ready = True
    assert scheduler.admit(queue) == [loading]


def test_prefix_cache_entries_are_per_key_and_dropped_with_it() -> None:
    cache = PrefixCache(100)
    cache.put("abcd", 4, "a4", 10, key="a")
    cache.put("abcd", 2, "b2", 10, key="b")
    cache.put("abcd", 3, "any3", 10)
    assert cache.lookup("abcd", "a") == (4, "a4")
    assert cache.lookup("abcd", "b") == (2, "b2")
    assert cache.lookup("abcd", "c") == (0, None)
    assert cache.lookup("abcd") == (3, "any3")
    assert cache.keys() == {"a", "b"}
    version = cache.version
    assert cache.drop_key("a") == 1
    assert cache.lookup("abcd", "a") == (0, None) and cache.version > version
    assert cache.nbytes == 20 and len(cache) == 2 and cache.keys() == {"b"}
    assert cache.drop_key("a") == 0 and cache.drop_key("") == 0
    # the LRU still bounds all keys together, and a dropped key's entries are not in it
    for i in range(9):  # (b's is the least recently used)
        cache.put(f"x{i}", 2, i, 10, key="x")
    assert cache.nbytes == 100 and cache.lookup("abcd", "b") == (0, None)
    assert cache.lookup("abcd") == (3, "any3")


class Shift(qs.StepServing):
    """Counts down by its key's step, from ``key_state``."""

    max_loaded_keys = 1

    def __init__(self, **options: Any) -> None:
        super().__init__(batch_key=lambda item: item["key"], **options)
        self.unloaded: list[str] = []

    def load_key(self, key: str) -> dict[str, int]:
        return {"step": int(key)}

    def unload_key(self, key: str, state: dict[str, int]) -> None:
        self.unloaded.append(key)

    def prefill(self, items: list[Any]) -> list[Any]:
        return [{"left": item["n"]} for item in items]

    def decode(self, states: list[Any]) -> list[Any]:
        out = []
        for s in states:
            s["left"] -= self.key_state["step"]
            out.append(qs.END if s["left"] < 0 else s["left"])
        return out

    def result(self, state: Any, outputs: list[Any]) -> Any:
        return (self.key_state["step"], outputs)


def test_inline_runs_see_each_keys_state() -> None:
    serving = Shift()
    assert serving.key_state is None
    got = serving.inline_many([{"key": "1", "n": 2}, {"key": "2", "n": 5}, {"key": "1", "n": 1}])
    assert got == [(1, [1, 0]), (2, [3, 1]), (1, [0])]
    assert serving.unloaded == ["1"] and serving.key_state is None


def test_keyed_sets_key_state_for_its_serving_in_its_block_and_restores_it() -> None:
    one, two = Shift(), Shift()
    with keyed(one, "x"):
        assert (one.key_state, two.key_state) == ("x", None)
        with keyed(one, "y"):
            assert one.key_state == "y"
        assert one.key_state == "x"
    assert one.key_state is None

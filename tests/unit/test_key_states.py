"""The eviction order and the loads at once of one partition's key states
(queueserve/key_states.py), without a worker: which state a load evicts, given the states held
(least recently used first) and the keys whose work waits here; and that a quarter of the room
loads at once. tests/integration/test_key_states.py holds the same through a real worker."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from queueserve.key_states import KeyStates, evict_order


@dataclass(frozen=True)
class Row:
    held: str  # least recently used first
    wanted: str
    order: str
    why: str


TABLE = [
    Row("a b c d", "", "a b c d", "least recently used first"),
    Row("a b c d", "a", "b c d a", "a key whose work waits here goes last"),
    Row("a b c d", "c a", "b d a c", "keys whose work waits keep their recency among themselves"),
    Row("a b", "x", "a b", "a key not held that waits changes nothing"),
    Row("a b", "a b", "a b", "all wait: least recently used first"),
]


@pytest.mark.parametrize("r", TABLE, ids=[r.why for r in TABLE])
def test_the_eviction_order_table(r: Row) -> None:
    assert evict_order(r.held.split(), frozenset(r.wanted.split())) == r.order.split()


def states(max_keys: int, loads: list[str]) -> KeyStates:
    def load(key: str) -> str:
        loads.append(key)
        return f"state-{key}"

    return KeyStates(load, max_keys=max_keys)


def use(s: KeyStates, *keys: str) -> None:
    for key in keys:
        s.acquire(key)
        s.release(key)


def test_a_load_evicts_the_least_recently_used_state_whose_work_does_not_wait_here() -> None:
    loads: list[str] = []
    s = states(2, loads)
    use(s, "a", "b")  # a is the least recently used
    s.wanted = lambda: {"a"}  # but a batch of a waits here
    use(s, "c")
    assert s.held() == ["a", "c"]
    s.wanted = frozenset
    use(s, "d")  # nothing waits: the least recently used, a, goes
    assert s.held() == ["c", "d"] and loads == ["a", "b", "c", "d"]


@pytest.mark.parametrize(("max_keys", "at_once"), [(1, 1), (4, 1), (7, 1), (8, 2), (16, 4)])
def test_a_quarter_of_the_room_loads_at_once(max_keys: int, at_once: int) -> None:
    # Given loads that wait for the test's gate, and a thread per key asking for its state
    gate, lock = threading.Event(), threading.Lock()
    loading: list[str] = []
    most = [0]

    def load(key: str) -> str:
        with lock:
            loading.append(key)
            most[0] = max(most[0], len(loading))
        gate.wait(10)
        with lock:
            loading.remove(key)
        return key

    s = KeyStates(load, max_keys=max_keys)
    assert s.max_loading == at_once
    keys = [f"k{i}" for i in range(min(max_keys, at_once + 2))]
    threads = [threading.Thread(target=s.acquire, args=(key,)) for key in keys]
    for t in threads:
        t.start()
    # When as many loads as may run have begun
    deadline = threading.Event()
    for _ in range(200):
        with lock:
            if len(loading) >= at_once:
                break
        deadline.wait(0.01)
    deadline.wait(0.05)  # (a load past the bound would begin meanwhile)
    # Then no more began until one ended
    with lock:
        assert len(loading) == at_once
    gate.set()
    for t in threads:
        t.join(10)
    assert most[0] == at_once and sorted(s.held()) == sorted(keys)

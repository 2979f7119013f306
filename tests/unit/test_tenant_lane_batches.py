"""A batch a tenant's lane cannot fill is filled from other tenants' lanes of the same batch key
(queueserve/worker/pipeline/batching.py ``_fill_from_lanes``; wire/tenants.py), the lane whose
turn started first first, their turns unchanged: a quiet tenant's batch costs a busy one no
capacity. Lanes of another batch key, and keys that are no lane, never share a batch. Tenants'
weights rank their lanes (shares.py ``weight_of``). Pure logic: the clock is passed in."""

from __future__ import annotations

from typing import Any

from queueserve.wire.tenants import lane_key, split_lane
from queueserve.worker.pipeline.batching import Assembler, Request, Slice

_ids = iter(range(1, 10**9))


def piece(items: list[Any]) -> Slice:
    rid = next(_ids)
    request = Request(f"{rid}-0".encode(), "qs:{s}:in:k", rid, "qs:inbox:c", 0.0, len(items))
    return Slice(request, 0, items)


def take(a: Assembler, key: str, now: float) -> list[Any]:
    return a.take(a.queues[key], now).items()


def test_a_lane_that_cannot_fill_its_batch_is_filled_from_the_other_lanes_of_its_key() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    quiet, flood, busy = lane_key("k", "quiet"), lane_key("k", "flood"), lane_key("k", "busy")
    a.add(flood, piece(list(range(6))), 0.0)
    a.add(busy, piece(list(range(100, 140))), 0.0)
    a.add(quiet, piece(["q"]), 0.0)
    a.queues[flood].turn, a.queues[busy].turn = 5.0, 3.0
    turns = (a.queues[flood].turn, a.queues[busy].turn)
    # Its one item, then the lane whose turn started first (busy) before the other
    assert take(a, quiet, 1.0) == ["q", *range(100, 109)]
    assert quiet not in a.queues
    assert (a.queues[flood].turn, a.queues[busy].turn) == turns  # their turns did not move
    assert a.queues[busy].weight == 31 and a.queues[flood].weight == 6
    assert a.weight == 37 and a.buffered == 37
    # A lane emptied by the filling leaves the assembler
    assert take(a, flood, 2.0) == [*range(6), *range(109, 113)]
    assert flood not in a.queues and a.queues[busy].weight == 27 and a.weight == 27


def test_lanes_of_another_batch_key_and_keys_that_are_no_lane_never_fill_a_batch() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    a.add(lane_key("k", "quiet"), piece(["q"]), 0.0)
    a.add(lane_key("other", "flood"), piece(list(range(20))), 0.0)
    a.add("k", piece(list(range(20))), 0.0)  # a Python client's, no tenant
    a.add(f"k{chr(0x1F)}not a tenant", piece(list(range(20))), 0.0)
    assert take(a, lane_key("k", "quiet"), 1.0) == ["q"]
    assert take(a, "k", 2.0) == list(range(10))  # a key of no tenant is filled by no lane


def test_a_lane_ranks_by_its_keys_weight_times_its_tenants() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    a.weights = {"k": 2.0}
    a.shares.tenants = {"heavy": 3.0, "light": 1.0}
    assert a.shares.weight_of(lane_key("k", "heavy")) == 6.0
    assert a.shares.weight_of(lane_key("k", "light")) == 2.0
    assert a.shares.weight_of(lane_key("j", "heavy")) == 3.0
    assert a.shares.weight_of("k") == 2.0 and a.shares.weight_of("j") == 1.0
    assert "~heavy=3.0" in a.read_marks() and not any(
        m.startswith("~light") for m in a.read_marks()
    )
    assert split_lane(lane_key("a\x1fb", "t")) == ("a\x1fb", "t")

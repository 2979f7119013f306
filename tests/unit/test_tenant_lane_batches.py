"""A batch a tenant's lane cannot fill is filled from other tenants' lanes of the same batch key
(queueserve/worker/pipeline/batching.py ``_fill_from_lanes``; wire/tenants.py), the lane whose
turn started first first, their turns unchanged: a quiet tenant's batch costs a busy one no
capacity. Lanes of another batch key, and keys that are no lane, never share a batch. Tenants'
weights rank their lanes (shares.py ``weight_of``), and a tenant's lanes of several keys take one
tenant's turns (``lane_turn``, ``served``). Pure logic: the clock is passed in."""

from __future__ import annotations

from typing import Any

import pytest

from queueserve.wire.tenants import lane_key, split_lane
from queueserve.worker.pipeline.batching import Assembler, Request, Slice
from queueserve.worker.pipeline.shares import TIE_SHARE, TURNS_KEPT, Shares

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


def piece_at(items: list[Any], priority: int = 0, at: float = 1.0, **flags: Any) -> Slice:
    rid = next(_ids)
    request = Request(
        f"{int(at * 1000)}-{rid}".encode(), "qs:{s}:in:k", rid, "qs:inbox:c", 0.0, len(items),
        **flags,
    )  # fmt: skip
    request.priority = priority
    return Slice(request, 0, items)


def test_the_filling_takes_another_lanes_levels_in_their_order_and_books_what_it_took() -> None:
    a = Assembler(capacity=10, timeout=0.0, unix_offset=0.0)
    quiet, flood = lane_key("k", "quiet"), lane_key("k", "flood")
    a.add(flood, piece_at(list(range(8)), priority=0, at=1.0), 1.0)
    a.add(flood, piece_at(["u1", "u2", "u3"], priority=5, at=2.0), 2.0)
    a.add(quiet, piece_at(["q"] * 8), 2.5)
    # Priority 5 came a second after priority 0, less than its five levels' worth: first
    assert take(a, quiet, 3.0) == ["q"] * 8 + ["u1", "u2"]
    assert a.queues[flood].served[5] == 3.0  # the level gave items now, as take() books it
    assert a.queues[flood].weight == 9 and a.weight == 9 and a.buffered == 9


def test_a_weighted_lane_emptied_by_the_filling_keeps_its_turn() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    a.shares.tenants = {"flood": 2.0}
    quiet, flood = lane_key("k", "quiet"), lane_key("k", "flood")
    a.add(flood, piece(list(range(3))), 0.0)
    a.queues[flood].turn = 7.5
    a.add(quiet, piece(["q"]), 0.0)
    assert take(a, quiet, 1.0) == ["q", 0, 1, 2]
    assert flood not in a.queues and a.weight == 0
    a.add(flood, piece([3]), 2.0)  # its next request: the turn it had, not a new one
    assert a.queues[flood].turn == 7.5


def test_the_filling_stops_at_a_request_that_must_run_whole_and_does_not_fit() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    quiet, big, small = lane_key("k", "quiet"), lane_key("k", "big"), lane_key("k", "small")
    a.add(big, piece_at(list(range(5)), no_split=True), 0.0)
    a.add(small, piece(["s1", "s2"]), 0.0)
    a.add(quiet, piece(["q"] * 7), 0.0)
    a.queues[big].turn, a.queues[small].turn = 1.0, 2.0
    assert take(a, quiet, 3.0) == ["q"] * 7  # big first does not fit: the batch goes as it is
    # One item of room is filled too
    b = Assembler(capacity=10, timeout=0.0)
    b.add(big, piece(list(range(5))), 0.0)
    b.add(quiet, piece(["q"] * 9), 0.0)
    assert take(b, quiet, 1.0) == ["q"] * 9 + [0]


def test_a_request_that_runs_alone_and_a_key_of_no_tenant_are_never_filled() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    quiet, flood = lane_key("k", "quiet"), lane_key("k", "flood")
    a.add(flood, piece(list(range(20))), 0.0)
    a.add(quiet, piece_at(["q"], alone=True), 0.0)
    assert take(a, quiet, 1.0) == ["q"]
    a.add("k", piece(["plain"]), 1.0)  # a Python client's request of key k, no tenant
    assert take(a, "k", 2.0) == ["plain"]


def pick(a: Assembler, now: float) -> str:
    queue, _ = a.pick(now)
    assert queue is not None
    return queue.key


def test_a_tenants_lanes_of_several_keys_take_one_tenants_turns() -> None:
    # Four lanes of "wide" (keys a-d) and one of "narrow", each holding 6 batches, all due
    a = Assembler(capacity=2, timeout=0.0)
    wide = [lane_key(k, "wide") for k in "abcd"]
    narrow = lane_key("a", "narrow")
    for i, key in enumerate([*wide, narrow]):
        a.add(key, piece(list(range(12))), float(i) / 100)
    ran = []
    for step in range(12):
        now = 1.0 + step
        key = pick(a, now)
        ran.append(key)
        a.take(a.queues[key], now)
    # Then the tenants alternate, whatever number of keys each spreads its requests over, and
    # wide's lanes take turns among themselves (before: wide's 4 lanes ran 4 batches to 1)
    assert ran == [x for pair in zip([*wide, *wide[:2]], [narrow] * 6, strict=True) for x in pair]


def test_a_tenants_next_turn_is_when_its_last_batch_ends_or_its_weights_share_of_it() -> None:
    shares = Shares()
    assert shares.lane_turn("t", 5.0) == 5.0  # no batch of it yet: the lane's own turn
    shares.served("t", end=12.0, now=10.0, restart=0.0)
    assert shares.lane_turn("t", 13.0) == 13.0  # a lane's own later turn
    # held back to the tenant's turn, a millionth of its lead before it (lanes take turns)
    assert shares.lane_turn("t", 5.0) == pytest.approx(12.0 - 7.0 * TIE_SHARE, abs=1e-12)
    assert shares.lane_turn("u", 5.0) == 5.0  # another tenant's lanes are not held back
    shares.tenants = {"t": 4.0}
    shares.served("t", end=20.0, now=16.0, restart=0.0)  # 1/4 of the way from its last turn
    assert shares.lane_turn("t", 100.0) == 100.0
    assert shares.lane_turn("t", 14.0 - 1e6) == pytest.approx(14.0 - 1.0, abs=1e-9)  # 12 + 8 / 4
    shares.served("t", end=120.0, now=100.0, restart=90.0)  # its last turn is too old: anew
    assert shares.lane_turn("t", 105.0) == 105.0 and shares.lane_turn("t", 104.0) < 105.0


def test_a_tenants_turn_at_its_edges() -> None:
    shares = Shares()
    shares.tenants = {"t": 2.0}
    shares.served("t", end=12.0, now=10.0, restart=0.0)  # weight 2: half the way from now
    assert shares.lane_turn("t", 0.0) == pytest.approx(11.0, abs=1e-3)
    shares.served("t", end=31.0, now=20.0, restart=11.0)  # its last turn is the restart: kept
    assert shares.lane_turn("t", 0.0) == pytest.approx(21.0, abs=1e-3)  # not 20 + 11 / 2


def test_tenants_turns_are_forgotten_once_past_when_there_are_many() -> None:
    shares = Shares()
    for i in range(TURNS_KEPT):
        shares.served(f"t{i}", end=float(i), now=0.0, restart=-1.0)
    shares.served("late", end=5000.0, now=TURNS_KEPT - 1.5, restart=-1.0)
    # only the turns still ahead of now stay (the last one's and late's)
    assert shares.lane_turn("t0", -1.0) == shares.lane_turn(f"t{TURNS_KEPT - 2}", -1.0) == -1.0
    assert shares.lane_turn(f"t{TURNS_KEPT - 1}", 1e9) == 1e9  # (its own turn, later)
    assert shares.lane_turn(f"t{TURNS_KEPT - 1}", -1.0) == pytest.approx(TURNS_KEPT - 1, abs=0.01)
    assert shares.lane_turn("late", -1.0) == pytest.approx(5000.0, abs=0.01)
    # exactly TURNS_KEPT tenants are all kept; one more drops what is not ahead of now,
    # a turn at now itself included
    full = Shares()
    for i in range(TURNS_KEPT - 1):
        full.served(f"t{i}", end=float(i), now=0.0, restart=-1.0)
    full.served("now", end=500.0, now=0.0, restart=-1.0)
    assert full.lane_turn("t0", -1.0) != -1.0  # TURNS_KEPT of them: none forgotten
    full.served("more", end=9000.0, now=500.0, restart=-1.0)
    assert full.lane_turn("now", -1.0) == -1.0 and full.lane_turn("t0", -1.0) == -1.0

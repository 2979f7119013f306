"""Batch assembly (docs/design.md §3), pure logic: the clock is passed in, so nothing here waits."""

from __future__ import annotations

from typing import Any

import pytest

from queueserve.worker.pipeline.batching import Assembler, Request, Slice, TakenBatch

_ids = iter(range(1, 10**9))


def request(n: int) -> Request:
    rid = next(_ids)
    return Request(f"{rid}-0".encode(), "qs:{s}:in:default", rid, "qs:inbox:c", 0.0, n)


def piece(items: list[Any], costs: list[float] | None = None, offset: int = 0) -> Slice:
    return Slice(request(offset + len(items)), offset, items, costs)


def shape(batch: TakenBatch) -> list[tuple[int, int, list[Any]]]:
    """(request id, offset, items) of each slice of a taken batch."""
    return [(s.request.rid, s.offset, s.items) for s in batch.slices]


# -- full / due / waiting ----------------------------------------------------------------------
def test_empty_assembler_has_nothing_to_run_and_nothing_to_wait_for() -> None:
    a = Assembler(capacity=4, timeout=0.5)
    assert a.pick(now=100.0) == (None, None)
    assert a.pick(now=100.0, flush=True) == (None, None)
    assert a.buffered == 0


def test_a_partial_batch_waits_until_its_timeout() -> None:
    a = Assembler(capacity=4, timeout=0.5)
    a.add("k", piece([1, 2]), now=100.0)
    chosen, wait = a.pick(now=100.0)
    assert chosen is None
    assert wait == pytest.approx(0.5)
    chosen, wait = a.pick(now=100.2)
    assert chosen is None
    assert wait == pytest.approx(0.3)


def test_a_partial_batch_is_due_at_its_timeout() -> None:
    a = Assembler(capacity=4, timeout=0.5)
    a.add("k", piece([1, 2]), now=100.0)
    chosen, wait = a.pick(now=100.5)
    assert chosen is not None
    assert chosen.key == "k"
    assert wait is None
    batch = a.take(chosen, now=100.5)
    assert batch.key == "k"
    assert batch.items() == [1, 2]
    assert len(batch) == 2
    assert a.buffered == 0
    assert a.pick(now=101.0) == (None, None)


def test_a_full_batch_runs_at_once() -> None:
    a = Assembler(capacity=3, timeout=10.0)
    a.add("k", piece([1, 2]), now=100.0)
    assert a.pick(now=100.0)[0] is None
    a.add("k", piece([3]), now=100.1)
    chosen, wait = a.pick(now=100.1)
    assert chosen is not None and wait is None
    batch = a.take(chosen, now=100.1)
    assert batch.items() == [1, 2, 3]
    assert [len(s.items) for s in batch.slices] == [2, 1]


def test_timeout_zero_is_greedy() -> None:
    a = Assembler(capacity=100, timeout=0.0)
    a.add("k", piece(["x"]), now=5.0)
    chosen, wait = a.pick(now=5.0)
    assert chosen is not None and wait is None
    assert a.take(chosen, now=5.0).items() == ["x"]


def test_items_arriving_later_do_not_restart_the_clock() -> None:
    a = Assembler(capacity=10, timeout=1.0)
    a.add("k", piece([1]), now=100.0)
    a.add("k", piece([2]), now=100.9)
    chosen, wait = a.pick(now=100.95)
    assert chosen is None
    assert wait == pytest.approx(0.05)
    chosen, _ = a.pick(now=101.0)
    assert chosen is not None
    assert a.take(chosen, now=101.0).items() == [1, 2]


def test_a_due_batch_keeps_growing_until_it_is_taken() -> None:
    """Nx.Serving: with no executor free, a due batch fills up rather than queueing small ones."""
    a = Assembler(capacity=10, timeout=0.1)
    a.add("k", piece([1]), now=0.0)
    assert a.pick(now=0.2)[0] is not None  # due, but nobody takes it yet
    a.add("k", piece([2, 3]), now=0.3)
    chosen, _ = a.pick(now=0.4)
    assert chosen is not None
    assert a.take(chosen, now=0.4).items() == [1, 2, 3]


def test_the_wait_is_until_the_earliest_deadline_across_keys() -> None:
    a = Assembler(capacity=10, timeout=1.0)
    a.add("late", piece([1]), now=100.5)
    a.add("early", piece([2]), now=100.2)
    chosen, wait = a.pick(now=100.6)
    assert chosen is None
    assert wait == pytest.approx(0.6)


def test_flush_treats_every_waiting_batch_as_due() -> None:
    a = Assembler(capacity=10, timeout=60.0)
    a.add("a", piece([1]), now=100.0)
    a.add("b", piece([2, 3]), now=99.0)
    assert a.pick(now=100.0)[0] is None
    chosen, wait = a.pick(now=100.0, flush=True)
    assert chosen is not None and chosen.key == "b"  # oldest first
    assert wait is None
    assert a.take(chosen, now=100.0).items() == [2, 3]
    chosen, _ = a.pick(now=100.0, flush=True)
    assert chosen is not None and chosen.key == "a"
    assert a.take(chosen, now=100.0).items() == [1]
    assert a.pick(now=100.0, flush=True) == (None, None)


# -- choosing between keys ---------------------------------------------------------------------
def test_keys_never_share_a_batch() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    a.add("x", piece([1, 2]), now=1.0)
    a.add("y", piece([3]), now=1.0)
    batches = []
    while (chosen := a.pick(now=2.0)[0]) is not None:
        batches.append(a.take(chosen, now=2.0))
    assert sorted((b.key, b.items()) for b in batches) == [("x", [1, 2]), ("y", [3])]


def test_due_batches_run_oldest_first_across_keys() -> None:
    a = Assembler(capacity=10, timeout=1.0)
    a.add("b", piece(["b"]), now=3.0)
    a.add("a", piece(["a"]), now=1.0)
    a.add("c", piece(["c"]), now=2.0)
    order = []
    while (chosen := a.pick(now=10.0)[0]) is not None:
        order.append(a.take(chosen, now=10.0).key)
    assert order == ["a", "c", "b"]


def test_an_older_due_batch_runs_before_a_younger_full_one() -> None:
    # Keys take turns: a quiet key's due batch is not kept waiting by a busy key that is
    # always full (issue 11).
    a = Assembler(capacity=2, timeout=1.0)
    a.add("due", piece([1]), now=0.0)
    a.add("full", piece([2, 3]), now=5.0)
    chosen, _ = a.pick(now=5.0)
    assert chosen is not None and chosen.key == "due"
    a.take(chosen, now=5.0)
    chosen, _ = a.pick(now=5.0)
    assert chosen is not None and chosen.key == "full"


def test_a_busy_key_and_a_quiet_key_take_turns() -> None:
    a = Assembler(capacity=2, timeout=0.0)
    a.add("busy", piece(list(range(10))), now=0.0)
    a.add("quiet", piece(["q"]), now=1.0)
    order = []
    now = 2.0
    while (chosen := a.pick(now=now)[0]) is not None:
        order.append(a.take(chosen, now=now).key)
        now += 1.0
    assert order[:3] == ["busy", "quiet", "busy"]


def test_higher_priority_slices_go_first_within_a_key_and_across_keys() -> None:
    a = Assembler(capacity=2, timeout=0.0, age_per_priority=1.0)
    low, high = piece([1, 2]), piece([3])
    high.request.priority = 5
    a.add("k", low, now=0.0)
    a.add("k", high, now=0.0)
    batch = a.take(a.pick(now=0.0)[0], now=0.0)  # type: ignore[arg-type]
    assert batch.items() == [3, 1]  # the urgent item first, then the oldest of the rest
    other = piece(["x"])
    other.request.priority = 9
    a.add("other", other, now=3.0)  # 3 s younger, but 9 levels (9 s of ageing) more urgent
    assert a.pick(now=3.0)[0].key == "other"  # type: ignore[union-attr]


def test_full_batches_run_oldest_first() -> None:
    a = Assembler(capacity=2, timeout=1.0)
    a.add("young", piece([1, 2]), now=2.0)
    a.add("old", piece([3, 4]), now=1.0)
    chosen, _ = a.pick(now=2.0)
    assert chosen is not None and chosen.key == "old"


def test_a_key_emptied_and_refilled_restarts_its_clock() -> None:
    a = Assembler(capacity=10, timeout=1.0)
    a.add("k", piece([1]), now=0.0)
    chosen, _ = a.pick(now=1.0)
    assert chosen is not None
    a.take(chosen, now=1.0)
    a.add("k", piece([2]), now=5.0)
    chosen, wait = a.pick(now=5.5)
    assert chosen is None
    assert wait == pytest.approx(0.5)


# -- splitting ---------------------------------------------------------------------------------
def test_a_request_larger_than_the_room_is_split_in_order() -> None:
    """Nx's AAB -> BCC: the tail of a split request starts the next batch."""
    a = Assembler(capacity=3, timeout=1.0)
    ra, rb = piece(["a1", "a2"]), piece(["b1", "b2", "b3", "b4"])
    rc = piece(["c1"])
    for s in (ra, rb, rc):
        a.add("k", s, now=0.0)
    assert a.buffered == 7
    first = a.take(a.pick(now=0.0)[0], now=0.0)  # type: ignore[arg-type]
    assert shape(first) == [(ra.request.rid, 0, ["a1", "a2"]), (rb.request.rid, 0, ["b1"])]
    second = a.take(a.pick(now=0.0)[0], now=0.0)  # type: ignore[arg-type]
    assert shape(second) == [(rb.request.rid, 1, ["b2", "b3", "b4"])]
    assert a.buffered == 1
    chosen, wait = a.pick(now=0.0)
    assert chosen is None  # c1 alone is neither full nor due yet
    assert wait == pytest.approx(1.0)


def test_a_request_spanning_many_batches_keeps_its_offsets() -> None:
    a = Assembler(capacity=4, timeout=0.0)
    big = piece(list(range(10)))
    a.add("k", big, now=0.0)
    seen = []
    while (chosen := a.pick(now=0.0)[0]) is not None:
        batch = a.take(chosen, now=0.0)
        assert len(batch.slices) == 1
        s = batch.slices[0]
        assert s.request is big.request
        seen.append((s.offset, s.items))
    assert seen == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9])]
    assert a.buffered == 0


def test_a_split_slice_starts_at_its_own_offset() -> None:
    s = Slice(request(10), 4, ["e", "f", "g", "h", "i", "j"])
    head, tail = s.split(2)
    assert (head.offset, head.items, head.costs) == (4, ["e", "f"], None)
    assert (tail.offset, tail.items, tail.costs) == (6, ["g", "h", "i", "j"], None)
    assert head.request is tail.request is s.request


def test_cost_split_takes_the_longest_head_that_fits() -> None:
    s = Slice(request(4), 0, ["aa", "bbb", "c", "dddd"], [2.0, 3.0, 1.0, 4.0])
    assert s.weight == 10.0
    head, tail = s.split(5.5)
    assert (head.items, head.costs, head.weight) == (["aa", "bbb"], [2.0, 3.0], 5.0)
    assert (tail.offset, tail.items, tail.costs) == (2, ["c", "dddd"], [1.0, 4.0])
    empty, whole = s.split(1.0)
    assert empty.items == []
    assert whole.items == s.items


def test_cost_capacity_makes_a_batch_full() -> None:
    a = Assembler(capacity=10, timeout=60.0)
    a.add("k", piece(["x" * 6], [6.0]), now=0.0)
    assert a.pick(now=0.0)[0] is None
    a.add("k", piece(["y" * 4], [4.0]), now=0.0)
    chosen, _ = a.pick(now=0.0)
    assert chosen is not None
    batch = a.take(chosen, now=0.0)
    assert batch.items() == ["x" * 6, "y" * 4]
    assert a.buffered == 0


def test_batches_by_cost_never_exceed_capacity() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    costs = [4.0, 4.0, 3.0, 7.0, 2.0, 9.0, 1.0]
    a.add("k", piece([f"i{i}" for i in range(4)], costs[:4]), now=0.0)
    a.add("k", piece([f"j{i}" for i in range(3)], costs[4:]), now=0.0)
    batches = []
    while (chosen := a.pick(now=0.0)[0]) is not None:
        batches.append(a.take(chosen, now=0.0))
    weights = [sum(s.weight for s in b.slices) for b in batches]
    assert all(w <= 10 for w in weights), weights
    assert [x for b in batches for x in b.items()] == [
        "i0",
        "i1",
        "i2",
        "i3",
        "j0",
        "j1",
        "j2",
    ]
    assert weights == [8.0, 10.0, 2.0, 10.0]
    assert a.buffered == 0
    assert "k" not in a.queues  # an emptied key is forgotten: idle keys cost nothing
    assert a.weight == 0.0


def test_a_cost_slice_whose_first_item_does_not_fit_waits_for_the_next_batch() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    first = piece(["a"], [8.0])
    second = piece(["b", "c"], [5.0, 1.0])
    a.add("k", first, now=0.0)
    a.add("k", second, now=0.0)
    batch = a.take(a.pick(now=0.0)[0], now=0.0)  # type: ignore[arg-type]
    assert shape(batch) == [(first.request.rid, 0, ["a"])]
    batch = a.take(a.pick(now=0.0)[0], now=0.0)  # type: ignore[arg-type]
    assert shape(batch) == [(second.request.rid, 0, ["b", "c"])]


def test_leftovers_restart_the_clock() -> None:
    a = Assembler(capacity=2, timeout=1.0)
    a.add("k", piece([1, 2, 3]), now=0.0)
    chosen, _ = a.pick(now=0.0)
    assert chosen is not None
    a.take(chosen, now=0.5)  # leaves [3] behind at t=0.5
    chosen, wait = a.pick(now=1.0)
    assert chosen is None  # 3 has waited since t=0, but the clock restarted at t=0.5
    assert wait == pytest.approx(0.5)
    chosen, _ = a.pick(now=1.5)
    assert chosen is not None
    assert a.take(chosen, now=1.5).items() == [3]


# -- bookkeeping -------------------------------------------------------------------------------
def test_buffered_counts_items_across_keys() -> None:
    a = Assembler(capacity=3, timeout=0.0)
    a.add("x", piece([1, 2, 3, 4]), now=0.0)
    a.add("y", piece([5]), now=0.0)
    a.add("y", piece(["a", "b"], [1.0, 1.0]), now=0.0)
    assert a.buffered == 7
    total = 0
    while (chosen := a.pick(now=0.0)[0]) is not None:
        batch = a.take(chosen, now=0.0)
        total += len(batch)
        assert a.buffered == 7 - total
        assert batch.key not in a.queues or a.queues[batch.key].weight >= 0
    assert total == 7
    assert a.buffered == 0
    assert all(q.weight == 0 for q in a.queues.values())


def test_queue_weight_tracks_what_is_left() -> None:
    a = Assembler(capacity=4, timeout=0.0)
    a.add("k", piece(list(range(6))), now=0.0)
    assert a.queues["k"].weight == 6
    a.take(a.pick(now=0.0)[0], now=0.0)  # type: ignore[arg-type]
    assert a.queues["k"].weight == 2
    a.take(a.pick(now=0.0)[0], now=0.0)  # type: ignore[arg-type]
    assert "k" not in a.queues and a.weight == 0


def test_taken_batch_items_concatenate_slices_in_order() -> None:
    s1, s2 = piece([1, 2]), piece([3])
    batch = TakenBatch("k", [s1, s2])
    assert batch.items() == [1, 2, 3]
    assert len(batch) == 3
    assert TakenBatch("k", [s1]).items() == [1, 2]


def test_request_remaining_starts_at_its_item_count() -> None:
    r = request(5)
    assert r.n == 5
    assert r.remaining == 5


# -- a quiet key's lead (read.lua reads it with one) -------------------------------------------
@pytest.mark.parametrize("back_at", [100.05, 160.0])
def test_a_leading_key_goes_before_held_batches_unless_a_batch_of_it_still_runs(
    back_at: float,
) -> None:
    # Given a key that gave a batch at 100 s (expected to end at 100.1 s), and a busy key
    # with a full batch waiting since just before the first key came back
    a = Assembler(capacity=2, timeout=0.5)
    a.add("quiet", piece([1, 2]), now=100.0)
    chosen, _ = a.pick(now=100.0)
    assert chosen is not None
    a.batch_times.observe(2, 0.1)
    a.take(chosen, now=100.0)
    a.add("busy", piece(["b1", "b2"]), now=back_at - 0.01)
    # When the first key comes back with a lead
    a.add("quiet", piece([3, 4]), now=back_at, lead=True)
    chosen, _ = a.pick(now=back_at)
    # Then it runs next once its batch is over, however long ago that was; while its batch
    # still runs, the busy key goes first (what came during a key's batch waits for its end)
    assert chosen is not None
    assert chosen.key == ("quiet" if back_at > 100.1 else "busy")

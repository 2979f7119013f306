"""What the batch assembler promises beyond tests/unit/test_assembler.py and
test_priority_ageing_units.py, each written for a mutant of queueserve/worker/pipeline/batching.py
that survived them and the worker tests that run it (docs/testing.md): the marks the reader
sends read.lua, the look-ahead, a batch that closes early (a request that runs alone or whole,
a split), what a batch leaves of a key's weight, a batch still filling that runs before due
ones ranked after it, ties, a key's turn when it comes back, levels of a key ranked with a
priority worth other than 1 s, and entry ids a stranger wrote. Pure logic: the clock is passed
in, and an entry id says when its request was enqueued (unix ms, as Redis writes it)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from queueserve.worker.pipeline.batching import (
    ENDS_KEPT,
    Assembler,
    KeyQueue,
    Request,
    Slice,
    _enqueued,
)

_ids = iter(range(1, 10**9))


def piece(
    items: list[Any],
    *,
    priority: int = 0,
    at: float | None = None,
    entry_id: bytes | None = None,
    costs: list[float] | None = None,
    **flags: Any,
) -> Slice:
    """A request's items as one slice; its entry written at unix time ``at`` (or ``entry_id``
    as given); ``flags``: Request fields (alone, no_split, run ...)."""
    rid = next(_ids)
    if entry_id is None:
        entry_id = f"{int((at if at is not None else rid) * 1000)}-{rid}".encode()
    request = Request(entry_id, "qs:{s}:in:k", rid, "qs:inbox:c", 0.0, len(items), **flags)
    request.priority = priority
    return Slice(request, 0, items, costs)


def run(a: Assembler, now: float) -> tuple[str, list[Any]]:
    """The key and items of the batch ``pick`` chooses now, taken."""
    queue, wait = a.pick(now)
    assert queue is not None, f"nothing to run at {now}; wait {wait}"
    return queue.key, a.take(queue, now).items()


# --- Request, Slice, KeyQueue ------------------------------------------------------------------
def test_a_streamed_answers_tail_names_the_run_of_a_replay_only() -> None:
    first = piece(["x"]).request
    first.events_sent = 3
    assert first.stream_tail() == [3]
    replay = piece(["x"], run=7).request
    replay.events_sent = 2
    assert replay.stream_tail() == [2, 7]


def test_a_cost_split_fills_the_room_exactly() -> None:
    head, tail = piece([1, 2, 3], costs=[1.0, 1.0, 1.0]).split(2.0)
    assert (head.items, tail.items, tail.offset) == ([1, 2], [3], 2)


def test_a_key_is_as_urgent_as_its_most_urgent_level_whatever_came_first() -> None:
    queue = KeyQueue("k")
    queue.levels = {2: piece([1]), 7: piece([2]), 5: piece([3])}  # type: ignore[dict-item]
    assert queue.urgent() == 7
    queue.levels = {2: piece([1]), 7: piece([2])}  # type: ignore[dict-item]
    assert queue.urgent() == 7
    queue.levels = {4: piece([1])}  # type: ignore[dict-item]
    assert queue.urgent() == 4


# --- the assembler's defaults --------------------------------------------------------------------
def test_a_priority_level_is_worth_a_second_by_default() -> None:
    # Given a priority-1 batch whose turn came 1.5 s after a priority-0 one's, both due
    a = Assembler(capacity=4, timeout=0.0, unix_offset=0.0)
    a.add("low", piece(["l"]), now=100.0)
    a.add("high", piece(["h"], priority=1), now=101.5)
    # Then the one that waited longer goes first: a level is worth 1 s, not 1.5 s or more
    assert run(a, 101.5) == ("low", ["l"])
    a.add("low", piece(["l2"]), now=101.5)
    a.add("high", piece(["h2"], priority=1), now=102.4)
    assert run(a, 102.4)[0] == "high"  # (102.4 - 1 < 101.5, it ranks first)


def test_the_unix_offset_is_the_wall_clock_less_the_monotonic_one() -> None:
    a = Assembler(capacity=4, timeout=0.5)
    assert abs(a.unix_offset - (time.time() - time.monotonic())) < 5.0


# --- what the reader is told ---------------------------------------------------------------------
def test_read_marks_say_what_each_key_holds_for_read_lua() -> None:
    a = Assembler(capacity=4, timeout=10.0)
    assert a.read_marks() == []
    a.weights = {"heavy": 4.0, "plain": 1.0}
    a.add("part", piece([1, 2]), now=100.0)  # less than a batch: read it after the others
    a.add("one", piece([1]), now=100.0)  # one item is less than a batch too
    a.add("free", piece(["f"], costs=[0.0]), now=100.0)  # holds nothing that counts
    a.add("full", piece([1, 2, 3, 4], priority=3), now=100.0)  # exactly a batch, one level
    a.add("mixed", piece([1, 2, 3], priority=5), now=100.0)  # a batch from priority 1 up
    a.add("mixed", piece([6], priority=0), now=100.0)
    a.add("mixed", piece([4, 5], priority=1), now=100.0)
    a.add("top", piece([5]), now=100.0)  # a batch at 9 already, whatever came before it
    a.add("top", piece([1, 2, 3, 4], priority=9), now=100.0)
    assert a.read_marks() == ["=heavy=4.0", "-part", "-one", "3full", "1mixed", "9top"]
    assert a.full_keys() == ["full", "mixed", "top"]


def test_the_look_ahead_counts_at_most_a_batch_per_key() -> None:
    a = Assembler(capacity=4, timeout=10.0)
    a.add("big", piece(list(range(10))), now=100.0)
    a.add("small", piece([1, 2]), now=100.0)
    assert a.weight == 12
    assert a.look_ahead() == 6


def test_a_new_latency_target_is_taken_by_the_plan_in_place() -> None:
    a = Assembler(capacity=4, timeout=10.0)
    a.plan_latency(0.5)
    plan = a.latency
    a.plan_latency(0.25)
    assert a.latency is plan and plan is not None and plan.target == 0.25


# --- batches that close early, and what they leave -----------------------------------------------
def test_a_request_that_runs_alone_takes_a_batch_of_its_own_when_it_comes_first() -> None:
    a = Assembler(capacity=4, timeout=0.0)
    a.add("k", piece(["crasher?"], alone=True), now=100.0)
    a.add("k", piece(["a"]), now=100.0)
    assert run(a, 100.0) == ("k", ["crasher?"])
    assert run(a, 100.0) == ("k", ["a"])


@pytest.mark.timeout(10)
def test_a_request_that_runs_alone_behind_others_of_several_levels_waits_its_own_batch() -> None:
    # Given a key's priority-1 run of a request and one that runs alone (enqueued at 100 s),
    # and a priority-0 request enqueued at 109.5 s
    a = Assembler(capacity=4, timeout=0.0, unix_offset=0.0)
    a.add("k", piece(["x"], priority=1, at=100.0), now=110.0)
    a.add("k", piece(["crasher?"], priority=1, at=100.0, alone=True), now=110.0)
    a.add("k", piece(["y"], at=109.5), now=110.0)
    # Then the batch that took x closes when the level comes round again (served at 110 s,
    # it ranks 109 < 109.5) with the lone request at its head: that one runs by itself
    assert run(a, 110.0) == ("k", ["x"])
    assert run(a, 110.0) == ("k", ["crasher?"])
    assert run(a, 110.0) == ("k", ["y"])


@pytest.mark.timeout(10)
def test_a_request_that_must_run_whole_and_does_not_fit_starts_the_next_batch() -> None:
    a = Assembler(capacity=4, timeout=0.0)
    a.add("k", piece([1, 2]), now=100.0)
    a.add("k", piece([3, 4, 5, 6], no_split=True), now=100.0)
    a.add("k", piece([7]), now=100.0)
    assert run(a, 100.0) == ("k", [1, 2])
    # and what it leaves is a whole batch: it runs at once
    assert a.queues["k"].weight == 5 and a.weight == 5
    assert a.pick(100.0)[0] is not None and run(a, 100.0) == ("k", [3, 4, 5, 6])


def test_after_a_split_the_batch_closes_though_a_smaller_item_would_fit() -> None:
    a = Assembler(capacity=4, timeout=0.0, unix_offset=0.0)
    a.add("k", piece(["a", "b"], priority=5, costs=[3.0, 3.0], at=100.0), now=100.0)
    a.add("k", piece(["c"], costs=[1.0], at=100.0), now=100.0)
    assert run(a, 100.0) == ("k", ["a"])


def test_a_batch_at_capacity_takes_nothing_more_not_even_a_free_item() -> None:
    a = Assembler(capacity=2, timeout=0.0)
    a.add("k", piece([1, 2], costs=[1.0, 1.0]), now=100.0)
    a.add("k", piece(["free"], costs=[0.0]), now=100.0)
    assert run(a, 100.0) == ("k", [1, 2])


def test_what_a_batch_leaves_of_a_cost_below_one_is_its_weight() -> None:
    a = Assembler(capacity=1, timeout=0.0)
    a.add("k", piece(["a", "b"], costs=[1.0, 0.5]), now=100.0)
    assert run(a, 100.0) == ("k", ["a"])
    assert a.queues["k"].weight == 0.5 and a.weight == 0.5


@pytest.mark.parametrize("costs", [[0.1, 0.2, 0.7], [0.1, 0.1]], ids=["sum-1", "sum-0.2"])
def test_a_drained_assembler_weighs_nothing_whatever_the_costs_summed_to(
    costs: list[float],
) -> None:
    # (1 - 0.1 - 0.1 taken from a capacity of 1 is 0.19999999999999996, not 0.2: the key's
    # weight is left at 5.6e-17 when its queue empties, and the reader's room must not keep it)
    a = Assembler(capacity=1.0, timeout=0.0)
    a.add("k", piece(list(range(len(costs))), costs=costs), now=100.0)
    assert a.weight == sum(costs)
    while a.queues:
        run(a, 100.0)
    assert a.weight == 0.0 and a.look_ahead() == 0.0


def test_a_batch_says_when_its_clock_started() -> None:
    a = Assembler(capacity=4, timeout=0.5)
    a.add("k", piece([1, 2, 3, 4, 5]), now=100.0)
    queue, _ = a.pick(100.25)
    assert queue is not None
    batch = a.take(queue, now=100.25)
    assert (batch.opened, batch.since) == (100.0, 100.0)
    assert a.queues["k"].started == 100.25  # the leftovers' clock


# --- which batch runs --------------------------------------------------------------------------
def test_a_batch_still_filling_runs_before_a_due_one_ranked_after_it() -> None:
    # Given a due batch on 'busy', and a quiet key's batch, led and not due yet
    a = Assembler(capacity=4, timeout=0.5)
    a.add("busy", piece(["b"]), now=99.0)
    a.add("quiet", piece(["q"]), now=99.4, lead=True)
    # Then the quiet key's runs first: it ranks first, and waiting would only add latency
    assert run(a, 99.5) == ("quiet", ["q"])
    assert run(a, 99.5) == ("busy", ["b"])


def test_batches_ranked_alike_run_in_the_order_their_keys_came() -> None:
    a = Assembler(capacity=1, timeout=0.5)
    for key in ("first", "second", "third"):
        a.add(key, piece([key]), now=100.0)
    assert [run(a, 100.0)[0] for _ in range(3)] == ["first", "second", "third"]
    # and so do batches still filling, ranked alike, ahead of a due one
    a = Assembler(capacity=4, timeout=0.5)
    a.add("due", piece(["d"]), now=98.0)
    a.add("early", piece(["e"]), now=99.9, lead=True)
    a.add("later", piece(["l"]), now=99.9, lead=True)
    assert run(a, 100.0)[0] == "early"


def test_the_wait_is_until_the_earliest_deadline_whatever_order_the_keys_came_in() -> None:
    a = Assembler(capacity=4, timeout=0.5)
    a.add("early", piece([1]), now=100.0)
    a.add("late", piece([2]), now=100.2)
    queue, wait = a.pick(now=100.3)
    assert queue is None and wait == pytest.approx(0.2)


def test_a_key_back_after_its_batch_ended_exactly_now_still_takes_its_lead() -> None:
    # Given a key whose batch is expected to end at 100 s (0.5 s per item), and a busy key
    # waiting since 99 s
    a = Assembler(capacity=4, timeout=0.0)
    a.batch_times.observe(1, 0.5)
    a.add("quiet", piece(["q1"]), now=99.5)
    assert run(a, 99.5) == ("quiet", ["q1"])
    a.add("busy", piece(["b"]), now=99.9)
    # When it comes back with a lead at 100 s, its batch over
    a.add("quiet", piece(["q2"]), now=100.0, lead=True)
    # Then it goes first
    assert run(a, 100.0) == ("quiet", ["q2"])


def test_a_key_back_after_its_batch_ended_takes_its_turn_from_when_it_came_back() -> None:
    # Given a key whose batch ended at once (nothing measured: batches take no time)
    a = Assembler(capacity=4, timeout=0.0)
    a.add("back", piece([1]), now=100.0)
    assert run(a, 100.0) == ("back", [1])
    # When another key's batch waits from 100.5 s and the first key comes back at 101 s
    a.add("other", piece([2]), now=100.5)
    a.add("back", piece([3]), now=101.0)
    # Then the other goes first: the first key's turn starts when it came back
    assert run(a, 101.0) == ("other", [2])


def test_a_weight_2_key_moves_half_way_to_its_batchs_end() -> None:
    # Given a batch taking 1 s on a key of weight 2, and a plain key waiting since 100.6 s
    a = Assembler(capacity=1, timeout=0.0)
    a.weights = {"double": 2.0}
    a.batch_times.observe(1, 1.0)
    a.add("double", piece([1, 2]), now=100.0)
    assert run(a, 100.0) == ("double", [1])
    a.add("plain", piece(["p"]), now=100.6)
    # Then its next turn is at 100.5 s (half way to 101 s), before the plain key's
    assert run(a, 100.6) == ("double", [2])


def test_only_ended_unweighted_turns_are_forgotten_when_the_record_is_full() -> None:
    # Given ENDS_KEPT keys that each gave a batch expected to take 1 s (times in 1/1024 s, so
    # that they add up exactly), one of them of weight 2
    a = Assembler(capacity=1, timeout=0.0)
    a.weights = {"w0": 2.0}
    a.batch_times.observe(1, 1.0)
    step = 1 / 1024
    for i in range(ENDS_KEPT):
        a.add(f"w{i}", piece([i]), now=100.0 + i * step)
        run(a, 100.0 + i * step)
    # When one more batch is taken as the last of those ends passes (the record is full)
    late = 100.0 + (ENDS_KEPT - 1) * step + 1.0
    a.add("last", piece(["x"]), now=late)
    run(a, late)
    # Then a plain key back later takes its turn from when it came back, not from its old
    # end; the weighted key keeps its saved turn (100.5 s); and the last batch's end is kept
    plain = f"w{ENDS_KEPT - 1}"
    a.add(plain, piece(["plain again"]), now=late + 0.5)
    a.add("w0", piece(["w0 again"]), now=late + 0.5)
    a.add("rival", piece(["r"]), now=late + 0.25)
    assert run(a, late + 0.5) == ("w0", ["w0 again"])
    assert run(a, late + 0.5) == ("rival", ["r"])
    assert run(a, late + 0.5) == (plain, ["plain again"])
    # (back at late + 0.5 s, while its batch runs, the last key's turn starts at that
    # batch's end: after a key waiting from late + 0.75 s)
    a.add("last", piece(["y"]), now=late + 0.5)
    a.add("rival2", piece(["r2"]), now=late + 0.75)
    assert run(a, late + 0.75) == ("rival2", ["r2"])
    assert run(a, late + 0.75) == ("last", ["y"])


# --- levels of one key -------------------------------------------------------------------------
def test_a_key_takes_one_slice_per_level_choice_with_a_unix_offset() -> None:
    # Given a key holding two priority-0 requests enqueued at unix 1000 s and a priority-1
    # one at 1005 s, on a worker whose monotonic clock reads 100 s at unix 1010 s
    a = Assembler(capacity=4, timeout=0.0, unix_offset=910.0)
    a.add("k", piece(["s1"], at=1000.0), now=100.0)
    a.add("k", piece(["s2"], at=1000.0), now=100.0)
    a.add("k", piece(["t1"], priority=1, at=1005.0), now=100.0)
    # Then the level served just now ranks from now (1010 s), the other from its head: s1,
    # then t1 (1005 - 1 < 1010), then s2
    assert run(a, 100.0) == ("k", ["s1", "t1", "s2"])


def test_a_level_that_gave_a_batch_nothing_keeps_its_rank() -> None:
    # Given a key holding, at unix 110 s: priority 0 (enqueued at 100 s, a request of two
    # items and one of one) and priority 5 (at 105.5 s, four items that must run whole)
    a = Assembler(capacity=4, timeout=0.0, unix_offset=0.0)
    a.add("k", piece(["a1", "a2"], at=100.0), now=110.0)
    a.add("k", piece(["c"], at=100.0), now=110.0)
    a.add("k", piece([1, 2, 3, 4], priority=5, at=105.5, no_split=True), now=110.0)
    # When a batch takes priority 0's head (100 < 105.5 - 5), then turns to priority 5
    # (100.5 < 110, level 0 having given items now), whose request does not fit
    assert run(a, 110.0) == ("k", ["a1", "a2"])
    # Then priority 5 gave nothing and still ranks from its head (100.5): it goes before a
    # priority-9 request that came at 110 s (101), as if that batch had not looked at it
    a.add("k", piece(["d"], priority=9, at=110.0), now=110.0)
    assert run(a, 110.0) == ("k", [1, 2, 3, 4])


def test_levels_tied_in_rank_go_most_urgent_first_whichever_came_first() -> None:
    # Given levels 1 and 0 of one key ranked alike (101 - 1 == 100)
    a = Assembler(capacity=1, timeout=0.0, unix_offset=0.0)
    a.add("k", piece(["urgent"], priority=1, at=101.0), now=110.0)
    a.add("k", piece(["plain"], at=100.0), now=110.0)
    assert run(a, 110.0) == ("k", ["urgent"])


def test_a_level_is_worth_what_age_per_priority_says() -> None:
    # Given levels 0 (enqueued at 100 s) and 2 (at 103 s), 2 s a level: 103 - 4 < 100
    a = Assembler(capacity=1, timeout=0.0, age_per_priority=2.0, unix_offset=0.0)
    a.add("k", piece(["plain"], at=100.0), now=110.0)
    a.add("k", piece(["plain2"], at=108.0), now=110.0)
    a.add("k", piece(["urgent"], priority=2, at=103.0), now=110.0)
    assert run(a, 110.0) == ("k", ["urgent"])
    assert run(a, 110.0) == ("k", ["plain"])
    # and the level served at 110 s, whose next head came 2 s before (within its 2 levels of
    # 2 s behind the most urgent), keeps that head's clock: 108 < 113 - 4 (from the service,
    # 110, it would rank after a priority-2 request of 113 s)
    a.add("k", piece(["urgent2"], priority=2, at=113.0), now=115.0)
    assert run(a, 115.0) == ("k", ["plain2"])
    assert run(a, 115.0) == ("k", ["urgent2"])


@pytest.mark.parametrize(
    ("high_at", "order"),
    [(995.0, ["high", "low"]), (1001.0, ["low", "high"])],
    ids=["high-ranks-986", "high-ranks-992"],
)
def test_a_head_enqueued_long_before_its_levels_last_service_ranks_from_that_service_aged(
    high_at: float, order: list[str]
) -> None:
    # Given a key holding priority 0 (enqueued at unix 990 s), served at 1000 s, and (keeping
    # the key's queue) priority 5 enqueued much later; then a priority-9 head never served
    a = Assembler(capacity=1, timeout=0.0, unix_offset=0.0)
    a.add("k", piece(["first"], at=990.0), now=1000.0)
    a.add("k", piece(["kept"], priority=5, at=1100.0), now=1000.0)
    assert run(a, 1000.0) == ("k", ["first"])
    a.add("k", piece(["high"], priority=9, at=high_at), now=1010.0)
    # When a priority-0 head comes that was enqueued at 980 s, more than 9 levels before that
    # service
    a.add("k", piece(["low"], at=980.0), now=1010.0)
    # Then its level ranks from the service less the 9 levels between (991 s): not from its
    # head (980 s), nor from the service (1000 s)
    assert [run(a, 1010.0)[1][0] for _ in order] == order


# --- entry ids a stranger wrote ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("entry_id", "unix_s"),
    [
        (b"1700000000123-0", 1700000000.123),
        (b"999999999999999-5", 999999999999.999),  # 15 digits of ms: taken
        (b"1000000000000000-0", None),  # 16: a stranger's id far past any clock
        (b"18446744073709551615-0", None),
    ],
    ids=["redis", "15-digits", "16-digits", "max"],
)
def test_an_entry_id_says_when_it_was_enqueued_unless_it_is_past_any_clock(
    entry_id: bytes, unix_s: float | None
) -> None:
    request = piece(["x"], entry_id=entry_id).request
    assert _enqueued(request, -1.0) == (-1.0 if unix_s is None else pytest.approx(unix_s))


def test_a_key_whose_entries_say_no_time_waits_from_its_batch_clock() -> None:
    # Given a latency target, and entries whose ids say nothing usable (written far ahead)
    a = Assembler(capacity=4, timeout=10.0, unix_offset=900.0)
    a.plan_latency(0.1)
    a.add("k", piece(["x"], entry_id=b"99999999999999999999-0"), now=100.0)
    a.add("k", piece(["y"], priority=1, entry_id=b"99999999999999999999-1"), now=100.0)
    assert a.waiting_since(a.queues["k"]) == 100.0
    assert run(a, 110.0) == ("k", ["y", "x"])


def test_without_a_latency_target_a_batch_waits_from_its_clock() -> None:
    a = Assembler(capacity=4, timeout=10.0, unix_offset=900.0)
    a.add("k", piece(["x"], at=999.5), now=100.0)  # enqueued 0.5 s before it was read
    assert a.waiting_since(a.queues["k"]) == 100.0


# --- the look-ahead with weights (5a3a6ac) --------------------------------------------------------
def test_with_weights_the_look_ahead_counts_one_batch_less_and_never_below_nothing() -> None:
    # Given two keys holding a batch and a half each, capacity 10
    a = Assembler(capacity=10, timeout=0.0)
    a.add("heavy", piece(list(range(15)), at=1.0), 1.0)
    a.add("light", piece(list(range(15)), at=1.0), 1.0)
    # Unweighted: one batch per key counts, 20; weighted: a batch less, 10, so the reader reads
    # the weighted key's next batch while another key's waits
    assert a.look_ahead() == 20.0
    a.weights = {"heavy": 4.0}
    assert a.look_ahead() == 10.0
    # Less than a batch held: nothing counts, never less
    b = Assembler(capacity=10, timeout=0.0)
    b.weights = {"heavy": 4.0}
    b.add("light", piece([1, 2, 3], at=1.0), 1.0)
    assert b.look_ahead() == 0.0
    b.weights = {}
    assert b.look_ahead() == 3.0

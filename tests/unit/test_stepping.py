"""Continuous batching without Redis (issue 14): the join decision, the waiting queue, the
prefix cache, and the StepServing API run inline."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

import queueserve as qs
from queueserve.errors import RedisCommandError, RedisUnavailable
from queueserve.worker.pipeline.batching import Request, Slice
from queueserve.worker.stepping.executor import StepExecutor
from queueserve.worker.stepping.joins import (
    RESERVE_FOR_S,
    CallerWatch,
    Limits,
    Scheduler,
    StepQueue,
    Waiting,
    split_runs,
    too_large,
)
from queueserve.worker.stepping.prefix_cache import PrefixCache
from tests.support.step_app import Count, expected

LIMITS = Limits(
    max_slots=8,
    max_batch_tokens=100,
    max_prefill_tokens=40,
    waiting_served_ratio=0.5,
    max_waiting_steps=3,
)


def waiting(n: int = 1, budget: int = 10, prompt: int = 2, alone: bool = False) -> Waiting:
    request = Request(b"1-0", "s", 1, "inbox", 0.0, n)
    request.alone = alone
    w = Waiting("default", Slice(request, 0, list(range(n))), 0.0)
    w.budget, w.prompt = budget, prompt
    return w


# --- the join decision ------------------------------------------------------------------------


def test_an_idle_running_set_takes_every_waiting_request_that_fits_in_arrival_order() -> None:
    s = Scheduler(LIMITS)
    queue = deque([waiting(3), waiting(4), waiting(2), waiting(1)])
    joined = s.admit(queue)
    # 3 + 4 slots fit max_slots=8; the third (2 slots) does not, and stops the join
    assert [w.slots for w in joined] == [3, 4]
    assert [w.slots for w in queue] == [2, 1]
    assert (s.slots, s.tokens) == (7, 20)


@pytest.mark.parametrize(
    "blocker",
    [
        {"n": 1, "budget": 81},  # 20 reserved + 81 > max_batch_tokens=100
        {"n": 1, "prompt": 39},  # 2 + 39 > max_prefill_tokens=40 in one join
    ],
)
def test_token_budgets_stop_a_join(blocker: dict[str, int]) -> None:
    s = Scheduler(LIMITS)
    queue = deque([waiting(1), waiting(1), waiting(**blocker), waiting(1)])
    assert len(s.admit(queue)) == 2
    assert s.tokens <= LIMITS.max_batch_tokens


def test_while_sequences_run_a_join_waits_for_enough_joiners_or_enough_steps() -> None:
    s = Scheduler(LIMITS)
    s.admit(deque([waiting(4)]))  # 4 running: ratio 0.5 asks for 2 joiners at once
    queue = deque([waiting(1)])
    assert s.admit(queue) == []
    s.stepped()
    s.stepped()
    assert s.admit(queue) == []
    s.stepped()  # max_waiting_steps=3 steps without a join: one joiner is worth it now
    [one] = s.admit(queue)
    # two waiting at once are enough right away
    queue = deque([waiting(1), waiting(1)])
    s.left(one)
    assert len(s.admit(queue)) == 2


def test_a_redelivered_request_runs_alone() -> None:
    s = Scheduler(LIMITS)
    [first] = s.admit(deque([waiting(1)]))
    queue = deque([waiting(1, alone=True), waiting(1)])
    for _ in range(5):
        s.stepped()
    assert s.admit(queue) == []  # something runs: the redelivered one waits, and blocks others
    s.left(first)
    [alone] = s.admit(queue)
    assert alone.piece.request.alone
    assert s.admit(queue) == []  # nothing joins while it runs
    s.left(alone)
    assert len(s.admit(queue)) == 1
    assert (s.slots, s.alone, s.tenants) == (1, 0, {None: 1})


def lane(tenant: str, n: int = 1) -> Waiting:
    """A waiting request of ``tenant``'s lane of key K, as StepQueue.add makes it."""
    q = StepQueue(capacity=8)
    request = Request(b"1-0", "s", 1, "inbox", 0.0, n)
    q.add(f"K\x1f{tenant}", Slice(request, 0, list(range(n))), 0.0)
    w = q.waiting[0]
    w.budget, w.prompt = 10, 2
    return w


def test_a_tenant_with_nothing_running_joins_before_another_tenants_backlog() -> None:
    s = Scheduler(LIMITS)
    running = s.admit(deque(lane("flood") for _ in range(8)))  # every slot: the flood's
    queue = deque([*(lane("flood") for _ in range(5)), lane("quiet"), lane("flood")])
    quiet = queue[5]
    assert quiet.tenant == "quiet"
    s.left(running[0])
    s.left(running[1])  # two slots free: enough to join (ratio 0.5 of 6 running is 3...)
    for _ in range(3):
        s.stepped()  # (... so after max_waiting_steps one joiner is worth it)
    joined = s.admit(queue)
    # the quiet tenant's request first, then the flood's oldest: behind five of the flood's
    assert joined == [quiet, queue_head := joined[1]] and queue_head.tenant == "flood"
    assert [w.tenant for w in queue] == ["flood"] * 4 + ["flood"]
    assert s.tenants == {"flood": 7, "quiet": 1}


def test_an_active_tenant_with_nothing_running_has_a_slot_kept_and_joins_at_once() -> None:
    s = Scheduler(LIMITS)
    # the flood may take 7 of the 8 slots while "quiet" is active and runs nothing
    queue = deque(lane("flood") for _ in range(9))
    assert len(s.admit(queue, {}, ["flood", "quiet"])) == 7
    # a lone request of quiet's joins at the next boundary: no wave of 3 (ratio 0.5 of 7)
    queue.appendleft(lane("quiet"))
    assert [w.tenant for w in s.admit(queue, {}, ["flood", "quiet"])] == ["quiet"]
    # running now, quiet keeps no slot free: a lone flood request waits for a wave again
    assert s.admit(deque([lane("flood")]), {}, ["flood", "quiet"]) == []
    # two active idle tenants: two slots kept, at most a quarter of them (8 // 4 = 2)
    t = Scheduler(LIMITS)
    assert len(t.admit(deque(lane("f") for _ in range(9)), {}, ["f", "x", "y", "z"])) == 6
    # an inactive tenant keeps nothing (the flood alone: every slot)
    u = Scheduler(LIMITS)
    assert len(u.admit(deque(lane("f") for _ in range(9)), {}, ["f"])) == 8


def test_tenants_take_turns_by_running_sequences_for_their_weight() -> None:
    s = Scheduler(LIMITS)
    # a holds 2 running, b none: b's first two go before a's next, then they alternate
    s.admit(deque([lane("a"), lane("a")]))
    for _ in range(3):
        s.stepped()
    queue = deque([lane("a"), lane("a"), lane("a"), lane("b"), lane("b"), lane("b")])
    order = [w.tenant for w in s.in_turn(queue, {})]
    assert order == ["b", "b", "a", "b", "a", "a"]
    # weight 3 for a: its 2 running count as 2/3, then 1, 4/3, 5/3 as it joins; b's 0, 1, 2
    # (a tie goes to the earlier head: a's)
    order = [w.tenant for w in s.in_turn(queue, {"a": 3.0})]
    assert order == ["b", "a", "a", "b", "a", "b"]
    # a request that does not fit stops the join in this order too: b's 7 items stop it
    big = deque([lane("a"), lane("b", 7), lane("a")])
    assert [w.tenant for w in s.admit(big)] == []
    assert [w.slots for w in big] == [1, 7, 1]


def test_one_tenants_queue_keeps_arrival_order_and_needs_no_reordering() -> None:
    s = Scheduler(LIMITS)
    queue = deque([lane("a"), lane("a", 2), lane("a")])
    assert s.in_turn(queue, {}) is queue
    plain = deque([waiting(1), waiting(2)])
    assert s.in_turn(plain, {}) is plain


def test_requests_that_can_never_fit_are_named() -> None:
    assert too_large(waiting(9), LIMITS) is not None
    assert "max_batch_tokens=100" in (too_large(waiting(1, budget=101), LIMITS) or "")
    assert "max_prefill_tokens=40" in (too_large(waiting(1, prompt=41), LIMITS) or "")
    assert too_large(waiting(8, budget=100, prompt=40), LIMITS) is None


def test_the_queue_bounds_reading_and_splits_raw_requests_larger_than_the_slots() -> None:
    q = StepQueue(capacity=4)
    request = Request(b"1-0", "s", 1, "inbox", 0.0, 10)
    q.add("default", Slice(request, 0, list(range(10))), 0.0)
    assert [(w.piece.offset, w.slots) for w in q.waiting] == [(0, 4), (4, 4), (8, 2)]
    assert q.buffered == 10 and q.full_keys() == ["default"]
    q.remove([q.waiting[0]])
    assert q.buffered == 6


def test_split_runs() -> None:
    assert split_runs([1, 2, 3, 4], [True, False, True, True]) == [(0, [1]), (2, [3, 4])]
    assert split_runs([1], [False]) == []


# --- callers that went away ------------------------------------------------------------------


def test_a_caller_is_gone_only_after_its_channel_had_no_subscriber_for_the_whole_grace() -> None:
    watch = CallerWatch(gone_after=5.0, every=1.0)
    assert watch.due(0.0)
    assert watch.looked(0.0, {"a": 0, "b": 1}) == set()
    assert not watch.due(0.5) and watch.due(1.0)
    assert watch.looked(4.9, {"a": 0, "b": 0}) == set()  # a: silent for 4.9 s only
    assert watch.looked(5.0, {"a": 0, "b": 0}) == {"a"}
    assert watch.looked(9.9, {"a": 0, "b": 1}) == {"a"}  # b subscribed again: its clock restarts
    assert watch.looked(14.0, {"b": 0}) == set()


def test_a_failed_look_never_makes_a_caller_gone() -> None:
    # A Redis outage: the client may be reconnecting too, so every clock starts again
    watch = CallerWatch(gone_after=5.0, every=1.0)
    watch.looked(0.0, {"a": 0})
    assert watch.looked(6.0, None) == set()
    assert watch.looked(7.0, {"a": 0}) == set()
    assert watch.looked(12.0, {"a": 0}) == {"a"}


def test_no_output_steps_are_neither_kept_nor_ended() -> None:
    class Reads(qs.StepServing):
        def prefill(self, items: list[int]) -> list[list[int]]:
            return [[n, 0] for n in items]  # [prompt length, step]

        def decode(self, states: list[list[int]]) -> list[Any]:
            out: list[Any] = []
            for s in states:
                s[1] += 1
                out.append(qs.NO_OUTPUT if s[1] <= s[0] else qs.END if s[1] > s[0] + 2 else s[1])
            return out

    assert Reads(name="reads").inline_many([0, 3]) == [[1, 2], [4, 5]]
    steps = list(Reads(name="reads").static_steps([0, 2]))
    assert steps[0] == [1, qs.NO_OUTPUT] and steps[2] == [qs.END, 3]


# --- the prefix cache -------------------------------------------------------------------------


def test_lookup_returns_the_longest_cached_prefix() -> None:
    cache = PrefixCache(1000)
    cache.put("abcdef", 2, "s2", 10)
    cache.put("abcdef", 4, "s4", 10)
    assert cache.lookup("abcdxy") == (4, "s4")
    assert cache.lookup("abz") == (2, "s2")
    assert cache.lookup("xyz") == (0, None)
    assert cache.lookup("ab") == (2, "s2")


def test_the_cache_is_bounded_by_bytes_and_drops_the_least_recently_used() -> None:
    cache = PrefixCache(30)
    cache.put("aaaa", 4, "a", 10)
    cache.put("bbbb", 4, "b", 10)
    cache.put("cccc", 4, "c", 10)
    cache.lookup("aaaa")  # a is now the most recent
    cache.put("dddd", 4, "d", 10)
    assert cache.nbytes == 30
    assert cache.lookup("bbbb") == (0, None)
    assert [cache.lookup(k)[1] for k in ("aaaa", "cccc", "dddd")] == ["a", "c", "d"]
    assert cache.put("eeee", 4, "e", 31) is False  # larger than the whole cache


def test_evicted_branches_are_pruned() -> None:
    cache = PrefixCache(10)
    cache.put("abcdef", 6, "long", 10)
    cache.put("xy", 2, "short", 10)
    assert cache.lookup("abcdef") == (0, None)
    assert cache._root.children.keys() == {"x"}


# --- the API, inline --------------------------------------------------------------------------


def test_inline_runs_the_same_steps_statically() -> None:
    items: list[dict[str, Any]] = [{"n": 3}, {"n": 0}, {"n": 2, "prompt": "hi", "base": 7}]
    assert Count().inline_many(items) == [expected(i) for i in items]


def test_the_decorator_form() -> None:
    @qs.step_serving(
        prefill=lambda items: [[n] for n in items],
        max_slots=2,
        result=lambda state, outputs: sum(outputs),
    )
    def countdown(states: list[list[int]]) -> list[Any]:
        out: list[Any] = []
        for s in states:
            s[0] -= 1
            out.append(qs.END if s[0] < 0 else s[0])
        return out

    assert countdown.name == "countdown"
    assert countdown.max_slots == countdown.batch_size == 2
    assert countdown.inline_many([3, 0, 2]) == [3, 0, 1]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_slots": 0}, "max_slots must be an int >= 1, got 0"),
        ({"max_batch_tokens": -1}, "max_batch_tokens must be an int >= 1, got -1"),
        ({"waiting_served_ratio": -0.5}, "waiting_served_ratio must be a number >= 0"),
        ({"prefix_cache_bytes": -1}, "prefix_cache_bytes must be an int >= 0"),
        ({"caller_gone_after": 0}, "caller_gone_after must be a number of seconds > 0, or None"),
    ],
)
def test_bad_options_are_refused_with_the_value(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Count(**options)


def test_batch_size_is_not_an_option_of_a_step_serving() -> None:
    with pytest.raises(TypeError, match="max_slots"):
        Count(batch_size=4)


def test_max_latency_is_refused_by_a_step_serving_and_says_what_bounds_the_join_wait() -> None:
    with pytest.raises(TypeError, match=r"max_latency is not an option of a StepServing"):
        Count(max_latency="50ms")
    with pytest.raises(TypeError, match=r"bound its wait to join with max_waiting_steps"):
        Count(max_latency=0.05)
    assert Count(max_latency=0).max_latency == 0  # off, as by default


@pytest.mark.parametrize(
    "error", [RedisUnavailable("Redis is down"), RedisCommandError("OOM command not allowed")]
)
def test_a_redelivery_the_stepper_cannot_count_is_logged_and_the_stepper_goes_on(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    def count_delivery(*_: object) -> None:
        raise error

    executor = StepExecutor.__new__(StepExecutor)  # what _count_delivery uses, alone
    executor.broker = SimpleNamespace(count_delivery=count_delivery)  # type: ignore[assignment]
    executor.consumer = "c1"
    executor.serving = SimpleNamespace(name="gen")  # type: ignore[assignment]
    executor._count_delivery(SimpleNamespace(stream="s", entry_id=b"1-0"))  # type: ignore[arg-type]
    assert "could not count a redelivery" in caplog.text


# --- the queue's side of tenants (written for the mutants of joins.py that survived) ----------


def measured(q: StepQueue, budget: int = 10) -> None:
    for w in q.waiting:
        w.budget, w.prompt = budget, 2


def test_the_queue_takes_in_tenants_turn_with_their_weights_and_books_what_left() -> None:
    q = StepQueue(capacity=8)
    q.shares.tenants = {"heavy": 3.0}
    for i, tenant in enumerate(["light", "light", "light", "heavy", "heavy", "heavy"]):
        request = Request(f"{i}-0".encode(), "s", i, "inbox", 0.0, 1)
        q.add(f"K\x1f{tenant}", Slice(request, 0, [i]), 10.0)
    measured(q)
    assert q.waiting[0].tenant == "light" and q.waiting[0].arrived == 10.0
    assert q.read_marks() == ["~heavy=3.0"]  # (not full: the weights alone)
    s = Scheduler(replace(LIMITS, max_slots=4))
    taken = q.take(s, now=10.5)
    # light first (the earlier head, both at 0 running), then heavy's three while its 1/3 a
    # sequence per join stays below light's 1: 4 slots, light 1 and heavy 3
    assert [w.tenant for w in taken] == ["light", "heavy", "heavy", "heavy"]
    assert (q.buffered, q.departed, q.arrived) == (2, 4, 6)
    assert [w.tenant for w in q.waiting] == ["light", "light"]
    assert s.tenants == {"light": 1, "heavy": 3} and (s.slots, s.tokens) == (4, 40)


def test_the_queue_forgets_a_tenant_that_sent_nothing_for_a_while_and_keeps_it_a_slot_before() -> (
    None
):
    def queue_at(now: float) -> tuple[StepQueue, Scheduler]:
        q = StepQueue(capacity=8)
        for i in range(9):
            request = Request(f"{i}-0".encode(), "s", i, "inbox", 0.0, 1)
            q.add("K\x1fflood", Slice(request, 0, [i]), now)
        q.sent["quiet"] = now - RESERVE_FOR_S  # exactly RESERVE_FOR_S ago: still active
        measured(q)
        return q, Scheduler(LIMITS)

    q, s = queue_at(100.0)
    assert len(q.take(s, now=100.0)) == 7  # a slot kept for quiet
    assert set(q.sent) == {"flood", "quiet"}
    q, s = queue_at(100.0)
    assert len(q.take(s, now=100.001)) == 8  # quiet sent nothing for longer: forgotten
    assert set(q.sent) == {"flood"}
    lone = StepQueue(capacity=8)
    lone.sent["old"] = -1e9  # the only tenant seen: nothing to keep a slot for, never pruned
    assert lone.take(Scheduler(LIMITS), now=0.0) == [] and lone.sent == {"old": -1e9}


def test_the_queue_splits_only_raw_requests_larger_than_the_slots() -> None:
    q = StepQueue(capacity=4)
    q.add("K\x1ft", Slice(Request(b"1-0", "s", 1, "inbox", 0.0, 4), 0, [0, 1, 2, 3]), 7.0)
    assert [w.slots for w in q.waiting] == [4] and q.sent == {"t": 7.0}
    q.add("K\x1fu", Slice(Request(b"2-0", "s", 2, "inbox", 0.0, 5), 0, list(range(5))), 8.0)
    assert [(w.slots, w.tenant, w.arrived) for w in q.waiting] == [
        (4, "t", 7.0), (4, "u", 8.0), (1, "u", 8.0)
    ]  # fmt: skip
    assert (q.timeout, q.departed) == (0.0, 0)


def test_joined_and_left_book_alone_tokens_and_tenants() -> None:
    s = Scheduler(LIMITS)
    a, b = waiting(2, budget=30, alone=True), waiting(1, budget=20, alone=True)
    s.joined(a)
    s.joined(b)
    assert (s.slots, s.tokens, s.alone, s.tenants) == (3, 50, 3, {None: 3})
    s.left(a)
    assert (s.slots, s.tokens, s.alone, s.tenants) == (1, 20, 1, {None: 1})


def test_the_slots_kept_free_are_a_quarter_of_the_slots_rounded_down() -> None:
    s = Scheduler(replace(LIMITS, max_slots=6))  # 6 // 4 = 1 slot kept, however many wait
    queue = deque(lane("f") for _ in range(9))
    assert len(s.admit(queue, {}, ["f", "x", "y"])) == 5


def test_a_join_fills_the_token_budgets_exactly_and_takes_the_next_in_turn() -> None:
    s = Scheduler(LIMITS)
    exact = deque([waiting(1, budget=60), waiting(1, budget=40), waiting(1, budget=1)])
    assert [w.budget for w in s.admit(exact)] == [60, 40]  # 100 of max_batch_tokens=100
    t = Scheduler(LIMITS)
    prompts = deque([waiting(1, prompt=38), waiting(1, prompt=2), waiting(1, prompt=1)])
    assert [w.prompt for w in t.admit(prompts)] == [38, 2]  # 40 of max_prefill_tokens=40
    # a request that does not fit stops the join, even when an idle tenant could use a slot
    u = Scheduler(LIMITS)
    big = deque([lane("a", 8), lane("b")])
    assert [w.slots for w in u.admit(big, {}, ["a", "b"])] == []


def test_requests_of_no_tenant_take_turns_with_a_tenants_at_weight_1() -> None:
    s = Scheduler(LIMITS)
    s.admit(deque([waiting(1), lane("t")]))  # one each running
    for _ in range(3):
        s.stepped()
    queue = deque([waiting(1), waiting(1), lane("t"), lane("t")])
    assert [w.tenant for w in s.in_turn(queue, {"t": 1.0})] == [None, "t", None, "t"]
    # weight 2: t's one running counts as 1/2, so t goes first, then they alternate
    assert [w.tenant for w in s.in_turn(queue, {"t": 2.0})] == ["t", None, "t", None]

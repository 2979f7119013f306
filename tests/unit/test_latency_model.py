"""The latency target's model (worker/pipeline/latency.py): what a batch of n items takes,
learned online, and when a batch filling up closes. Pure logic: the clock is passed in."""

from __future__ import annotations

import pytest

from queueserve.worker.pipeline.batching import Assembler, Request, Slice
from queueserve.worker.pipeline.latency import SAFETY, BatchTimes, LatencyPlan

_ids = iter(range(1, 10**9))


def learned(a: float, b: float, sizes: range = range(1, 11), rounds: int = 10) -> BatchTimes:
    times = BatchTimes()
    for _ in range(rounds):
        for n in sizes:
            times.observe(n, a + b * n)
    return times


def test_it_learns_a_plus_b_n_from_the_batches_run() -> None:
    times = learned(0.002, 0.001)
    assert times.a == pytest.approx(0.002)
    assert times.b == pytest.approx(0.001)
    assert times.predict(32) == pytest.approx(0.034)


def test_it_forgets_what_batches_took_long_ago() -> None:
    # Given a model of a quick device, when the same batches take twice as long from now on
    times = learned(0.002, 0.001)
    for _ in range(20):
        for n in range(1, 11):
            times.observe(n, 2 * (0.002 + 0.001 * n))
    # then it follows the machine as it is now
    assert times.predict(10) == pytest.approx(0.024, rel=0.05)


def test_with_one_batch_size_seen_every_item_costs_the_same() -> None:
    times = learned(0.004, 0.0, sizes=range(2, 3))
    assert (times.a, times.b) == (0.0, pytest.approx(0.002))


def test_nonsense_measurements_are_ignored() -> None:
    times = learned(0.002, 0.001)
    for n, t in ((0, 1.0), (4, float("inf")), (4, float("nan")), (4, -1.0)):
        times.observe(n, t)
    assert times.predict(10) == pytest.approx(0.012)


def test_a_lone_item_at_low_load_runs_at_once() -> None:
    plan = LatencyPlan(0.05, learned(0.002, 0.001))
    plan.arrived(1, now=100.0)  # one item in the last RATE_S: about 2 items/s
    assert plan.due(started=100.0, weight=1, now=100.0) == 100.0


def test_under_load_a_batch_waits_its_fixed_cost_at_most_and_never_past_the_target() -> None:
    # Given about 800 items/s arriving where a batch takes 2 ms + 1 ms per item: one item
    # per batch could not keep up (800 * 3 ms > 1 s)
    plan = LatencyPlan(0.05, learned(0.002, 0.001))
    for i in range(400):
        plan.arrived(1, now=100.0 + i / 800)
    now = 100.0 + 399 / 800
    # then a batch of one waits, as long as a batch's fixed cost
    assert plan.due(started=now, weight=1, now=now) == pytest.approx(now + 0.002)
    # and no longer than its oldest item's target allows (less the safety and its run)
    plan.target = 0.005
    due = plan.due(started=now, weight=1, now=now)
    assert due == pytest.approx(now + 0.005 * (1 - SAFETY) - 0.003)
    # and a batch big enough to keep up closes at once
    assert plan.due(started=now, weight=20, now=now) == now


def test_the_assembler_closes_a_batch_when_the_plan_says_and_batch_timeout_bounds_it() -> None:
    a = Assembler(capacity=100, timeout=0.001, unix_offset=900.0)
    a.batch_times.observe(1, 0.003)
    a.batch_times.observe(5, 0.007)  # a = 2 ms, b = 1 ms
    a.plan_latency(1.0)
    assert a.latency is not None
    for i in range(400):  # under load: the plan alone would wait 2 ms, the batch's fixed cost
        a.latency.arrived(1, now=100.0 + i / 800)
    a.add("k", enqueued_at(1, 1000.5), now=100.5)
    chosen, wait = a.pick(now=100.5)
    assert chosen is None and wait == pytest.approx(0.001)  # batch_timeout is the bound
    a.timeout = 0.01
    chosen, wait = a.pick(now=100.5)
    assert chosen is None and wait == pytest.approx(0.002)
    a.plan_latency(0.0)  # off: nothing changes from a serving without it
    assert a.latency is None


def enqueued_at(n: int, unix_s: float) -> Slice:
    """A slice whose request's entry id says Redis wrote it at ``unix_s``."""
    rid = next(_ids)
    request = Request(f"{int(unix_s * 1000)}-0".encode(), "qs:{s}:in:k", rid, "qs:inbox:c", 0, n)
    return Slice(request, 0, list(range(n)))


def test_the_target_counts_the_wait_in_redis_and_behind_a_previous_batch() -> None:
    # Given a worker whose clock reads unix 1000 s at monotonic 100 s, a 100 ms target, under
    # load, on a serving whose batch takes 40 ms + 1 ms per item (a lone item may wait 40 ms)
    a = Assembler(capacity=4, timeout=1.0, unix_offset=900.0)
    a.batch_times.observe(1, 0.041)
    a.batch_times.observe(5, 0.045)
    a.plan_latency(0.1)
    assert a.latency is not None
    for i in range(400):
        a.latency.arrived(1, now=100.0 + i / 800)
    # When an item read now was enqueued 30 ms ago (it waited in Redis)
    a.add("k", enqueued_at(1, 1000.47), now=100.5)
    # then its batch closes when those 30 ms, its wait here and its run reach the target less
    # the safety: 9 ms from now, not 39 ms
    chosen, wait = a.pick(now=100.5)
    assert chosen is None and wait == pytest.approx(0.1 * (1 - SAFETY) - 0.041 - 0.03)
    # and one enqueued longer ago than the target runs at once
    a.add("old", enqueued_at(1, 1000.3), now=100.5)
    chosen, _ = a.pick(now=100.5)
    assert chosen is not None and chosen.key == "old"
    # And what a batch leaves behind counts from when it was enqueued, not from the take
    a.add("k", enqueued_at(6, 1000.47), now=100.5)
    batch = a.take(a.queues["k"], now=100.5)
    assert batch.since == pytest.approx(100.47)
    assert a.waiting_since(a.queues["k"]) == pytest.approx(100.47)

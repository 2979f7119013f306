"""What the latency model promises beyond tests/unit/test_latency_model.py, each written for a
mutant of queueserve/worker/pipeline/latency.py that survived it (docs/testing.md): the model
before any batch, fits it must refuse, a measurement of 0 s, the arrival rate between reads,
and the boundary of a batch size that keeps up. Pure logic: the clock is passed in."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from queueserve.worker.pipeline.latency import RATE_S, BatchTimes, LatencyPlan


def test_before_any_batch_a_batch_is_expected_to_take_no_time() -> None:
    # The assembler ranks a key's next turn from when its batch is expected to end
    # (batching.py, take: now + predict) from the first batch on, before anything is measured
    times = BatchTimes()
    assert (times.a, times.b, times.batches) == (0.0, 0.0, 0)
    assert [times.predict(n) for n in (0, 1, 64)] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("what", "took"),
    [
        ("a negative fixed cost", lambda n: -0.0005 + 0.001 * n),
        ("a negative cost per item", lambda n: 0.01 - 0.001 * n),
    ],
)
def test_a_fit_that_says_something_costs_less_than_nothing_is_refused(
    what: str, took: Callable[[int], float]
) -> None:
    # Given batches of 1 and 5 items whose times draw a line with (what) below zero
    times = BatchTimes()
    for n in (1, 5):
        times.observe(n, took(n))
    # then every item costs the same instead: the mean time per item
    per_item = (took(1) * 0.95 + took(5)) / (1 * 0.95 + 5)
    assert times.a == 0.0, what
    assert times.b == pytest.approx(per_item), what


def test_a_device_whose_batches_take_as_long_at_every_size_is_learned_as_a_fixed_cost() -> None:
    times = BatchTimes()
    for n in (1, 3, 1, 3):
        times.observe(n, 0.25)
    assert (times.a, times.b) == (0.25, 0.0)
    assert times.predict(1) == times.predict(8) == 0.25


def test_sizes_that_were_all_the_same_lately_count_as_one_size() -> None:
    # Given one batch of 20 items long ago and 400 batches of 10 since: the old batch weighs
    # 0.95**400 (1e-9) of a new one, so the sizes' spread is below what a fit can stand on
    times = BatchTimes()
    times.observe(20, 0.03)
    for _ in range(400):
        times.observe(10, 0.02)
    # then every item costs the same, as with one size seen (not a line through the old batch,
    # which says 10 ms + 1 ms per item, and 11 ms for a lone item)
    assert times.a == 0.0
    assert times.predict(1) == pytest.approx(0.002)


def test_a_batch_measured_at_0_seconds_is_a_measurement() -> None:
    # A no-op batch on a coarse clock takes 0 s; it is what the device did, not nonsense
    times = BatchTimes()
    times.observe(4, 0.0)
    assert times.batches == 1
    for _ in range(100):
        times.observe(10, 0.0)
    assert times.batches == 101
    assert times.predict(10) == 0.0


def test_a_new_plan_has_seen_nothing_arrive() -> None:
    plan = LatencyPlan(0.05, BatchTimes())
    assert plan.rate(0.0) == plan.rate(0.25) == plan.rate(1e6) == 0.0


def test_the_rate_forgets_arrivals_over_rate_s() -> None:
    plan = LatencyPlan(0.05, BatchTimes())
    plan.arrived(100, now=10.0)
    assert plan.rate(10.0) == pytest.approx(100 / RATE_S)
    # Nothing more arrives: the rate falls by e for every RATE_S since
    assert plan.rate(10.0 + RATE_S) == pytest.approx(100 / RATE_S / math.e)
    assert plan.rate(10.0 + 2 * RATE_S) == pytest.approx(100 / RATE_S / math.e**2)
    # and what arrives later adds to what is left of the earlier
    plan.arrived(10, now=10.0 + 2 * RATE_S)
    assert plan.rate(10.0 + 2 * RATE_S) == pytest.approx((100 / math.e**2 + 10) / RATE_S)
    assert plan.rate(10.0 + 3 * RATE_S) == pytest.approx((100 / math.e**3 + 10 / math.e) / RATE_S)


def test_a_batch_just_big_enough_to_keep_up_closes_at_once() -> None:
    # Given a batch that takes 0.25 s whatever its size, and 4 items/s arriving
    times = BatchTimes()
    for n in (1, 3):
        times.observe(n, 0.25)
    plan = LatencyPlan(10.0, times)
    plan.arrived(2, now=100.0)  # 2 items read at once: 2 / RATE_S = 4 items/s
    assert plan.rate(100.0) == 4.0
    # then a batch of one item every 0.25 s keeps up exactly: it runs at once
    assert plan.due(started=100.0, weight=1, now=100.0) == 100.0
    # and a smaller one (in cost units) waits one batch's fixed cost
    assert plan.due(started=100.0, weight=0.5, now=100.0) == 100.25

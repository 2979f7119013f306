"""A serving's figures in a worker's record (wire/figures.py) and the dashboard's health rules
(dashboard/health.py, docs/operations.md "Dashboard: status"), without Redis."""

from __future__ import annotations

import math
import random

import pytest

from queueserve.dashboard.health import (
    ERROR_RATE,
    MAX_KEPT,
    OLDEST_WAITING_S,
    SAMPLE_EVERY_S,
    WINDOW_S,
    Histories,
    Sample,
    status,
)
from queueserve.wire.figures import BUCKETS, LATENCY_BOUNDS, MAX_TEXT, Figures, parse, quantile


def test_figures_come_back_as_they_were_written() -> None:
    rng = random.Random(7)
    for _ in range(200):
        qt = [rng.choice((0, 0, 1, 10**17)) for _ in range(BUCKETS)]
        e2e = [rng.choice((0, 3)) for _ in range(BUCKETS)]
        figures = Figures(rng.randrange(10**6), rng.randrange(100), rng.randrange(5), qt, e2e)
        assert parse(figures.encode()) == figures
    assert Figures().encode() == "0 0 0;;"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "1 2;;",
        "1 2 3 4;;",
        "1 2 -3;;",
        "1 2 3;;;",
        "1 2 3;x;",
        "1  2 3;;",
        "1 2 3;" + " ".join(["1"] * (BUCKETS + 1)) + ";",
        "1 2 3;" + "9" * 19 + ";",
        "1 2 3;" + "1 " * MAX_TEXT + ";",
        "1 2 \u0663;;",  # a digit, but not an ASCII one
    ],
)
def test_a_record_field_of_another_shape_holds_no_figures(text: str) -> None:
    assert parse(text) is None


def prometheus_quantile(q: float, counts: list[int]) -> float:
    """histogram_quantile as Prometheus' promql/quantile.go computes it, on cumulative
    buckets: the reference the page's figures are compared with."""
    cumulative, total = [], 0
    for n in counts:
        total += n
        cumulative.append(total)
    rank = q * total
    b = next(i for i, c in enumerate(cumulative) if c >= rank)
    if b == len(LATENCY_BOUNDS):
        return float(LATENCY_BOUNDS[-1])
    start, end = (0.0 if b == 0 else LATENCY_BOUNDS[b - 1]), LATENCY_BOUNDS[b]
    below = 0 if b == 0 else cumulative[b - 1]
    return start + (end - start) * (rank - below) / (cumulative[b] - below)


def test_quantiles_are_prometheus_histogram_quantile() -> None:
    rng = random.Random(3)
    for _ in range(500):
        counts = [rng.choice((0, 0, 0, 1, 5, 40)) for _ in range(BUCKETS)]
        if not sum(counts):
            continue
        for q in (0.5, 0.9, 0.99):
            assert math.isclose(quantile(q, counts), prometheus_quantile(q, counts)), counts
    assert quantile(0.99, [0] * BUCKETS) is None
    # all in the first bucket: linear from 0 to its bound
    assert quantile(0.5, [10] + [0] * (BUCKETS - 1)) == pytest.approx(LATENCY_BOUNDS[0] / 2)


def figures(items: int, failures: int = 0, batches: int = 1) -> Figures:
    out = Figures(items, batches, failures)
    out.queue_time[3] = items
    return out


def window_after(*samples: Sample) -> dict[str, object]:
    histories = Histories()
    for sample in samples:
        _, window = histories.sampled("s", sample)
    return window


def test_an_idle_serving_sharing_a_partition_gets_none_of_its_items() -> None:
    # Given one partition's figures of two servings, one busy and one idle
    histories = Histories()
    histories.sampled("busy", Sample(100.0, {"w": figures(1000)}, 0))
    histories.sampled("idle", Sample(100.0, {"w": figures(0, batches=0)}, 0))
    busy_points, busy = histories.sampled("busy", Sample(102.0, {"w": figures(3000, batches=2)}, 0))
    _, idle = histories.sampled("idle", Sample(102.0, {"w": figures(0, batches=0)}, 0))
    # Then each is credited its own
    assert busy["items_per_s"] == 1000.0 and idle["items_per_s"] == 0.0
    assert busy_points[-1]["batch_size"] == 2000.0


def test_a_counter_that_went_back_is_another_partition_and_counts_nothing() -> None:
    window = window_after(
        Sample(100.0, {"w": figures(500), "v": figures(10)}, 0),
        Sample(103.0, {"w": figures(100), "v": figures(40)}, 0),
    )
    assert window["items"] == 30


def test_samples_closer_than_the_sampling_period_are_not_kept() -> None:
    histories = Histories()
    histories.sampled("s", Sample(100.0, {"w": figures(0)}, 0))
    points, _ = histories.sampled("s", Sample(100.0 + SAMPLE_EVERY_S / 2, {"w": figures(5)}, 0))
    assert points == []


def test_the_window_holds_the_last_minute() -> None:
    histories = Histories()
    at = 0.0
    histories.sampled("s", Sample(at, {"w": figures(0)}, 0))
    total = 0
    for i in range(60):
        at += 2
        total += 10 * (i < 30)  # items only in the first minute, failures with them
        _, window = histories.sampled("s", Sample(at, {"w": figures(total, total)}, 0))
    assert window["items"] == 0 and window["error_rate"] is None
    assert window["window_s"] == WINDOW_S


def judged(**given: object) -> str:
    window = {
        "items": 100,
        "error_rate": 0.0,
        "window_s": 60.0,
        "dead_letters_before": 0,
        **given.pop("window", {}),  # type: ignore[dict-item]
    }
    args = {
        "queued": 0,
        "workers_alive": 1,
        "oldest_ms": 0,
        "dead_letters": 0,
        "max_latency_s": 0.0,
        **given,
    }
    return str(status(window, **args)["status"])  # type: ignore[arg-type]


def test_each_status_rule_holds_under_its_condition_and_not_without() -> None:
    assert judged() == "busy"
    assert judged(window={"items": 0, "error_rate": None}) == "idle"
    assert judged(window={"items": 0, "error_rate": None}, queued=3) == "busy"
    # no worker while work waits (and not when nothing waits)
    assert judged(queued=3, workers_alive=0) == "no worker"
    assert judged(queued=0, workers_alive=0) == "busy"
    # error rate over the threshold
    assert judged(window={"error_rate": ERROR_RATE + 0.01}) == "failing"
    assert judged(window={"error_rate": ERROR_RATE}) == "busy"
    # oldest waiting past max_latency, or the threshold without one
    assert judged(oldest_ms=OLDEST_WAITING_S * 1000 + 1) == "waiting long"
    assert judged(oldest_ms=OLDEST_WAITING_S * 1000) == "busy"
    assert judged(oldest_ms=600, max_latency_s=0.5) == "waiting long"
    assert judged(oldest_ms=400, max_latency_s=0.5) == "busy"
    # dead letters growing over the window
    assert judged(dead_letters=2, window={"dead_letters_before": 1}) == "dead letters growing"
    assert judged(dead_letters=2, window={"dead_letters_before": 2}) == "busy"
    assert judged(dead_letters=2, window={"dead_letters_before": None}) == "busy"
    # the first rule that holds names the status; each that holds is a reason
    both = status(
        {"items": 10, "error_rate": 1.0, "window_s": 4.0, "dead_letters_before": 0},
        queued=5,
        workers_alive=0,
        oldest_ms=0,
        dead_letters=1,
        max_latency_s=0.0,
    )
    assert both["status"] == "no worker" and both["level"] == "bad"
    assert len(both["reasons"]) == 3, both


def test_only_the_servings_sampled_last_are_kept() -> None:
    histories = Histories()
    for i in range(MAX_KEPT + 1):
        histories.sampled(f"s{i}", Sample(100.0, {"w": figures(0)}, 0))
    # the one sampled first was pushed out by the last: it starts again, the others go on
    assert histories.sampled("s1", Sample(103.0, {"w": figures(9)}, 0))[0]
    assert histories.sampled("s0", Sample(103.0, {"w": figures(9)}, 0))[0] == []

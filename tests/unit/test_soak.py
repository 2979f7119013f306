"""bench/soak.py counts items whose answer came back right, and exits non-zero on any error or
a missed budget (it used to count the items it sent and exit 0 on a MISS)."""

from __future__ import annotations

import argparse

from bench.soak import Load, report

ARGS = argparse.Namespace(minutes=1.0, json=None)


def samples(growth: float, until: float = 60.0) -> list[tuple[float, float, int]]:
    return [(0.0, 50.0, 0), (10.0, 100.0, 10), (until, 100.0 * (1 + growth), 20)]


def test_only_items_answered_right_count_and_a_wrong_one_stops_the_run() -> None:
    load = Load()
    load.check("map", [0, 1, 2], [0, 1, 2])
    assert (load.answered, load.errors, load.stop.is_set()) == (3, [], False)
    load.check("map", [0, 9], [0, 1, 2])
    assert load.answered == 4 and load.stop.is_set()
    assert load.errors == ["map: 2 of 3 items answered wrong (2 answers)"]


def test_the_exit_code_is_zero_only_when_every_call_was_right_and_memory_within_budget() -> None:
    assert report(Load(), samples(0.04), 60.0, ARGS) == 0
    assert report(Load(), samples(0.06), 60.0, ARGS) == 1
    assert report(Load(), samples(0.0, until=30.0), 60.0, ARGS) == 1  # stopped early
    assert report(Load(), [], 60.0, ARGS) == 1
    failed = Load()
    failed.fail("single-0: Timeout: no answer")
    assert report(failed, samples(0.0), 60.0, ARGS) == 1

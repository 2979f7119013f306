"""bench/models.py's figures: the offline optimum it compares loads with is Belady's (checked
against every eviction choice on small sequences), and its budgets are judged from the figures
as issue 41 states them."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from bench import models


def fewest_loads(sequence: list[str], cache: int) -> int:
    """The least loads any eviction choices give (every choice tried): the reference."""
    best = len(sequence)

    def go(i: int, held: frozenset[str], loads: int) -> None:
        nonlocal best
        if loads >= best:
            return
        if i == len(sequence):
            best = loads
            return
        key = sequence[i]
        if key in held:
            go(i + 1, held, loads)
        elif len(held) < cache:
            go(i + 1, held | {key}, loads + 1)
        else:
            for out in held:
                go(i + 1, (held - {out}) | {key}, loads + 1)

    go(0, frozenset(), 0)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_belady_gives_the_fewest_loads_any_eviction_order_gives(seed: int) -> None:
    keys = "abcde"
    sequence = [keys[(seed * 7 + i * i * (seed % 5 + 1)) % len(keys)] for i in range(10)]
    for cache in (1, 2, 3):
        assert models.belady(sequence, cache) == fewest_loads(sequence, cache), sequence


def test_belady_per_partition_sums_each_partitions_own_sequence() -> None:
    batches = [("p1", "a"), ("p2", "a"), ("p1", "b"), ("p1", "a"), ("p2", "b")]
    assert models.belady_per_partition(batches, 1) == 3 + 2


def test_zipf_weights_and_deciles() -> None:
    weights = models.zipf_weights()
    assert sum(weights) == pytest.approx(1.0)
    assert weights[0] / weights[1] == pytest.approx(2**1.1)
    deciles = [models.decile(r) for r in range(models.KEYS)]
    assert deciles[0] == 0 and deciles[-1] == 9 and sorted(deciles) == deciles
    assert {d: deciles.count(d) for d in range(10)} == {
        d: len(list(g)) for d, g in itertools.groupby(deciles)
    }


def row(
    variant: str, items_per_s: float, loads: int = 0, belady: int = 1, cold: float = 1.0
) -> Any:
    deciles = {
        0: {"n": 10, "p50_ms": 1.0, "p99_ms": 10.0},
        9: {"n": 5, "p50_ms": 1.0, "p99_ms": cold},
    }
    return {
        "variant": variant,
        "partitions": 2,
        "items_per_s": items_per_s,
        "loads": loads,
        "belady": belady,
        "deciles": deciles,
    }


def test_the_budgets_are_judged_as_issue_41_states_them() -> None:
    met = models.verdicts([row("cached", 90.0, 13, 10, 30.0), row("ideal", 100.0)])
    assert [v.met for v in met] == [True, True, True]
    missed = models.verdicts([row("cached", 89.0, 14, 10, 31.0), row("ideal", 100.0)])
    assert [v.met for v in missed] == [False, False, False]

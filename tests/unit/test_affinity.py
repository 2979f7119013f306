"""The read choice of a serving with load_key (worker/pipeline/affinity.py): which ready key a
read takes first, from the keys held here and elsewhere, the ready keys' ages and the lean.
tests/integration/test_affinity_reads.py holds read.lua to the same table."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from queueserve.worker.pipeline.affinity import Affinity, Ready, read_order


@dataclass(frozen=True)
class Row:
    """Ready keys as (key, ms waited, lead), oldest first; who holds what; the lean; the key
    a read takes first; why."""

    ready: tuple[tuple[str, int, bool], ...]
    here: frozenset[str]
    elsewhere: frozenset[str]
    lean_ms: int
    first: str
    why: str


def row(ready: str, here: str, elsewhere: str, lean_ms: int, first: str, why: str) -> Row:
    """``ready``: "a:10 b:50 q:0+" (key:ms waited, + for a quiet key's lead)."""
    parsed = []
    for part in ready.split():
        key, _, age = part.partition(":")
        parsed.append((key.replace("|", "\x1f"), int(age.rstrip("+")), age.endswith("+")))
    return Row(
        tuple(sorted(parsed, key=lambda p: -p[1] - (60_000 if p[2] else 0))),
        frozenset(here.split()),
        frozenset(elsewhere.split()),
        lean_ms,
        first.replace("|", "\x1f"),
        why,
    )


TABLE = [
    row("a:10 b:50", "a", "", 100, "a", "held here, before an unheld key 40 ms older"),
    row("a:10 b:150", "a", "", 100, "b", "an unheld key past its lean goes first: its turn kept"),
    row("b:100 c:150", "", "c", 100, "b", "held by nobody before held elsewhere (2 leans)"),
    row("a:50 c:300", "a", "c", 100, "c", "held elsewhere, past two leans, goes first"),
    row("a:50 c:200", "a", "c", 100, "a", "held elsewhere, within two leans, waits"),
    row("a:10 c:20", "a", "c", 0, "c", "no lean (no load measured yet): rank order"),
    row("a:500 q:0+", "a", "", 100, "q", "a quiet key's lead is not leaned"),
    row("a|t1:10 b:50", "a", "", 100, "a|t1", "a tenant's lane of a held key is held"),
    row("a:10 b:50", "a", "a", 100, "a", "held here and elsewhere: held here"),
    row("b:10 d:40", "", "", 100, "d", "all unheld: rank order"),
    row("c:10 e:300", "", "c e", 100, "e", "held elsewhere: past two leans, read"),
    row("b:10 c:150", "", "c", 100, "b", "held elsewhere under two leans: left to its holder"),
    row("c:10 e:40", "", "c e", 100, "-", "all held elsewhere, under two leans: none read"),
]


def readies(r: Row) -> list[Ready]:
    return [Ready(key, -age - (60_000 if lead else 0), lead) for key, age, lead in r.ready]


@pytest.mark.parametrize("r", TABLE, ids=[r.why for r in TABLE])
def test_the_read_choice_table(r: Row) -> None:
    order = read_order(readies(r), r.here, r.elsewhere, r.lean_ms)
    assert (order[0] if order else "-") == r.first


def test_every_key_is_read_in_the_order_of_its_leaned_rank() -> None:
    ready = [Ready("x", 0), Ready("h", 50), Ready("y", 60), Ready("e", 100), Ready("h2", 250)]
    # x: 100, h: 50, y: 160, e: 300 (left to its holder until now is 300), h2: 250
    assert read_order(ready, {"h", "h2"}, {"e"}, 100, now=299) == ["h", "x", "y", "h2"]
    assert read_order(ready, {"h", "h2"}, {"e"}, 100, now=300) == ["h", "x", "y", "h2", "e"]


def test_affinity_publishes_its_marks_only_once_a_load_was_timed() -> None:
    published: list[list[str]] = []
    held = ["a", "b"]
    load_s = [0.0]
    affinity = Affinity(lambda: held, lambda: load_s[0], published.append)
    affinity.follow({"b", "c"})
    assert published[-1] == []  # no load timed: every key is held by nobody
    load_s[0] = 5.0  # a lean is at most MAX_LEAN_S
    affinity.refresh()
    assert published[-1] == ["!500", "@a", "@b", "^c"]

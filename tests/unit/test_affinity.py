"""The read choice of a serving with load_key (worker/pipeline/affinity.py): which ready key a
read takes first, from the keys held here and elsewhere, the ready keys' ages and the lean.
tests/integration/test_affinity_reads.py holds read.lua to the same table."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from queueserve.worker.pipeline.affinity import Affinity, ReadMarks, Ready, read_order


@dataclass(frozen=True)
class Row:
    """Ready keys as (key, ms waited, lead), oldest first; who holds what; the lean; whether
    the partition may load a key ('*') and holds work already; the key a read with room for
    one takes; why."""

    ready: tuple[tuple[str, int, bool], ...]
    here: frozenset[str]
    elsewhere: frozenset[str]
    lean_ms: int
    first: str
    why: str
    may_load: bool = True
    holds_work: bool = False


def row(
    ready: str,
    here: str,
    elsewhere: str,
    lean_ms: int,
    first: str,
    why: str,
    may_load: bool = True,
    holds_work: bool = False,
) -> Row:
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
        may_load,
        holds_work,
    )


TABLE = [
    row("a:10 b:50", "a", "", 100, "a", "held here, before an unheld key 40 ms older"),
    row("a:10 b:150", "a", "", 100, "a", "held here, before an unheld key past its lean"),
    row("b:150", "", "", 100, "b", "an unheld key past its lean is loaded"),
    row("b:150", "", "", 100, "-", "not while the partition may not load", may_load=False),
    row("b:50", "", "", 100, "b", "within its lean, by a partition with nothing to do"),
    row("b:50", "", "", 100, "-", "within its lean, it gathers items", holds_work=True),
    row("b:150", "", "", 100, "b", "past its lean, read beside work held", holds_work=True),
    row("b:100 c:150", "", "c", 100, "b", "held by nobody before held elsewhere (2 leans)"),
    row("b:300 c:300", "", "c", 100, "b", "one lean before two, as old"),
    row("b:150 c:300", "", "c", 100, "c", "held elsewhere, two leans past, before one past"),
    row("a:50 c:300", "a", "c", 100, "a", "held here before held elsewhere past two leans"),
    row("c:300", "", "c", 100, "c", "held elsewhere, past two leans: loaded"),
    row("a:50 c:150", "a", "c", 100, "a", "held elsewhere, within two leans, waits"),
    row("c:150", "", "c", 100, "-", "held elsewhere, within two leans: left to its holder"),
    row("a:10 c:20", "a", "c", 0, "c", "no lean (no load measured yet): rank order"),
    row("a:500 q:0+", "a", "", 100, "q", "a quiet key's lead is not leaned"),
    row("q:0+", "", "", 100, "q", "a quiet key's lead needs no room to load", may_load=False),
    row("a|t1:10 b:50", "a", "", 100, "a|t1", "a tenant's lane of a held key is held"),
    row("b|t1:150", "", "", 100, "b|t1", "a tenant's lane of an unheld key is unheld"),
    row("a:10 b:50", "a", "a", 100, "a", "held here and elsewhere: held here"),
    row("b:10 d:40", "", "", 100, "-", "two unheld within their leans: both gather items"),
    row("b:10 d:140", "", "", 100, "d", "two unheld: the first past its lean"),
    row("c:10 e:300", "", "c e", 100, "e", "held elsewhere: past two leans, read"),
    row("b:10 c:150", "", "c", 100, "b", "held elsewhere under two leans: left to its holder"),
    row("c:10 e:40", "", "c e", 100, "-", "all held elsewhere, under two leans: none read"),
]


def readies(r: Row) -> list[Ready]:
    return [Ready(key, -age - (60_000 if lead else 0), lead) for key, age, lead in r.ready]


@pytest.mark.parametrize("r", TABLE, ids=[r.why for r in TABLE])
def test_the_read_choice_table(r: Row) -> None:
    order = read_order(readies(r), r.here, r.elsewhere, r.lean_ms, 0, r.may_load, r.holds_work)
    assert (order[0] if order else "-") == r.first


def test_a_read_takes_the_held_keys_by_rank_then_one_key_to_load() -> None:
    ready = [Ready("x", 0), Ready("h", 50), Ready("y", 60), Ready("e", 100), Ready("h2", 250)]
    # x: 100, y: 160, e: 300 (left to its holder until now is 300); h and h2 held here
    assert read_order(ready, {"h", "h2"}, {"e"}, 100, now=99) == ["h", "h2"]
    assert read_order(ready, {"h", "h2"}, {"e"}, 100, now=100) == ["h", "h2", "x"]
    assert read_order(ready, {"h", "h2"}, set(), 100, now=300) == ["h", "h2", "x"]
    assert read_order(ready, set(), {"e"}, 100, now=300) == ["x"]  # h: 150, x: 100
    assert read_order(ready[3:], set(), {"e"}, 100, now=300) == ["e"]  # before h2 at 350


def test_affinity_publishes_its_marks_only_once_a_load_was_timed() -> None:
    published: list[ReadMarks] = []
    held = ["a", "b"]
    load_s = [0.0]
    may_load = [True]
    affinity = Affinity(
        lambda: held, lambda: load_s[0], published.append, lambda: 8, lambda: may_load[0]
    )
    affinity.follow({"b", "c"})
    assert list(published[-1]) == []  # no load timed: every key is held by nobody
    load_s[0] = 0.02  # the lean: a load's time per item of a batch of 8
    affinity.refresh()
    assert list(published[-1]) == ["!160", "@a", "@b", "^c", "*"]
    may_load[0] = False  # '*' is asked at each read
    assert list(published[-1]) == ["!160", "@a", "@b", "^c"]
    load_s[0] = 5.0  # a lean is at most MAX_LEAN_S
    affinity.refresh()
    assert list(published[-1]) == ["!500", "@a", "@b", "^c"]

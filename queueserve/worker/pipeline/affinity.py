"""Reads that follow what is loaded: a partition of a serving with ``load_key`` reads first the
ready keys whose state it holds, then keys no partition holds, then keys another partition
holds, within a bound that keeps every key's turn (docs/usage.md, "Many models behind one
serving"; docs/architecture.md, "Reads that follow what is loaded").

The choice is ``read_order``, a pure function of the ready keys (in rank order, with their
ranks), the keys held here, those held elsewhere and the lean: a key held by no partition is
read as if it were ranked ``lean`` ms later than it is; a key another partition holds is left
to that partition until its rank is two leans old (this partition reads the rest meanwhile:
were it to take it whenever it has room, every partition would load every key), then read as
if ranked ``2 * lean`` ms later; a key held here and a quiet key's lead as ranked. So a key
waits at most two leans more than its turn, whoever holds what; the lean is what a load takes
here (the partition's average), at most MAX_LEAN_S: reading a key held here instead of loading
another is worth waiting as long as the load would have taken, never more. read.lua makes the same
choice on the ready set (its '@', '^' and '!' marks, which ``Affinity.marks`` writes), and
tests/unit/test_affinity.py holds both to one table.

Each partition says which keys it holds in its heartbeat record (field ``held:<serving>``,
the keys one per line); a partition whose heartbeat is DEAD_AFTER_S old holds nothing, so a
dead partition's keys count as held by nobody.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from queueserve.wire.figures import HELD_FIELD as HELD_FIELD  # the record's field
from queueserve.wire.tenants import split_lane

MAX_LEAN_S = 0.5


@dataclass(frozen=True)
class Ready:
    """A ready key as read.lua sees it: its rank (ms; lower is read first) and whether it is
    a quiet key's lead (read first, held or not)."""

    key: str
    rank: float
    lead: bool = False


def read_order(
    ready: Sequence[Ready],
    here: Collection[str],
    elsewhere: Collection[str],
    lean_ms: float,
    now: float = 0.0,
) -> list[str]:
    """The keys of ``ready`` in the order a read takes them at ``now`` (ms, as the ranks): by
    rank, a key not held here ranked ``lean_ms`` later; one held elsewhere (and not here) left
    to its holder until its rank is two leans old, then ranked ``2 * lean_ms`` later; leads and
    keys held here as ranked; ties in rank order. A tenant's lane of a key counts as the key
    (``split_lane``)."""

    def lean(entry: Ready) -> float:
        if entry.lead or lean_ms <= 0:
            return 0.0
        key = split_lane(entry.key)[0]
        if key in here:
            return 0.0
        return 2 * lean_ms if key in elsewhere else lean_ms

    def left(entry: Ready) -> bool:
        return lean(entry) == 2 * lean_ms and entry.rank + 2 * lean_ms > now

    ranked = sorted(enumerate(ready), key=lambda p: (p[1].rank + lean(p[1]), p[0]))
    return [entry.key for _, entry in ranked if not left(entry)]


class Affinity:
    """One serving's partition: the keys it holds (``held``, from its key states), those its
    other partitions hold (``follow``, after each heartbeat) and read.lua's marks of both,
    handed to ``publish`` (the assembler's ``affinity_marks``) whenever either changes."""

    def __init__(
        self,
        held: Callable[[], list[str]],
        load_s: Callable[[], float],
        publish: Callable[[list[str]], None],
    ) -> None:
        self._held = held
        self._load_s = load_s
        self._publish = publish
        self.elsewhere: frozenset[str] = frozenset()

    def held(self) -> list[str]:
        return self._held()

    def lean_ms(self) -> int:
        return int(min(self._load_s(), MAX_LEAN_S) * 1000)

    def follow(self, elsewhere: Collection[str]) -> None:
        """What the other partitions hold now."""
        self.elsewhere = frozenset(elsewhere)
        self.refresh()

    def refresh(self) -> None:
        """Publish read.lua's marks: '!<lean ms>', '@<key>' held here, '^<key>' held
        elsewhere (none while the lean is 0: before a load, every key is held by nobody)."""
        lean = self.lean_ms()
        if lean <= 0:
            self._publish([])
            return
        here = self._held()
        self._publish(
            [
                f"!{lean}",
                *(f"@{key}" for key in here),
                *(f"^{key}" for key in self.elsewhere.difference(here)),
            ]
        )

"""Reads that follow what is loaded: a partition of a serving with ``load_key`` reads first the
ready keys whose state it holds, and loads the others one at a time, in the order of their
turns charged with their load (docs/usage.md, "Many models behind one serving";
docs/architecture.md, "Reads that follow what is loaded").

The choice is ``read_order``, a pure function of the ready keys (in rank order, with their
ranks), the keys held here, those held elsewhere, the lean, and whether the partition may load
a key now. Keys held here and a quiet key's lead are read as ranked. Every other key costs a
load, so it is *deferred*: a key held by no partition ranks ``lean`` ms later than it is; a key
another partition holds is left to that partition until its rank is two leans old, then ranks
``2 * lean`` ms later (were a partition to take it whenever it has room, every partition would
load every key). Of the deferred keys a read takes one, the first by leaned rank, and only
while the partition may load (fewer of the keys it read wait for a load than it loads at once:
``KeyStates.max_loading``), and only once its leaned rank is past, or at once when it is the
only one, the read takes nothing else and the partition holds no work (a lone key on an idle
partition gathers nothing by waiting). So a key nobody holds gathers items for a lean, then
waits for the loads of the deferred keys ranked before it, one load's time each, spread over
the partitions, while held keys fill the device: every key's wait is bounded, by the lean and
the loads of the keys ready before it. The lean is what loading the key for each item of a
batch would take (the partition's average load times ``batch_size``), at most MAX_LEAN_S.
read.lua makes the same choice on the ready set (its '@', '^', '!' and '*' marks, which
``Affinity`` publishes), and tests/unit/test_affinity.py holds both to one table.

Each partition says which keys it holds in its heartbeat record (field ``held:<serving>``,
the keys one per line); a partition whose heartbeat is DEAD_AFTER_S old holds nothing, so a
dead partition's keys count as held by nobody.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
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
    may_load: bool = True,
    holds_work: bool = False,
) -> list[str]:
    """The keys of ``ready`` a read takes at ``now`` (ms, as the ranks), in order: leads and keys
    held here (every key, with no lean) by rank; then, if ``may_load``, one deferred key: the
    first by leaned rank (a key not held here ``lean_ms`` later, one held elsewhere ``2 *
    lean_ms`` later and left to its holder until then; ties: held by nobody first, then rank
    order), once its leaned rank is past, or at once when it is the only one, nothing else is
    read and the worker holds no work (``holds_work``). A tenant's lane of a key counts as the
    key (``split_lane``)."""

    def lean(entry: Ready) -> float:
        if entry.lead or lean_ms <= 0:
            return 0.0
        key = split_lane(entry.key)[0]
        if key in here:
            return 0.0
        return 2 * lean_ms if key in elsewhere else lean_ms

    ranked = [e.key for e in sorted(ready, key=lambda e: e.rank) if lean(e) == 0.0]
    deferred = [
        (e.rank + lean(e), lean(e), i, e.key)
        for i, e in enumerate(ready)
        if lean(e) > 0.0 and not (lean(e) == 2 * lean_ms and e.rank + 2 * lean_ms > now)
    ]
    if may_load and deferred:
        at, _, _, key = min(deferred)
        if at <= now or (len(deferred) == 1 and not (ranked or holds_work)):
            ranked.append(key)
    return ranked


class Affinity:
    """One serving's partition: the keys it holds (``held``, from its key states), those its
    other partitions hold (``follow``, after each heartbeat) and read.lua's marks of both,
    handed to ``publish`` (the assembler's ``affinity_marks``) whenever either changes; the
    lean from ``load_s`` (the mean load) and ``batch_size``; '*' at each read that
    ``may_load`` allows."""

    def __init__(
        self,
        held: Callable[[], list[str]],
        load_s: Callable[[], float],
        publish: Callable[[ReadMarks], None],
        batch_size: Callable[[], float] = lambda: 1.0,
        may_load: Callable[[], bool] = lambda: True,
    ) -> None:
        self._held = held
        self._load_s = load_s
        self._publish = publish
        self._batch_size = batch_size
        self._may_load = may_load
        self.elsewhere: frozenset[str] = frozenset()

    def held(self) -> list[str]:
        return self._held()

    def lean_ms(self) -> int:
        return int(min(self._load_s() * max(1.0, self._batch_size()), MAX_LEAN_S) * 1000)

    def follow(self, elsewhere: Collection[str]) -> None:
        """What the other partitions hold now."""
        self.elsewhere = frozenset(elsewhere)
        self.refresh()

    def refresh(self) -> None:
        """Publish read.lua's marks: '!<lean ms>', '@<key>' held here, '^<key>' held
        elsewhere (none while the lean is 0: before a load, every key is held by nobody), and
        at each read '*' while the partition may load a key."""
        lean = self.lean_ms()
        if lean <= 0:
            self._publish(ReadMarks([]))
            return
        here = self._held()
        marks = [
            f"!{lean}",
            *(f"@{key}" for key in here),
            *(f"^{key}" for key in self.elsewhere.difference(here)),
        ]
        self._publish(ReadMarks(marks, self._may_load))


class ReadMarks:
    """The marks a read sends (the assembler's ``affinity_marks``): those published, and '*'
    while ``may_load`` says so, asked at each read (under the ledger's lock)."""

    __slots__ = ("marks", "may_load")

    def __init__(self, marks: list[str], may_load: Callable[[], bool] | None = None) -> None:
        self.marks = marks
        self.may_load = may_load

    def __iter__(self) -> Iterator[str]:
        yield from self.marks
        if self.may_load is not None and self.marks and self.may_load():
            yield "*"

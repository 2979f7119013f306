"""A serving's own figures in a worker's registry record (``P:worker:W``): what the partition
ran of that serving since it started, written with each heartbeat, read by the dashboard.

One field per serving the partition serves, ``figures:<serving>``, whose value is text::

    <items> <batches> <failures>;<queue-time counts>;<end-to-end counts>

- items: items answered (results, errors or dropped), batches: batch function calls (decode
  steps of a step serving), failures: items answered with an error of a FAILURE_KINDS kind
  (the batch function raised, or the request was dead-lettered; a caller's bad input, its
  deadline or its cancel are not the serving's failures);
- each list of counts is a histogram over LATENCY_BOUNDS (the worker's Prometheus buckets of
  ``queueserve_queue_time_seconds`` and ``queueserve_end_to_end_seconds``), not cumulative:
  count i is of the values in (bound i-1, bound i], the last of those past the last bound;
  trailing zeros are left out. Numbers are decimal, space-separated.

Counters only grow while the partition lives; a new partition process is a new consumer
name, starting from 0. Anyone can write a record, so ``parse`` takes only what this format
allows (at most MAX_TEXT characters, counts of at most 18 digits) and answers None otherwise.

A serving with ``load_key`` (many models behind one serving) has a second field,
``held:<serving>``: the batch keys whose state the partition holds, one a line
(worker/pipeline/affinity.py writes it; other partitions read it to leave those keys to it, the
dashboard to show them: ``held_keys``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from queueserve.wire.kinds import ERR_DEAD_LETTER, ERR_REMOTE

HELD_FIELD: Final = "held:"  # + serving name: the record's field of the keys held
HELD_SHOWN: Final = 16  # keys of a partition the dashboard names (the rest: counted)
HELD_KEY_SHOWN: Final = 100  # characters of a key it shows

# Seconds: the worker's latency buckets (worker/metrics.py builds its histograms on them)
LATENCY_BOUNDS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)
BUCKETS: Final = len(LATENCY_BOUNDS) + 1  # the last: past the last bound
FAILURE_KINDS: Final = frozenset({ERR_REMOTE, ERR_DEAD_LETTER})
FIELD_PREFIX: Final = "figures:"
MAX_TEXT: Final = 1000
_MAX_DIGITS: Final = 18


def field_of(serving: str) -> str:
    """The record's field holding ``serving``'s figures."""
    return FIELD_PREFIX + serving


@dataclass(slots=True)
class Figures:
    items: int = 0
    batches: int = 0
    failures: int = 0
    queue_time: list[int] = field(default_factory=lambda: [0] * BUCKETS)
    end_to_end: list[int] = field(default_factory=lambda: [0] * BUCKETS)

    def encode(self) -> str:
        return (
            f"{self.items} {self.batches} {self.failures};"
            f"{_counts(self.queue_time)};{_counts(self.end_to_end)}"
        )

    def covers(self, earlier: Figures) -> bool:
        """Whether every count of ``earlier`` is at most this one's: the same partition's
        figures later on (a counter that went back is another's, or forged)."""
        return (
            self.items >= earlier.items
            and self.batches >= earlier.batches
            and self.failures >= earlier.failures
            and all(a >= b for a, b in zip(self.queue_time, earlier.queue_time, strict=True))
            and all(a >= b for a, b in zip(self.end_to_end, earlier.end_to_end, strict=True))
        )

    def minus(self, earlier: Figures) -> Figures:
        return Figures(
            self.items - earlier.items,
            self.batches - earlier.batches,
            self.failures - earlier.failures,
            [a - b for a, b in zip(self.queue_time, earlier.queue_time, strict=True)],
            [a - b for a, b in zip(self.end_to_end, earlier.end_to_end, strict=True)],
        )

    def add(self, other: Figures) -> None:
        self.items += other.items
        self.batches += other.batches
        self.failures += other.failures
        for mine, theirs in (
            (self.queue_time, other.queue_time),
            (self.end_to_end, other.end_to_end),
        ):
            for i, n in enumerate(theirs):
                mine[i] += n


def _counts(counts: list[int]) -> str:
    last = len(counts)
    while last and not counts[last - 1]:
        last -= 1
    return " ".join(str(n) for n in counts[:last])


def _numbers(text: str, most: int) -> list[int] | None:
    words = text.split(" ") if text else []
    if len(words) > most or not all(
        w.isascii() and w.isdigit() and len(w) <= _MAX_DIGITS for w in words
    ):
        return None
    return [int(w) for w in words]


def parse(text: str) -> Figures | None:
    """The figures ``text`` holds, or None when it is not in this format."""
    if len(text) > MAX_TEXT:
        return None
    parts = text.split(";")
    if len(parts) != 3:
        return None
    totals = _numbers(parts[0], 3)
    queue_time, end_to_end = (_numbers(p, BUCKETS) for p in parts[1:])
    if totals is None or len(totals) != 3 or queue_time is None or end_to_end is None:
        return None
    items, batches, failures = totals
    return Figures(items, batches, failures, _padded(queue_time), _padded(end_to_end))


def _padded(counts: list[int]) -> list[int]:
    return counts + [0] * (BUCKETS - len(counts))


def quantile(q: float, counts: list[int]) -> float | None:
    """The ``q`` quantile (0 < q < 1) of a histogram over LATENCY_BOUNDS, as Prometheus'
    ``histogram_quantile`` computes it: linear within the bucket it falls in, the last bound
    when it falls past it; None when the histogram is empty."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    below = 0
    for i, n in enumerate(counts):
        if below + n >= rank and n > 0:
            if i >= len(LATENCY_BOUNDS):
                return float(LATENCY_BOUNDS[-1])
            lower = 0.0 if i == 0 else float(LATENCY_BOUNDS[i - 1])
            upper = float(LATENCY_BOUNDS[i])
            return lower + (upper - lower) * (rank - below) / n
        below += n
    return float(LATENCY_BOUNDS[-1])


def held_keys(text: str) -> tuple[list[str], int]:
    """The first HELD_SHOWN keys a ``held:<serving>`` field names (each cut to
    HELD_KEY_SHOWN characters), and how many lines it has: what a look costs does not grow
    with what a stranger wrote there."""
    shown = [line[:HELD_KEY_SHOWN] for line in text.split("\n", HELD_SHOWN)[:HELD_SHOWN] if line]
    lines = text.count("\n") + (not text.endswith("\n")) if text else 0
    return shown, max(lines, len(shown))

"""Batch assembly: which items run together, and when (docs/design.md §3). Pure logic, no I/O.

A worker holds, per batch key, a queue of *slices*: runs of one request's items. A batch is taken
from the front of one key's queue:

- it is *full* when the queue holds ``capacity`` items (or cost units) — it runs at once;
- otherwise it is *due* once ``batch_timeout`` has passed since its first item arrived (or since
  the previous batch left items behind) — it runs when an executor is free, and keeps growing
  until then;
- a slice larger than the room left is split, and the rest starts the next batch — except a
  request that must run whole (streamed, or for a serving with hooks): it starts the next batch;
- a request redelivered a second time runs in a batch of its own (it may be what crashed);
- within a key, slices wait in priority order (higher first, then arrival), so a batch may mix
  priorities of one key but takes the most urgent first;
- between keys with a batch ready to run, the one waiting longest goes first, each priority
  level counting as ``age_per_priority`` seconds of waiting: keys take turns by batch, so a
  quiet key waits for about one batch per busy key, never for a backlog to drain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Pack:
    """A stream entry holding several requests (enqueue.lua): acked when the last is done."""

    left: int  # its requests not finished yet
    admitted: int  # items its admission counted, released by its ack


@dataclass(eq=False, slots=True)
class Request:
    """One stream entry a worker is serving."""

    entry_id: bytes
    stream: str
    rid: int
    reply_to: str
    deadline: float  # unix seconds, 0 = none
    n: int
    events: str = ""  # pub/sub channel for streamed events, "" = none
    no_split: bool = False  # streamed and hook-serving requests run whole, in one batch
    admitted: int = 0  # items its admission counted (the 'a' field); released by its ack
    redelivered: bool = False  # reclaimed from a dead consumer: its run counts a delivery
    alone: bool = False  # redelivered more than once: runs in a batch of its own
    counted: bool = False  # this run's delivery is counted (once, however many batches)
    priority: int = 0  # 0..9, larger first
    pack: Pack | None = None  # set when the entry holds other requests too
    remaining: int = field(init=False)  # items not answered yet; the entry is acked at 0
    events_sent: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.remaining = self.n

    @property
    def ref(self) -> tuple[str, bytes]:
        """(stream, entry id): entry ids are unique only within one stream."""
        return self.stream, self.entry_id


@dataclass(eq=False, slots=True)
class Slice:
    """Items ``offset:offset+len(items)`` of one request, waiting together."""

    request: Request
    offset: int
    items: list[Any]
    costs: list[float] | None = None  # per item, when the serving has a cost function

    @property
    def weight(self) -> float:
        return len(self.items) if self.costs is None else sum(self.costs)

    def split(self, room: float) -> tuple[Slice, Slice]:
        """The longest head that fits ``room``, and the tail."""
        if self.costs is None:
            cut = int(room)
        else:
            cut, used = 0, 0.0
            for c in self.costs:
                if used + c > room:
                    break
                used += c
                cut += 1
        head_costs = None if self.costs is None else self.costs[:cut]
        tail_costs = None if self.costs is None else self.costs[cut:]
        return (
            Slice(self.request, self.offset, self.items[:cut], head_costs),
            Slice(self.request, self.offset + cut, self.items[cut:], tail_costs),
        )


class KeyQueue:
    """Waiting slices of one batch key."""

    __slots__ = ("key", "slices", "started", "weight")

    def __init__(self, key: str) -> None:
        self.key = key
        self.slices: deque[Slice] = deque()
        self.weight = 0.0
        self.started = 0.0  # when the batch clock started; meaningful while non-empty


@dataclass(slots=True)
class TakenBatch:
    key: str
    slices: list[Slice]
    opened: float = 0.0  # when its batch clock started (monotonic)

    def items(self) -> list[Any]:
        if len(self.slices) == 1:
            return self.slices[0].items
        out: list[Any] = []
        for s in self.slices:
            out.extend(s.items)
        return out

    def __len__(self) -> int:
        return sum(len(s.items) for s in self.slices)


class Assembler:
    """Per-key queues of waiting slices and the rules that turn them into batches."""

    def __init__(self, capacity: float, timeout: float, age_per_priority: float = 1.0) -> None:
        self.capacity = capacity
        self.timeout = timeout
        self.age_per_priority = age_per_priority
        # Only keys with something waiting: an idle key costs nothing here.
        self.queues: dict[str, KeyQueue] = {}
        self.buffered = 0  # items waiting, all keys
        self.weight = 0.0  # items (or cost) waiting, all keys

    def full_keys(self) -> list[str]:
        """Keys holding a whole batch waiting: reading more of them would only buffer."""
        return [k for k, q in self.queues.items() if q.weight >= self.capacity]

    def room(self, key: str) -> float:
        """Capacity left before ``key`` holds one full batch waiting."""
        queue = self.queues.get(key)
        return self.capacity if queue is None else self.capacity - queue.weight

    def add(self, key: str, piece: Slice, now: float) -> None:
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = KeyQueue(key)
        slices = queue.slices
        if not slices:
            queue.started = now
        priority = piece.request.priority
        if not slices or slices[-1].request.priority >= priority:
            slices.append(piece)
        else:  # before the first less urgent slice, after those as urgent (arrival order)
            at = len(slices)
            while at > 0 and slices[at - 1].request.priority < priority:
                at -= 1
            slices.insert(at, piece)
        queue.weight += piece.weight
        self.weight += piece.weight
        self.buffered += len(piece.items)

    def pick(self, now: float, flush: bool = False) -> tuple[KeyQueue | None, float | None]:
        """The queue to run now, else seconds to wait.

        Runnable are full and due batches; of those, the one whose clock started first runs,
        each priority level of its most urgent item counting as ``age_per_priority`` seconds
        earlier. A busy key's clock restarts with each batch it gives, so keys take turns.
        ``flush`` treats every waiting batch as due (a stopping worker runs what it holds).
        """
        chosen: KeyQueue | None = None
        best = 0.0
        next_due: float | None = None
        for queue in self.queues.values():
            if flush or queue.weight >= self.capacity or queue.started + self.timeout <= now:
                rank = queue.started - queue.slices[0].request.priority * self.age_per_priority
                if chosen is None or rank < best:
                    chosen, best = queue, rank
            else:
                at = queue.started + self.timeout
                next_due = at if next_due is None else min(next_due, at)
        if chosen is not None:
            return chosen, None
        return None, None if next_due is None else max(0.0, next_due - now)

    def take(self, queue: KeyQueue, now: float) -> TakenBatch:
        """Remove one batch from the front of ``queue``, splitting a slice that does not fit."""
        room = self.capacity
        taken: list[Slice] = []
        slices = queue.slices
        while slices and room > 0:
            head = slices[0]
            if head.request.alone and taken:
                break  # it runs in the next batch, by itself
            weight = head.weight
            if weight <= room:
                slices.popleft()
                taken.append(head)
                room -= weight
                if head.request.alone:
                    break
                continue
            if head.request.no_split:
                break
            first, rest = head.split(room)
            if not first.items:
                break
            slices[0] = rest
            taken.append(first)
            room -= first.weight
            break
        opened = queue.started
        taken_weight = self.capacity - room
        queue.weight = max(0.0, queue.weight - taken_weight)
        self.weight = max(0.0, self.weight - taken_weight)
        if slices:
            queue.started = now
        else:
            self.weight = max(0.0, self.weight - queue.weight)
            del self.queues[queue.key]
        self.buffered -= sum(len(s.items) for s in taken)
        return TakenBatch(queue.key, taken, opened)

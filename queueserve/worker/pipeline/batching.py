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
- within a key, slices wait in one run per priority (arrival order within each), and a batch
  takes from the run ranked first, as read.lua ranks streams: when its head was enqueued
  (but no earlier than the run's last batch less the levels between it and the most urgent
  run), minus ``age_per_priority`` seconds per level. So a batch may mix priorities of one
  key, most urgent first, and work that waited its levels' worth goes before a higher
  priority served all along (never starved by it);
- between keys with a batch ready to run, the one waiting longest goes first, each priority
  level counting as ``age_per_priority`` seconds of waiting: keys take turns by batch, so a
  quiet key waits for about one batch per busy key, never for a backlog to drain;
- a key of weight w (``batch_key_weights``) comes round w times as often: after each batch its
  turn moves only 1/w of the way from where it was to that batch's end (stride scheduling, as
  read.lua ranks keys in Redis).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from queueserve.wire.tenants import LANE, split_lane
from queueserve.worker.pipeline.latency import BatchTimes, LatencyPlan
from queueserve.worker.pipeline.shares import Shares
from queueserve.worker.pipeline.taking import take_run

# A quiet key's lead (enqueue.lua's LEAD_MS): its batch ranks as if it had waited this longer
LEAD_S = 60.0
ENDS_KEPT = 1000  # expected batch ends of emptied keys kept before the ended ones are dropped


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
    # split from a reclaimed pack (split.lua): it ran before, so it streams as a replay, but
    # its pack's run is not counted against it (its batch-mates did not die of it)
    replay: bool = False
    alone: bool = False  # redelivered more than once: runs in a batch of its own
    counted: bool = False  # this run's delivery is counted (once, however many batches)
    priority: int = 0  # 0..9, larger first
    pack: Pack | None = None  # set when the entry holds other requests too
    # A streamed replay's token, sent with its events and its answer (client/events.py); 0 in
    # a first run, whose events and answer carry none
    run: int = 0
    fields: dict[str, Any] | None = None  # the header's optional fields (trace context), if any
    cache: bytes | None = None  # its item's digest, when its result is to be cached (intake.py)
    remaining: int = field(init=False)  # items not answered yet; the entry is acked at 0
    events_sent: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.remaining = self.n

    @property
    def ref(self) -> tuple[str, bytes]:
        """(stream, entry id): entry ids are unique only within one stream."""
        return self.stream, self.entry_id

    def stream_tail(self) -> list[int]:
        """What a streamed request's answer carries after its body: how many events preceded
        it, and a replay's run (the caller's stream follows the run that answered)."""
        return [self.events_sent, self.run] if self.run else [self.events_sent]


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
    """Waiting slices of one batch key: one run per priority level, in arrival order."""

    __slots__ = ("key", "levels", "served", "started", "tenant", "turn", "weight")

    def __init__(self, key: str) -> None:
        self.key = key
        self.tenant = split_lane(key)[1] if LANE in key else None  # whose lane it is
        self.levels: dict[int, deque[Slice]] = {}  # priority -> its slices; none empty
        self.served: dict[int, float] = {}  # priority -> when it last gave a batch items (unix)
        self.weight = 0.0
        self.started = 0.0  # when the batch clock started; meaningful while non-empty
        # When its turn started: as ``started``, but after a batch it gave, from when that
        # batch is expected to end (it runs meanwhile): what came during it goes first.
        self.turn = 0.0

    def urgent(self) -> int:
        """The most urgent priority waiting."""
        return max(self.levels) if len(self.levels) > 1 else next(iter(self.levels))


@dataclass(slots=True)
class TakenBatch:
    key: str
    slices: list[Slice]
    opened: float = 0.0  # when its batch clock started (monotonic)
    since: float = 0.0  # with max_latency: when its oldest item was enqueued (monotonic)

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

    def __init__(
        self,
        capacity: float,
        timeout: float,
        age_per_priority: float = 1.0,
        unix_offset: float | None = None,
    ) -> None:
        self.capacity = capacity
        self.timeout = timeout
        self.age_per_priority = age_per_priority
        self.shares = Shares()  # batch keys' and tenants' weights
        self.affinity_marks: Iterable[str] = ()  # what keys' states are held where (affinity.py)
        self.batch_times = BatchTimes()  # what batches take here (the executors measure)
        self.latency: LatencyPlan | None = None  # when max_latency is set
        # The clock passed in is monotonic; entry ids (when a request was enqueued) are unix
        # ms of the Redis server: unix time = now + unix_offset.
        self.unix_offset = time.time() - time.monotonic() if unix_offset is None else unix_offset
        # Only keys with something waiting: an idle key costs nothing here.
        self.queues: dict[str, KeyQueue] = {}
        self.buffered = 0  # items waiting, all keys
        # Keys whose queue emptied with a batch still expected to run: when it should end (a
        # key's requests of one batch each restart its turn as its longer ones do)
        self._ends: dict[str, float] = {}
        self.weight = 0.0  # items (or cost) waiting, all keys

    @property
    def weights(self) -> Mapping[str, float]:
        return self.shares.keys

    @weights.setter
    def weights(self, weights: Mapping[str, float]) -> None:
        self.shares.keys = weights

    def full_keys(self) -> list[str]:
        """Keys holding a whole batch waiting: reading more of them would only buffer."""
        return [k for k, q in self.queues.items() if q.weight >= self.capacity]

    def read_marks(self) -> list[str]:
        """``<priority><key>`` for each key holding a whole batch at that priority and above
        (read.lua reads none of the key's streams at or below it: they would only buffer; a
        more urgent stream is read, its request goes in the key's next batch), and ``-<key>``
        for each key holding less (read.lua reads those after every other ready key), and
        ``=<key>=<weight>`` for each weighted key and ``~<tenant>=<weight>`` for each weighted
        tenant (read.lua ranks their streams again so); then affinity.py's, of keys held."""
        marks = [*self.shares.marks, *self.affinity_marks]
        for key, queue in self.queues.items():
            if queue.weight < self.capacity:
                if queue.weight > 0:
                    marks.append(f"-{key}")
                continue
            levels = queue.levels
            if len(levels) == 1:
                marks.append(f"{next(iter(levels))}{key}")
                continue
            held = 0.0
            for priority in sorted(levels, reverse=True):
                held += sum(piece.weight for piece in levels[priority])
                if held >= self.capacity:
                    marks.append(f"{priority}{key}")
                    break
        return marks

    def plan_latency(self, target: float) -> None:
        """Close batches to answer within ``target`` seconds (max_latency; 0: off)."""
        if target <= 0:
            self.latency = None
        elif self.latency is None:
            self.latency = LatencyPlan(target, self.batch_times)
        else:
            self.latency.target = target

    def look_ahead(self) -> float:
        """What the reader's budget counts as held: at most one batch per key. A key holding
        more (one big request, or chunks of one) is not read again until a batch leaves it,
        and the rest of the look-ahead stays for other keys and priorities. With weights, a
        batch less: a weighted key's next one is read while the others run, held for its turn."""
        held = self.weight
        if held > self.capacity:
            held = sum(min(q.weight, self.capacity) for q in self.queues.values())
        return max(0.0, held - self.capacity) if self.shares.marks else held

    def add(self, key: str, piece: Slice, now: float, lead: bool = False) -> None:
        """``lead``: read.lua read the key with a lead (a quiet key's): unless a batch of it
        still runs, its turn ranks LEAD_S earlier, as in Redis."""
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = KeyQueue(key)
        levels = queue.levels
        if not levels:
            queue.started = queue.turn = now
            ends = self._ends.pop(key, None) if self._ends else None
            if ends is not None and ends > now:  # a batch of it still runs
                queue.turn = ends
            elif lead:
                queue.turn = now - LEAD_S
            elif ends is not None:  # a weighted key's turn, saved from its last batch
                queue.turn = ends
        if self.latency is not None:
            self.latency.arrived(len(piece.items), now)
        priority = piece.request.priority
        slices = levels.get(priority)
        if slices is None:
            slices = levels[priority] = deque()
        slices.append(piece)
        queue.weight += piece.weight
        self.weight += piece.weight
        self.buffered += len(piece.items)

    def pick(self, now: float, flush: bool = False) -> tuple[KeyQueue | None, float | None]:
        """The queue to run now, else seconds to wait.

        Runnable are full and due batches; of those, the one whose turn started first runs,
        each priority level of its most urgent item counting as ``age_per_priority`` seconds
        earlier. A busy key's turn restarts with each batch it gives, from when that batch is
        expected to end (``_next_turn``: a weighted key's, nearer), so keys take turns, and a
        request that came during a batch goes in the next one: a batch still filling runs
        early rather than wait behind a key ranked after it.
        ``flush`` treats every waiting batch as due (a stopping worker runs what it holds).
        """
        chosen: KeyQueue | None = None
        early: KeyQueue | None = None  # the first ranked of the batches not due yet
        best = early_rank = 0.0
        next_due: float | None = None
        latency, capacity, lane_turn = self.latency, self.capacity, self.shares.lane_turn
        for queue in self.queues.values():
            turn = queue.turn if queue.tenant is None else lane_turn(queue.tenant, queue.turn)
            rank = turn - queue.urgent() * self.age_per_priority
            at = queue.started + self.timeout
            if latency is not None and at > now and queue.weight < capacity:
                at = min(
                    at, latency.due(queue.started, queue.weight, now, self.waiting_since(queue))
                )
            if flush or queue.weight >= capacity or at <= now:
                if chosen is None or rank < best:
                    chosen, best = queue, rank
            else:
                next_due = at if next_due is None else min(next_due, at)
                if early is None or rank < early_rank:
                    early, early_rank = queue, rank
        if chosen is not None:
            return (early, None) if early is not None and early_rank < best else (chosen, None)
        return None, None if next_due is None else max(0.0, next_due - now)

    def waiting_since(self, queue: KeyQueue) -> float:
        """When the oldest item of ``queue`` was enqueued (monotonic): max_latency counts the
        time it waited in Redis, and for what a previous batch left behind, since it came,
        not since the batch clock restarted. From its entry id, which the Redis server's clock
        wrote: at most the target before the batch clock started, never after it."""
        started, unix_started = queue.started, queue.started + self.unix_offset
        oldest = min(_enqueued(run[0].request, unix_started) for run in queue.levels.values())
        target = self.latency.target if self.latency is not None else 0.0
        return max(started - target, min(started, oldest - self.unix_offset))

    def take(self, queue: KeyQueue, now: float) -> TakenBatch:
        """Remove one batch from the front of ``queue``, splitting a slice that does not fit."""
        room = self.capacity
        taken: list[Slice] = []
        levels = queue.levels
        since = queue.started if self.latency is None else self.waiting_since(queue)
        unix_now = now + self.unix_offset
        more = True
        while more and levels and room > 0:
            # One level (the common case): take what fits. Several: one slice at a time, the
            # levels ranked again after each.
            several = len(levels) > 1
            priority = self._next_level(queue, unix_now) if several else next(iter(levels))
            slices = levels[priority]
            count = len(taken)
            room, more = take_run(slices, room, taken, several)
            if len(taken) > count:
                queue.served[priority] = unix_now
            if not slices:
                del levels[priority]
        own = self.capacity - room  # the queue's own share (other lanes' is theirs)
        if more and room > 0 and LANE in queue.key:
            room = self._fill_from_lanes(queue, room, taken, now)
        opened = queue.started
        queue.weight = max(0.0, queue.weight - own)
        self.weight = max(0.0, self.weight - own)
        turn = self._next_turn(queue, now + self.batch_times.predict(self.capacity - room), now)
        if levels:
            queue.started = now
            queue.turn = turn
        else:
            self.weight = max(0.0, self.weight - queue.weight)
            del self.queues[queue.key]
            self._ended(queue.key, turn, now)
        self.buffered -= sum(len(s.items) for s in taken)
        return TakenBatch(queue.key, taken, opened, since)

    def _fill_from_lanes(
        self, queue: KeyQueue, room: float, taken: list[Slice], now: float
    ) -> float:
        """Fill what a tenant's lane leaves of a batch with other tenants' lanes of its batch
        key, the one whose turn started first first (wire/tenants.py): a quiet tenant's batch
        costs the busy ones no capacity. Their turns do not move: the lane whose turn it is
        took its batch. The room left."""
        batch_key = split_lane(queue.key)[0]
        others = [
            q
            for q in self.queues.values()
            if q is not queue and LANE in q.key and split_lane(q.key)[0] == batch_key
        ]
        unix_now = now + self.unix_offset
        for other in sorted(others, key=lambda q: q.turn):
            levels, before = other.levels, room
            more = True
            while more and levels and room > 0:
                priority = (
                    self._next_level(other, unix_now) if len(levels) > 1 else next(iter(levels))
                )
                room, more = take_run(levels[priority], room, taken, len(levels) > 1)
                other.served[priority] = unix_now
                if not levels[priority]:
                    del levels[priority]
            # an emptied lane gives all it held (a sum of costs may drift from what was taken)
            given = other.weight if not levels else before - room
            other.weight = max(0.0, other.weight - given)
            self.weight = max(0.0, self.weight - given)
            if not levels:
                del self.queues[other.key]
                self._ended(other.key, other.turn, now)
            if not more or room <= 0:
                break
        return room

    def _next_turn(self, queue: KeyQueue, end: float, now: float) -> float:
        """When ``queue``'s key's next turn starts, after a batch expected to end at ``end``:
        then, for a key of weight 1. A key of weight w moves 1/w of the way there from its
        last turn, so it comes round w times as often as a key of weight 1 while both have
        work (stride scheduling). A quiet key's lead is for one batch: it is not saved up.
        (A key that pauses for a second or more comes back quiet, so what it saves up is what
        it may take of under a second.)"""
        if queue.tenant is not None:
            self.shares.served(queue.tenant, end, now, now - LEAD_S)
        weight = self.shares.weight_of(queue.key)
        if weight == 1.0:
            return end
        turn = queue.turn if queue.turn > now - LEAD_S else now
        return turn + (end - turn) / weight

    def _ended(self, key: str, turn: float, now: float) -> None:
        """Remember when the next turn of ``key``, whose queue emptied, starts: when the batch
        just taken should end, or a weighted key's saved turn. What is past and unweighted
        needs no record (the key starts anew); the rest goes a thousand keys at a time."""
        weight_of = self.shares.weight_of
        if turn <= now and weight_of(key) == 1.0:
            return
        ends = self._ends
        if len(ends) >= ENDS_KEPT:
            self._ends = ends = {k: t for k, t in ends.items() if t > now or weight_of(k) != 1.0}
        ends[key] = turn

    def _next_level(self, queue: KeyQueue, unix_now: float) -> int:
        """The priority whose head a batch takes next: the lowest ``since - priority * age``
        (read.lua ranks a key's streams so in Redis). ``since`` is when the head was enqueued:
        each request of a level that wins only by ageing runs within that bound, not one per
        bound; but never before the level's last batch less the levels between it and the
        most urgent level held. So a level served all along ranks as if it waited from now,
        and one that fell behind (a slow batch, a burst) takes turns with the most urgent
        level until it catches up, rather than wait a whole bound per batch, which would
        leave it further behind with every batch."""
        best, best_rank = 0, math.inf
        age, top = self.age_per_priority, max(queue.levels)
        for priority, slices in queue.levels.items():
            head = _enqueued(slices[0].request, unix_now)
            served = queue.served.get(priority, -math.inf)
            since = max(head, served - (top - priority) * age)
            rank = since - priority * age
            if rank < best_rank or (rank == best_rank and priority > best):
                best, best_rank = priority, rank
        return best


def _enqueued(request: Request, default: float) -> float:
    """When the request's entry was written (its id is the Redis server's unix ms), in unix
    seconds; ``default`` for an id that is not one (entries are written by strangers)."""
    ms, _, _ = request.entry_id.partition(b"-")
    return int(ms) / 1000 if ms.isdigit() and len(ms) <= 15 else default

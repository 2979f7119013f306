"""Continuous batching for step servings: who waits, who joins the running set, and when.

Pure logic, no I/O, no model calls (``step_executor`` runs the steps):

- ``StepQueue`` holds the requests a partition read and has not started, in arrival order. The
  runner's reader fills it as it fills an ``Assembler`` (``add``), so a partition reads
  at most ``max_slots`` items ahead of what runs.
- ``Scheduler`` keeps the running set's accounts (slots, reserved tokens, steps since the last
  join) and decides, between two decode steps, which waiting requests join:

  1. in arrival order within a tenant (a gateway tenant's lane, wire/tenants.py), the tenant
     with the fewest sequences running for its weight first, and whole (each item takes a
     slot); the first that does not fit stops the join, so a large request is never overtaken
     for ever by small ones, and a tenant's requests never wait behind another's backlog.
     While other tenants sent work in the last RESERVE_FOR_S, a tenant leaves one slot free
     for each of them that has nothing running (a quarter of the slots at most), and such a
     tenant's request joins at the next boundary: so it waits no generation of another's for
     a slot (sequences joined together end together);
  2. while ``max_slots``, ``max_batch_tokens`` (prompt + most generated, reserved for the whole
     run: the running set can never outgrow it) and ``max_prefill_tokens`` (prompt tokens
     computed by this join, after the prefix cache) allow;
  3. joining pauses the running sequences for a prefill, so while some run, a join happens only
     when at least ``waiting_served_ratio`` x running sequences can join at once, or after
     ``max_waiting_steps`` steps without a join (TGI's waiting_served_ratio and
     max_waiting_tokens). An empty running set takes whatever fits;
  4. a request redelivered a second time (``alone``: its first redelivery died too) may be what
     killed the workers: it joins only an empty running set, and nothing joins while it runs,
     so a crash counts against it alone.

- ``CallerWatch`` tells, from the subscriber counts of their event channels, which streaming
  callers went away (their requests leave like cancelled ones).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from queueserve.steps import StepServing
from queueserve.wire.tenants import split_lane
from queueserve.worker.pipeline.batching import Slice
from queueserve.worker.pipeline.shares import Shares

RESERVE_FOR_S = 1.0  # a tenant that sent work this recently keeps a slot free while it waits


@dataclass(frozen=True, slots=True)
class Limits:
    max_slots: int
    max_batch_tokens: int
    max_prefill_tokens: int
    waiting_served_ratio: float
    max_waiting_steps: int

    @classmethod
    def of(cls, serving: StepServing) -> Limits:
        # batch_size, not max_slots: `queueserve config set NAME batch_size=N` resizes slots.
        return cls(
            serving.batch_size,
            serving.max_batch_tokens,
            serving.max_prefill_tokens,
            serving.waiting_served_ratio,
            serving.max_waiting_steps,
        )

    def hold_for(self, serving: StepServing) -> bool:
        """Whether ``of(serving)`` would equal these (the executor asks every step: no
        object made for it)."""
        return (
            serving.batch_size == self.max_slots
            and serving.max_batch_tokens == self.max_batch_tokens
            and serving.max_prefill_tokens == self.max_prefill_tokens
            and serving.waiting_served_ratio == self.waiting_served_ratio
            and serving.max_waiting_steps == self.max_waiting_steps
        )


@dataclass(eq=False, slots=True)
class Waiting:
    """A request's slice waiting to join; ``budget``/``prompt`` are set once measured."""

    key: str
    piece: Slice
    arrived: float
    tenant: str | None = None  # whose lane ``key`` is (None: no tenant's)
    budget: int = -1  # tokens reserved while it runs: prompt + most generated, all items
    prompt: int = 0  # prompt tokens of all items, before the prefix cache
    cached: int = 0  # prompt tokens the prefix cache covers (as of the last look)
    looked: int = -1  # the cache's version at that look
    prompts: list[tuple[Any, ...]] | None = None  # per item: its prompt_tokens, () for none
    ready: bool = True  # with load_key: its key's state is held (stepping/key_loads.py)

    @property
    def measured(self) -> bool:
        return self.budget >= 0

    @property
    def slots(self) -> int:
        return len(self.piece.items)

    @property
    def prefill(self) -> int:
        return self.prompt - self.cached


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of a step serving, as metrics and tests see it."""

    slots: int  # sequences decoded in this step
    batch_tokens: int  # tokens reserved by the running set during this step
    joined: int  # sequences prefilled just before this step
    prefill_tokens: int  # prompt tokens that prefill computed (the cache's share excluded)
    left: int  # sequences that left at the boundary before this step (ended, cancelled...)
    generated: int  # outputs produced by this step
    prefill_seconds: float  # prefill calls, plus the decode calls' share of `reading`
    decode_seconds: float
    cache_hits: int = 0
    cache_misses: int = 0
    cache_saved_tokens: int = 0  # prompt tokens not computed thanks to the cache
    # sequences reading their prompts in the step: qs.NO_OUTPUT, or their first output
    reading: int = 0
    first_outputs: tuple[bytes, ...] = ()  # stream entry ids of sequences with a first output


class StepQueue:
    """Slices read and not yet running, in arrival order (the reader's side of the executor).

    Has the ``Assembler`` interface the runner's reader uses (``add``, ``buffered``,
    ``capacity``, ``timeout``), so the reader needs no step-specific code.
    """

    def __init__(self, capacity: int, timeout: float = 0.0) -> None:
        self.capacity = capacity
        self.timeout = timeout  # kept for the reader's config updates; joins wait for no clock
        self.waiting: deque[Waiting] = deque()
        self.buffered = 0
        self.arrived = 0  # slices ever added, and ever taken or removed: what changed since
        self.departed = 0  # a look (the executor skips looks that would find nothing new)
        self.shares = Shares()  # the tenants' weights (P:tenants), which joins follow
        self.sent: dict[str | None, float] = {}  # tenant -> when it was last read (monotonic)
        # with load_key: what keys' states are held where (pipeline/affinity.py)
        self.affinity_marks: Iterable[str] = ()

    @property
    def weight(self) -> float:
        """Items waiting (the reader's measure of what it holds)."""
        return float(self.buffered)

    def full_keys(self) -> list[str]:
        """Keys the reader should not read: all of them once a running set's worth waits."""
        return list({w.key for w in self.waiting}) if self.buffered >= self.capacity else []

    def read_marks(self) -> list[str]:
        """read.lua's form of ``full_keys`` (every priority of each key), the weights, and
        with load_key the keys' states held here and elsewhere."""
        return [f"9{key}" for key in self.full_keys()] + self.shares.marks + [*self.affinity_marks]

    def look_ahead(self) -> float:
        return float(self.buffered)

    def add(self, key: str, piece: Slice, now: float, lead: bool = False) -> None:
        """Requests join in arrival order: read.lua read a leading key (``lead``) first already."""
        tenant = split_lane(key)[1]
        self.sent[tenant] = now
        # A raw request larger than the slots (not streamed, so splittable) runs in parts.
        while len(piece.items) > self.capacity and not piece.request.no_split:
            head, piece = piece.split(self.capacity)
            self._append(Waiting(key, head, now, tenant))
        self._append(Waiting(key, piece, now, tenant))

    def refit(self) -> None:
        """Split what ``add`` would split at the current capacity (it shrank at run time):
        waiting raw requests larger than the slots run in parts, in their place in line."""
        if not any(w.slots > self.capacity and not w.piece.request.no_split for w in self.waiting):
            return
        old, self.waiting, self.buffered = self.waiting, deque(), 0
        for w in old:
            if w.slots > self.capacity and not w.piece.request.no_split:
                self.add(w.key, w.piece, w.arrived)
            else:
                self._append(w)

    def _append(self, waiting: Waiting) -> None:
        self.waiting.append(waiting)
        self.buffered += waiting.slots
        self.arrived += 1

    def take(self, scheduler: Scheduler, now: float) -> list[Waiting]:
        """The waiting slices that join the running set now (``Scheduler.admit``)."""
        sent = self.sent
        if len(sent) > 1:
            for tenant in [t for t, at in sent.items() if now - at > RESERVE_FOR_S]:
                del sent[tenant]
        taken = scheduler.admit(self.waiting, self.shares.tenants, sent)
        self.buffered -= sum(w.slots for w in taken)
        self.departed += len(taken)
        return taken

    def remove(self, gone: list[Waiting]) -> None:
        if not gone:
            return
        ids = {id(w) for w in gone}
        self.waiting = deque(w for w in self.waiting if id(w) not in ids)
        self.buffered -= sum(w.slots for w in gone)
        self.departed += len(gone)


def _remove(waiting: deque[Waiting], taken: list[Waiting]) -> None:
    """Take ``taken`` out of ``waiting`` (most joins take its front)."""
    if all(a is b for a, b in zip(taken, waiting, strict=False)):
        for _ in taken:
            waiting.popleft()
        return
    joining = {id(w) for w in taken}
    staying = [w for w in waiting if id(w) not in joining]
    waiting.clear()
    waiting.extend(staying)


def _ready(waiting: Iterable[Waiting]) -> Iterable[Waiting]:
    """``waiting`` but the requests whose key's state is being loaded: the others need not wait
    for it (stepping/key_loads.py)."""
    return (w for w in waiting if w.ready)


def too_large(w: Waiting, limits: Limits) -> str | None:
    """Why ``w`` can never join (even an empty running set), or None."""
    if w.slots > limits.max_slots:
        return (
            f"the request has {w.slots} items, more than max_slots={limits.max_slots} of "
            "this step serving (its batch_size, which `queueserve config set` changes at "
            "run time); send at most max_slots items per request"
        )
    if w.budget > limits.max_batch_tokens:
        return (
            f"the request needs {w.budget} tokens (prompt + most generated), more than "
            f"max_batch_tokens={limits.max_batch_tokens}; shorten it or raise "
            "max_batch_tokens"
        )
    if w.prompt > limits.max_prefill_tokens:
        return (
            f"the request's prompt has {w.prompt} tokens, more than max_prefill_tokens="
            f"{limits.max_prefill_tokens}; shorten it or raise max_prefill_tokens"
        )
    return None


class Scheduler:
    """The running set's accounts and the join decision."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.slots = 0  # sequences running
        self.tokens = 0  # tokens reserved by them
        self.steps_since_join = 0
        self.alone = 0  # sequences of a redelivered request running (nothing else joins)
        self.tenants: dict[str | None, int] = {}  # sequences running per tenant (None: none's)

    def admit(
        self,
        waiting: deque[Waiting],
        weights: Mapping[str, float] | None = None,
        active: Iterable[str | None] = (),
    ) -> list[Waiting]:
        """Remove and return the waiting slices that join now (all measured, first in turn;
        ``weights``: the tenants' other than 1; ``active``: the tenants that sent work lately,
        for whom a slot is kept free while they have nothing running)."""
        if not waiting or self.alone:
            return []
        lim = self.limits
        taken: list[Waiting] = []
        slots, tokens, prefill = self.slots, self.tokens, 0
        idle = {t for t in active if t not in self.tenants}  # (one tenant: none or itself)
        newcomer = False  # a tenant with nothing running joins: no waiting for a wave
        for w in _ready(self.in_turn(waiting, weights or {})):
            if not w.measured:
                break
            if w.piece.request.alone:
                if not taken and self.slots == 0:
                    taken.append(w)
                break
            if (
                slots + w.slots > lim.max_slots - self._kept_free(w.tenant, idle)
                or tokens + w.budget > lim.max_batch_tokens
                or prefill + w.prefill > lim.max_prefill_tokens
            ):
                break
            taken.append(w)
            slots, tokens, prefill = slots + w.slots, tokens + w.budget, prefill + w.prefill
            if w.tenant in idle:
                idle.remove(w.tenant)
                newcomer = True
        if not newcomer and sum(w.slots for w in taken) < self.least_join():
            return []
        _remove(waiting, taken)
        for w in taken:
            self.joined(w)
        self.steps_since_join = 0
        return taken

    def _kept_free(self, tenant: str | None, idle: set[str | None]) -> int:
        """Slots ``tenant`` leaves free: one per other active tenant running nothing."""
        if not idle:
            return 0
        return min(len(idle) - (tenant in idle), self.limits.max_slots // 4)

    def in_turn(self, waiting: deque[Waiting], weights: Mapping[str, float]) -> Iterable[Waiting]:
        """``waiting`` in the order it may join: arrival order within a tenant; the next is
        always the head of the tenant with the fewest sequences running (and before it in
        this order) for its weight, the earlier head on a tie. So a tenant's request joins
        at the next boundary with room however long another tenant's backlog is."""
        first = waiting[0].tenant
        if all(w.tenant == first for w in waiting):  # one tenant (or none): arrival order
            return waiting
        lines: dict[str | None, deque[tuple[int, Waiting]]] = {}
        for position, w in enumerate(waiting):
            lines.setdefault(w.tenant, deque()).append((position, w))
        load = {t: self.tenants.get(t, 0) for t in lines}
        order: list[Waiting] = []
        while lines:
            tenant = min(
                lines,
                key=lambda t: (load[t] / (weights.get(t, 1.0) if t else 1.0), lines[t][0][0]),
            )
            line = lines[tenant]
            w = line.popleft()[1]
            order.append(w)
            load[tenant] += w.slots
            if not line:
                del lines[tenant]
        return order

    def least_join(self) -> int:
        """Sequences worth pausing the running set for a prefill (the join policy)."""
        lim = self.limits
        if self.slots == 0 or self.steps_since_join >= lim.max_waiting_steps:
            return 1
        return max(1, math.floor(self.slots * lim.waiting_served_ratio))

    def joined(self, w: Waiting) -> None:
        self.slots += w.slots
        self.tokens += w.budget
        self.tenants[w.tenant] = self.tenants.get(w.tenant, 0) + w.slots
        if w.piece.request.alone:
            self.alone += w.slots

    def left(self, w: Waiting) -> None:
        """``w``'s sequences left the running set (its request ended, failed or was withdrawn)."""
        self.slots -= w.slots
        self.tokens -= w.budget
        running = self.tenants[w.tenant] - w.slots
        if running:
            self.tenants[w.tenant] = running
        else:
            del self.tenants[w.tenant]
        if w.piece.request.alone:
            self.alone -= w.slots

    def stepped(self) -> None:
        self.steps_since_join += 1


class CallerWatch:
    """Which streaming callers went away, from the subscriber counts of their event channels.

    A ``client.stream`` caller's client subscribes to its event channel before it sends and
    stays subscribed until it is closed; Redis drops the subscription when the client closes or
    its process dies. A channel seen without a subscriber on every look for ``gone_after``
    seconds is gone. A look that failed (Redis unreachable) proves nothing and restarts every
    clock, so an outage never makes a live caller look gone.
    """

    def __init__(self, gone_after: float, every: float) -> None:
        self.gone_after = gone_after
        self.every = every
        self._next = 0.0
        self._silent: dict[str, float] = {}  # channel -> first look that found no subscriber

    def due(self, now: float) -> bool:
        return now >= self._next

    def looked(self, now: float, counts: Mapping[str, int] | None) -> set[str]:
        """Record a look (``None``: it failed); the channels whose callers are gone."""
        self._next = now + self.every
        if counts is None:
            self._silent.clear()
            return set()
        self._silent = {ch: t for ch, t in self._silent.items() if ch in counts}
        gone = set()
        for channel, count in counts.items():
            if count > 0:
                self._silent.pop(channel, None)
            elif now - self._silent.setdefault(channel, now) >= self.gone_after:
                gone.add(channel)
        return gone


def split_runs(values: list[Any], present: list[bool]) -> list[tuple[int, list[Any]]]:
    """(start, values) of each contiguous run of positions where ``present`` is true."""
    runs: list[tuple[int, list[Any]]] = []
    for i, (v, p) in enumerate(zip(values, present, strict=True)):
        if not p:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == i:
            runs[-1][1].append(v)
        else:
            runs.append((i, [v]))
    return runs

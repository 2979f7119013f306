"""The executor side of a partition: prepare (a CPU pool) → device (one thread per device) →
finish (on the replier).

    preparers  Assembler -> prepare_batch -> ready      (prepare_concurrency threads)
    device     ready, in order per key -> handle_batch   (max_concurrent_batches threads)
    replier    finish_batch -> split into rows -> encode (the runner's replier thread)

The device stage only runs the batch function: tokenizing, collating and building tensors
happen in a preparer while the device computes the batch before, and turning outputs into
replies (device-to-host copies, splitting, encoding) happens after it has moved on. A serving
without a preparation stage has no preparers: its device threads take batches straight from the
Assembler, with no hand-off between threads.

Bounds: at most ``prepare_concurrency + 1`` batches are taken ahead of the device (being
prepared, or prepared and waiting), so memory stays flat however long the backlog is: one more
than the pool, so a prepared batch is waiting when the device finishes one.

Order: batches of one batch key start on the device in the order they left the Assembler,
whichever preparer finished first; batches of different keys do not wait for each other.

Cancellation and deadlines are checked when a batch is taken, and again when it reaches the
device: a request cancelled or expired while its batch was being prepared is not run. The
rest of that batch is prepared again on the device's thread (what was prepared included the
withdrawn items); this happens only in that race.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from queueserve import hooks
from queueserve.key_states import KeyEvents, KeyLoadError, KeyStates, has_key_states
from queueserve.serving import Partition, Serving
from queueserve.wire.error import EXPIRED
from queueserve.wire.kinds import DROP
from queueserve.wire.tenants import split_lane
from queueserve.worker.logs import FailureLog, batch_scope
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline.batch_context import BatchContext
from queueserve.worker.pipeline.batching import Slice, TakenBatch
from queueserve.worker.pipeline.dedupe import Dupe, fan_out, unique
from queueserve.worker.pipeline.execute import (
    NOT_PREPARED,
    Part,
    Row,
    Segment,
    error_rows,
    finish_segments,
    prepare_isolated,
    rows_for,
    run_isolated,
)
from queueserve.worker.pipeline.latency import BatchTimes
from queueserve.worker.pipeline.ledger import Ledger

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Staged:
    """A batch on its way to the device: its place in line and what preparing it gave."""

    batch: TakenBatch
    seq: int = 0
    parts: list[Part] | None = None  # None: not prepared (yet)
    state: Any = None  # its key's state (load_key), pinned in the LRU until it ran
    pinned: str | None = None  # the key whose state it pinned


@dataclass(eq=False)
class Reply:
    """A batch's outcome as the device left it, turned into reply rows by the replier."""

    serving: Serving
    slices: list[Slice]
    segments: list[Segment]
    answered: set[int] = field(default_factory=set)  # ids of requests answered mid-batch
    dupes: list[Dupe] = field(default_factory=list)  # run as another slice (dedupe.py)

    def rows(self) -> list[Row]:
        rows = rows_for(self.slices, finish_segments(self.serving, self.segments))
        if self.dupes:
            rows = fan_out(rows, self.dupes)
        if self.answered:
            return [r for r in rows if id(r[0]) not in self.answered]
        return rows


Handover = list[Row] | Reply | None


def split_expired(slices: list[Slice], now: float) -> tuple[list[Slice], list[Slice]]:
    """(live, expired) by each request's deadline (unix seconds, 0 = none)."""
    live: list[Slice] = []
    expired: list[Slice] = []
    for s in slices:
        (expired if s.request.deadline and s.request.deadline <= now else live).append(s)
    return live, expired


class Stages:
    """Prepare, device and finish stages of one serving in one partition.

    ``take`` blocks until the Assembler gives a batch (and the slices cancelled in it), or
    returns None once the partition stops and nothing is left; the ledger withdraws slices
    cancelled since; ``send`` hands rows to the replier; ``count_delivery`` records a run of a
    redelivered request.
    """

    def __init__(
        self,
        serving: Serving,
        partition: Partition,
        middleware: Middleware,
        ledger: Ledger,
        *,
        take: Callable[[], tuple[TakenBatch, list[Slice]] | None],
        send: Callable[[Handover], None],
        count_delivery: Callable[[Slice], None],
    ) -> None:
        self.serving = serving
        self.partition = partition
        self.middleware = middleware
        self._take = take
        self._ledger = ledger
        self._send = send
        self._count_delivery = count_delivery
        # With load_key, the key states: a key is loaded in the preparation stage, so a
        # load runs while the device runs another key's batch (key_states.py)
        self.states = KeyStates.of(serving, _Events(self)) if has_key_states(serving) else None
        self.on_states: Callable[[], None] = lambda: None  # a key loaded or evicted
        stage = serving.has_prepare or self.states is not None
        self.preparers = serving.prepare_concurrency if stage else 0
        self.bound = self.preparers + 1  # batches taken ahead of the device, at most
        self._cond = threading.Condition()
        self._take_lock = threading.Lock()  # one preparer takes at a time: seqs follow takes
        self._seq = 0
        self._ahead = 0  # taken by preparers, not yet on the device
        self._ready: dict[int, Staged] = {}  # prepared, by seq
        self._lines: dict[str, deque[int]] = {}  # per key, seqs not yet on the device, in order
        self._preparers_left = self.preparers
        self.recent_batch_s = 0.0  # how long batches take, a moving average
        self.batch_times: BatchTimes | None = None  # the model max_latency plans with
        self._failures = FailureLog(serving.name, log)

    # -- preparers ---------------------------------------------------------------------------
    def prepare_loop(self) -> None:
        """One preparer thread: take, prepare, hand to the device; until nothing is left."""
        try:
            while (staged := self._take_ahead()) is not None:
                self._prepare(staged)
                with self._cond:
                    self._ready[staged.seq] = staged
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._preparers_left -= 1
                self._cond.notify_all()

    def _take_ahead(self) -> Staged | None:
        with self._cond:
            while self._ahead >= self.bound:
                self._cond.wait()
            self._ahead += 1
        with self._take_lock:
            taken = self._take()
            if taken is None:
                with self._cond:
                    self._ahead -= 1
                    self._cond.notify_all()
                return None
            batch, dropped = taken
            with self._cond:
                self._seq += 1
                staged = Staged(batch, self._seq)
                self._lines.setdefault(batch.key, deque()).append(staged.seq)
        self._drop(dropped)
        return staged

    def _prepare(self, staged: Staged) -> None:
        """Prepare the batch's live items (those cancelled or expired are answered instead)."""
        batch = staged.batch
        live, expired = split_expired(batch.slices, time.time())
        if expired:
            self._send(error_rows(expired, EXPIRED))
            batch.slices = live
        if not live:
            staged.parts = []
            return
        self._count_deliveries(live)
        if self.states is not None:
            key = split_lane(batch.key)[0]
            try:
                staged.state, staged.pinned = self.states.acquire(key), key
            except KeyLoadError as e:  # this key's requests get the error; other keys run on
                self._send(error_rows(live, e.body))
                batch.slices, staged.parts = [], []
                return
            if not self.serving.has_prepare:
                staged.parts = [Part(0, len(batch), None)]
                return
        staged.parts = prepare_isolated(
            self.serving, batch.items(), batch.key, self.partition, state=staged.state
        )

    def keys_ahead(self) -> set[str]:
        """The batch keys of the batches taken and not yet on the device."""
        with self._cond:
            return {split_lane(key)[0] for key in self._lines}

    # -- device ------------------------------------------------------------------------------
    def device_loop(self) -> None:
        """One device thread: run batches until nothing is left, then tell the replier."""
        try:
            while (staged := self._next_for_device()) is not None:
                try:
                    self._run(staged)
                finally:
                    if staged.pinned is not None and self.states is not None:
                        self.states.release(staged.pinned)
        finally:
            self._send(None)

    def _next_for_device(self) -> Staged | None:
        if not self.preparers:
            taken = self._take()
            if taken is None:
                return None
            batch, dropped = taken
            self._drop(dropped)
            return Staged(batch)
        with self._cond:
            while True:
                staged = self._runnable()
                if staged is not None:
                    del self._ready[staged.seq]
                    line = self._lines[staged.batch.key]
                    line.popleft()
                    if not line:  # keys come and go: keep only those with batches ahead
                        del self._lines[staged.batch.key]
                    self._ahead -= 1
                    self._cond.notify_all()
                    return staged
                if not self._preparers_left and not self._ready:
                    return None
                self._cond.wait()

    def _runnable(self) -> Staged | None:
        """The oldest prepared batch that is first in its key's line (caller holds _cond)."""
        best: Staged | None = None
        for seq, staged in self._ready.items():
            if self._lines[staged.batch.key][0] == seq and (best is None or seq < best.seq):
                best = staged
        return best

    def _run(self, staged: Staged) -> None:
        batch = staged.batch
        withdrawn = self._ledger.withdraw_cancelled_now(batch) if self.preparers else []
        self._drop(withdrawn)
        live, expired = split_expired(batch.slices, time.time())
        if expired:
            self._send(error_rows(expired, EXPIRED))
            batch.slices = live
        if not live:
            return
        if staged.parts is None or withdrawn or expired:
            # Not prepared (no preparation stage, or a preparer's items were withdrawn since):
            # run_isolated prepares in this thread when the serving has a prepare_batch.
            if staged.parts is None:
                self._count_deliveries(live)
            staged.parts = [Part(0, len(batch), NOT_PREPARED)]
        dupes: list[Dupe] = []
        if self.serving.cache_ttl > 0 and staged.parts[0].prepared is NOT_PREPARED:
            # (a batch prepared already runs as prepared: its items are in what prepare made)
            live, dupes = unique(self.serving, live)
            if dupes:
                batch.slices = live
                staged.parts = [Part(0, len(batch), NOT_PREPARED)]
        self._execute(batch, live, staged.parts, staged.state, dupes)

    def _execute(
        self,
        batch: TakenBatch,
        live: list[Slice],
        parts: list[Part],
        state: Any = None,
        dupes: list[Dupe] | None = None,
    ) -> None:
        items = batch.items()
        self.middleware.batch_opened(self.serving, batch.key, self.partition, live)
        self.middleware.batch_started(
            self.serving, batch.key, self.partition, len(items), time.monotonic() - batch.opened
        )
        started = time.perf_counter()
        context = BatchContext(
            self.serving.hooks, live, self._send, self._ledger.cancelled, self.serving.name
        )
        segments: list[Segment] = []
        with hooks.running(context), batch_scope(live) as batch_id:
            for part in parts:
                if part.error is not None:
                    segments.append((part.start, part.count, part.error))
                    continue
                segments += run_isolated(
                    self.serving,
                    items[part.start : part.start + part.count],
                    batch.key,
                    self.partition,
                    context.drive,
                    part.start,
                    part.prepared,
                    state,
                )
        took = time.perf_counter() - started
        if self.batch_times is not None:  # in the unit batches are measured in (latency.py)
            weight = len(items) if self.serving.cost is None else sum(s.weight for s in live)
            self.batch_times.observe(weight, took)
            if self.serving.max_latency:
                slack = self.serving.max_latency - (time.monotonic() - batch.since)
                model = self.batch_times
                self.middleware.batch_model(self.serving, self.partition, model.a, model.b, slack)
        self.recent_batch_s = 0.8 * self.recent_batch_s + 0.2 * took
        self.middleware.batch_finished(self.serving, batch.key, self.partition, len(items), took)
        self._failures.note(live, segments, batch_id)
        log.debug(
            "serving %s key %s partition %d: batch of %d items (%d requests) in %.2f ms",
            self.serving.name,
            batch.key,
            self.partition.index,
            len(items),
            len(live),
            took * 1000,
        )
        self._send(Reply(self.serving, live, segments, context.finished, dupes or []))

    def _count_deliveries(self, live: list[Slice]) -> None:
        """Count this run against ``max_deliveries`` for each redelivered request in it: once
        per run, however many batches the request spans."""
        for piece in live:
            request = piece.request
            if request.redelivered and not request.counted:
                request.counted = True
                self._count_delivery(piece)

    def _drop(self, slices: list[Slice]) -> None:
        if slices:
            self._send([(s.request, s.offset, len(s.items), DROP, None) for s in slices])


class _Events(KeyEvents):
    """A partition's key states, told to its middleware (metrics)."""

    def __init__(self, stages: Stages) -> None:
        self.stages = stages

    def loaded(self, key: str, seconds: float, ok: bool) -> None:
        st = self.stages
        st.middleware.key_loaded(st.serving, key, st.partition, seconds, ok)
        st.on_states()

    def evicted(self, key: str) -> None:
        st = self.stages
        st.middleware.key_evicted(st.serving, key, st.partition)
        st.on_states()

    def used(self, hit: bool, held: int) -> None:
        st = self.stages
        st.middleware.key_used(st.serving, st.partition, hit, held)

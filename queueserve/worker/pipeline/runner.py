"""One serving inside one partition: read, assemble, execute, reply, ack.

Threads, so that Redis I/O overlaps the batch function:

    reader     read.lua (XREADGROUP over the ready streams) / reclaim -> Intake -> Assembler
               (about max_concurrent_batches + 1 batches waiting beyond those running)
    preparers  Assembler -> prepare_batch (prepare_concurrency of them; servings with one)
    executors  -> batch function (max_concurrent_batches of them, default 1; see stages.py)
    replier    finish_batch, rows -> RPUSH to each caller's inbox + XACK/XDEL, one round trip

Executors touch Redis only when they would otherwise idle: an executor with nothing to run
takes the reader's blocking read (``_read_lent``) and sends its own batch's reply when nothing
else is queued (``_hand_over``), so an idle worker answers from one thread, with no hand-off
between threads; busy, the device never waits on Redis. A partition holds at most
max_concurrent_batches running batches, prepare_concurrency + 1 batches prepared ahead of them
and about one more batch waiting each, over all batch keys, so a crash strands little and other
workers share the load. A step serving runs instead under one step executor
(step_executor.py).

The reader never polls batch keys. Enqueue marks a stream *ready* (a sorted set ranked by
priority and waiting time); one script call reads the ready streams in rank order and unmarks
those it drained. Only when nothing is ready for it does the reader block, on the serving's
wake stream, which enqueue writes to when a stream becomes ready: an idle key costs nothing,
and a key with work never waits behind an idle one. A pub/sub listener learns of requests
cancelled after they were read.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from collections.abc import Callable

from queueserve.broker.consumer import Consumer
from queueserve.broker.core import Subscription
from queueserve.broker.reads import PendingRead, ReadOutcome, WakeRead
from queueserve.broker.retry import RedisFailure, Retry
from queueserve.serving import Partition, Serving
from queueserve.steps import StepServing
from queueserve.wire import protocol as P
from queueserve.wire.cancel import parse_cancel
from queueserve.wire.codec import get_codec
from queueserve.wire.options import parse_overrides
from queueserve.wire.timing import FORGET_EVERY_S, RECLAIM_EVERY_S
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline.batching import Assembler, Slice, TakenBatch
from queueserve.worker.pipeline.execute import Row
from queueserve.worker.pipeline.intake import Entry, Intake
from queueserve.worker.pipeline.replies import Composed
from queueserve.worker.pipeline.replies import ReplyQueue, compose
from queueserve.worker.pipeline.stages import Handover, Reply, Stages
from queueserve.worker.pipeline.step_executor import StepExecutor
from queueserve.worker.pipeline.stepping import StepQueue
from queueserve.worker.runtime_config import apply_overrides
from queueserve.worker.watchdog import run_guarded

log = logging.getLogger(__name__)

Ref = tuple[str, bytes]  # (stream, entry id): entry ids are unique only within one stream

INBOX_TTL_MS = 600_000  # an inbox outlives a client that died by ten minutes at most
# How often a bounded slice of the known keys (SWEEP_KEYS) is looked at for entries written
# without enqueue.lua and for idle keys to forget: a pass over n keys takes n / SWEEP_KEYS s.
SWEEP_EVERY_S = 1.0
CONFIG_EVERY_S = 1.0  # how often run-time option changes are looked for
READ_BLOCK_MS = 100  # longest wait on the wake stream when nothing is ready
# How long a drained reader keeps its blocking read for a busy executor to come back idle and
# take it (see _lend_or_wait), before blocking itself so that arrivals are read ahead.
LEND_WAIT_S = 0.002
FULL_WAIT_S = 0.002  # nothing readable but keys whose batch is full: look again this soon
RECENT_CANCELS = 10_000  # cancels of entries not held kept at most (junk floods the channel)



class ServingRunner:
    """Serves one serving from one partition process."""

    def __init__(
        self,
        serving: Serving,
        broker: Consumer,
        prefix: str,
        consumer: str,
        partition: Partition,
        *,
        batch_keys: tuple[str, ...] = (),
        max_concurrent_batches: int = 1,
        middleware: Middleware | None = None,
        on_fatal: Callable[[], None] = lambda: None,
    ) -> None:
        self.on_fatal = on_fatal
        # Our own copy: run-time config changes it, and the caller's object stays as it was.
        self.serving = serving = copy.copy(serving)
        self.middleware = middleware or Middleware()
        self.broker = broker
        self.keys = P.Keys(prefix, serving.name)
        self.shards = self.keys.sharded(serving.shards)  # shard 0 is self.keys
        self.consumer = consumer
        self.partition = partition
        self.intake = Intake(
            serving, get_codec(serving.codec), self.keys, broker, consumer, self.middleware
        )
        self.codec = self.intake.codec
        # A step serving's requests wait in a StepQueue (the reader fills it like an
        # Assembler) and run under continuous batching, by one StepExecutor.
        self.stepper: StepExecutor | None = None
        self.assembler: Assembler | StepQueue
        if isinstance(serving, StepServing):
            self.assembler = StepQueue(serving.batch_size)
            self.stepper = StepExecutor(self, self.assembler)
        else:
            self.assembler = Assembler(
                serving.batch_size, serving.batch_timeout, P.PRIORITY_AGE_MS / 1000
            )
        self.executors = 1 if self.stepper else max_concurrent_batches
        self.cond = threading.Condition()
        self.outbox = ReplyQueue()
        self.held: set[Ref] = set()  # entries read and not yet acked
        self.cancelled: set[Ref] = set()  # held entries whose callers cancelled them
        # Held packs (entries of several requests): a cancel never drops one, its other
        # requests must run (cancel.lua does not announce their cancels; forged ones land here)
        self.packs: set[Ref] = set()
        self.recent_cancels: dict[Ref, float] = {}  # cancels of entries not (yet) held
        self._junk_cancel_seen = False
        self._declared_keys = tuple(dict.fromkeys(("default", *batch_keys)))
        self._reading = True
        self._read_ended = False  # set by the reader as it ends: nothing more comes in
        self._readers_left = len(self.shards)  # the read ends when every shard's reader has
        self._drained_at: dict[int, bytes] = {}  # per shard: wake id of a read that left nothing
        self._sweep_from: dict[int, int] = {}  # per shard: rank of the next known key to sweep
        self._caught_up = False  # the last read left nothing unread (see _hand_over)
        self._flushing = False  # stopping: run what is buffered without waiting for timeouts
        self.threads: list[threading.Thread] = []
        self._config_seen: dict[str, str] = {}
        self._item_weight = 1.0  # cost per item read, averaged (1 without a cost function)
        self._cancels: Subscription | None = None
        self._listening = threading.Event()  # cleared when the cancel listener must end
        self._reply_retry = Retry(broker.outage, f"serving {serving.name} replier")
        self._reserved = 0  # items that reads in flight may bring (one reader per shard)
        # An idle worker's blocking read is done by the thread that will run what it brings
        # (the executor, or a preparer), not by the reader: one thread hand-off less on an idle
        # worker's round trip. One shard only: a taker blocks on one shard's wake stream.
        self._lends_reads = len(self.shards) == 1 and self.stepper is None
        self._borrowed = False  # a taker holds the blocking read (shard 0's wake id)
        self._lent_since = 0.0  # when the blocking read became free to take
        self._reader_wake = threading.Event()  # a waiting reader should look again
        self.stages = Stages(
            serving, partition, self.middleware, take=self._next_batch,
            withdraw=self._withdraw_cancelled_now, send=self._hand_over,
            count_delivery=self._count_delivery, cancelled=self.cancelled,
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._apply_config()
        self.broker.declare(self.keys, self.serving.options())
        if len(self.shards) > 1:  # clients trust the count once it is here too (Keys.last_shard)
            self.broker.declare(self.shards[-1], {"shards": len(self.shards)})
        self.broker.adopt_legacy_keys(self.keys)
        for keys in self.shards:
            for key in self._declared_keys:  # so anyone may XADD to a declared key's stream
                self.broker.ensure_group(keys.stream(key))
        self._listen_for_cancels()
        # One reader per shard: each blocks on its own shard's wake stream (on a cluster one
        # blocking read cannot span slots), so an idle shard never delays a busy one; they
        # share the look-ahead budget and fill one assembler, so batches mix shards.
        roles: list[tuple[str, Callable[[], None]]] = [
            (f"reader{keys.shard or ''}", functools.partial(self._read_loop, keys))
            for keys in self.shards
        ]
        roles.append(("replier", self._reply_loop))
        if self.stepper is not None:
            roles.append(("stepper", self.stepper.run))
        else:
            roles += [(f"preparer{i}", self.stages.prepare_loop)
                      for i in range(self.stages.preparers)]
            roles += [(f"executor{i}", self.stages.device_loop) for i in range(self.executors)]
        roles += [("cancels", self._cancel_loop)]  # last: join() stops it after the others
        for name, target in roles:
            t = threading.Thread(
                target=self._guarded, args=(name, target),
                name=f"queueserve-{self.serving.name}-p{self.partition.index}-{name}",
                daemon=True,
            )
            t.start()
            self.threads.append(t)

    def _guarded(self, name: str, loop: Callable[[], None]) -> None:
        """Run a thread's loop; if it dies of a bug (or ends before a stop), the partition must
        not live on half-dead: ``on_fatal`` ends it, and its work is reclaimed by others or by
        its restart (watchdog.run_guarded)."""
        run_guarded(
            f"serving {self.serving.name} partition {self.partition.index}: {name}", loop,
            self.on_fatal, lambda: not self._reading,
        )

    @property
    def reading(self) -> bool:
        """Still taking work in (False once draining for a stop and the last read is in:
        a read that began before the stop may bring entries after it)."""
        return not self._read_ended

    def stop_reading(self) -> None:
        with self.cond:
            self._reading = False
            self._flushing = True
            self.cond.notify_all()
        self._reader_wake.set()

    def join(self, timeout: float | None) -> bool:
        """Wait until everything held was executed and answered; False if time ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # Cancels matter until the last held batch ran: the listener stops after the others.
        *working, listener = self.threads
        for t in working:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._listening.clear()  # it ends within one read of its channel
        listener.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def _listen_for_cancels(self) -> None:
        """Subscribe to the serving's cancel channel before reading: a cancel published
        between the first read and a later subscription would be missed."""
        self._cancels = self.broker.subscribe(*(keys.cancel for keys in self.shards))
        self._cancels.open()
        self._listening.set()

    def _cancel_loop(self) -> None:
        assert self._cancels is not None
        retry = Retry(self.broker.outage, "cancel listener")
        try:
            while self._listening.is_set():
                try:
                    message = self._cancels.get(timeout=0.5)
                except RedisFailure as e:
                    time.sleep(retry.failed(e))
                    continue
                retry.succeeded()
                if message is not None:
                    self._on_cancel(message)
        finally:
            self._cancels.close()

    def _on_cancel(self, message: bytes) -> None:
        ref = parse_cancel(message)
        if ref is None or not self._is_own_stream(ref[0]):
            if not self._junk_cancel_seen:  # anyone may publish here: say so once
                self._junk_cancel_seen = True
                log.warning("serving %s: ignored a message on %s that is not a cancel of one "
                            "of its streams: %r", self.serving.name, self.keys.cancel,
                            message[:200])
            return
        with self.cond:
            if ref in self.packs:
                return
            if ref in self.held:
                self.cancelled.add(ref)
            else:  # maybe read but not yet recorded as held: _take_in looks here
                self._remember_cancel(ref)

    def _is_own_stream(self, stream: str) -> bool:
        try:
            self.keys.parse_stream(stream)
        except ValueError:
            return False
        return True

    def _remember_cancel(self, ref: Ref) -> None:
        """Keep a cancel for an entry not (yet) held for a minute, and at most
        RECENT_CANCELS of them (caller holds self.cond); oldest first, so pruning stops at
        the first one young enough."""
        now = time.monotonic()
        recent = self.recent_cancels
        recent.pop(ref, None)
        recent[ref] = now
        while len(recent) > RECENT_CANCELS or next(iter(recent.values())) < now - 60:
            del recent[next(iter(recent))]

    # -- reader ------------------------------------------------------------------------------
    def _read_loop(self, keys: P.Keys) -> None:
        shard = f" shard {keys.shard}" if len(self.shards) > 1 else ""
        retry = Retry(self.broker.outage, f"serving {self.serving.name}{shard} reader")
        now = time.monotonic()
        due = {"sweep": 0.0, "reclaim": 0.0, "forget": now + FORGET_EVERY_S}
        if keys.shard == 0:  # run-time config is the serving's, kept on shard 0
            due["config"] = now
        while self._reading:
            try:
                self._housekeeping(due, keys)
                self._read_once(keys)
            except RedisFailure as e:
                time.sleep(retry.failed(e))
                continue
            retry.succeeded()
        # Only after a stop, never on the way out of an exception (no finally): an idle
        # executor takes the lent read again as soon as it gives it back, so waiting for it
        # ends only once reading stopped; a reader that died of a bug must reach _guarded.
        with self.cond:
            while self._borrowed:  # a read lent out may still bring entries
                self.cond.wait()
            self._drained_at.pop(keys.shard, None)  # nobody may start a read now
            self._readers_left -= 1
            self._read_ended = self._readers_left == 0
            self.cond.notify_all()

    def _housekeeping(self, due: dict[str, float], keys: P.Keys) -> None:
        now = time.monotonic()
        if now >= due["sweep"]:
            forgotten, _, self._sweep_from[keys.shard] = self.broker.sweep(
                keys, int(self.serving.key_idle_ttl * 1000), self._declared_keys,
                self._sweep_from.get(keys.shard, 0),
            )
            if forgotten:
                log.info("serving %s: forgot %d batch keys idle for %gs", self.serving.name,
                         forgotten, self.serving.key_idle_ttl)
            due["sweep"] = now + SWEEP_EVERY_S
        if now >= due["reclaim"]:
            with self.cond:
                room = self._budget()
                held = set(self.held)
            if room > 0:
                streams = self.broker.active_streams(keys)
                self._take_in(self.intake.reclaim(streams, room, held))
            due["reclaim"] = now + RECLAIM_EVERY_S
        if now >= due.get("config", float("inf")):
            self._apply_config()
            due["config"] = now + CONFIG_EVERY_S
        if now >= due["forget"]:
            self.intake.forget_dead_consumers(self.broker.active_streams(keys))
            due["forget"] = now + FORGET_EVERY_S

    def _budget(self) -> int:
        """Items to read now over all keys (caller holds self.cond).

        The partition's look-ahead is one batch beyond each executor's: reading stops while
        that much waits. Keys holding a whole batch are not read at all (``full_keys``), so
        the look-ahead always has room for other keys: a quiet key is read while a busy key's
        batch waits, and a key can fill its batch while others hold partial ones. Capacity is
        in items or cost; read.lua counts items: divide by what an item usually costs."""
        room = self.assembler.capacity * (self.executors + 1) - self.assembler.weight
        room -= self._reserved * self._item_weight
        return max(1, int(room / self._item_weight)) if room > 0 else 0

    def _per_key(self) -> int:
        return max(1, int(self.assembler.capacity / self._item_weight))

    def _apply_config(self) -> None:
        """Pick up options changed with `queueserve config set`."""
        raw = self.broker.config(self.keys)
        if raw == self._config_seen:
            return
        self._config_seen = raw
        with self.cond:
            changed = apply_overrides(self.serving, parse_overrides(raw, self.keys))
            self.assembler.capacity = self.serving.batch_size
            self.assembler.timeout = self.serving.batch_timeout
            self.cond.notify_all()
        if "batch_size" in changed:  # clients pack up to one batch (enqueue.lua)
            self.broker.declare(self.keys, {"pack_items": self.serving.batch_size})
        for name, (old, new) in changed.items():
            log.warning("serving %s: %s changed from %s to %s", self.serving.name, name, old, new)

    def _read_once(self, keys: P.Keys) -> None:
        if self._lends_reads and self._lend_or_wait():
            return
        with self.cond:
            budget = self._budget()
            if budget <= 0:  # the look-ahead is full: an executor taking a batch wakes us
                self.cond.wait(RECLAIM_EVERY_S)
                return
            full = self.assembler.full_keys()
            per_key = self._per_key()
            if len(self.shards) > 1 and keys.shard in self._drained_at:
                # This read blocks first (up to READ_BLOCK_MS) on a drained shard: it
                # reserves a share of the room, not all of it, or the other shards' readers
                # would find none while it waits.
                budget = max(1, budget // len(self.shards))
            self._reserved += budget
        try:
            if not self._reading:
                return
            read = self._read(keys, budget, per_key, full)
            self._take_in_read(read)
        finally:
            with self.cond:
                self._reserved -= budget
                if len(self.shards) > 1:
                    self.cond.notify_all()  # another shard's reader may wait for this room
        self._after_read(keys, read, full)

    def _after_read(self, keys: P.Keys, read: ReadOutcome, full: list[str]) -> None:
        """What the reader does next: block for new work, wait for a batch to be taken, or
        leave its blocking read to an idle executor."""
        if read.entries:
            if read.drained:
                # Another read now would only cost a round trip (and, on an idle worker,
                # compete with the executor for the CPU): block for new work next.
                with self.cond:
                    self._drained_at[keys.shard] = read.wake_id
                    self._lent_since = time.monotonic()
            elif not read.skipped and not read.more:
                # This read looked at every ready stream: if all it read from now hold a
                # whole batch, reading again finds nothing until a batch is taken.
                self._wait_while_full({keys.batch_key_of(s) for s, _ in read.entries})
        elif read.skipped:  # work waits only on keys we hold a full batch of
            self._wait_while_full(set(full))
        elif self._lends_reads:
            # A blocking read that timed out: an idle executor takes the next one.
            with self.cond:
                self._drained_at[keys.shard] = read.wake_id
                self._lent_since = time.monotonic()
                self.cond.notify_all()

    def _read(
        self, keys: P.Keys, budget: int, per_key: int, full: list[str]
    ) -> ReadOutcome:
        """What is ready of this shard; when the last read drained it (or nothing is ready),
        block on the wake stream and read in the same round trip."""
        with self.cond:
            wake_id = self._drained_at.pop(keys.shard, None)
        if wake_id is None:
            read = self.broker.read_ready(keys, self.consumer, budget, per_key, full)
            if read.entries or read.skipped:
                return read
            if len(self.shards) > 1:  # block on the next turn, with a share of the room
                self._drained_at[keys.shard] = read.wake_id
                return read
            wake_id = read.wake_id
        return self.broker.wait_then_read(
            keys, WakeRead(wake_id, READ_BLOCK_MS, self.consumer, budget, per_key, full)
        )

    def _wait_while_full(self, keys: set[str]) -> None:
        """Wait for an executor to take a batch, if every key of ``keys`` still holds a whole
        one (an executor that took one meanwhile notified before this wait began); at most
        FULL_WAIT_S, so work that became ready on other keys meanwhile is read soon."""
        with self.cond:
            if keys.issubset(self.assembler.full_keys()):
                self.cond.wait(FULL_WAIT_S)

    def _take_in_read(self, read: ReadOutcome, yield_gil: bool = True) -> None:
        # Nothing known to wait in Redis: an idle executor may reply itself.
        self._caught_up = read.drained or not (read.entries or read.skipped)
        if read.entries:
            self._take_in([
                Entry(stream, entry_id, fields)
                for stream, entries in read.entries
                for entry_id, fields in entries
            ], yield_gil)

    def _lend_or_wait(self) -> bool:
        """The reader's side of lending its blocking read; True when it must not read now.

        A drained reader's next read would block on the wake stream until work comes. An idle
        executor takes that read instead (``_read_lent``), so what it brings runs on the thread
        that read it. While a taker holds it, the reader waits; when the read comes back and
        the executor is busy with what it brought, the reader leaves it free for LEND_WAIT_S
        (the executor usually finishes a small batch sooner, and takes it again) and then
        blocks itself, so that work arriving during a long batch is read ahead of it."""
        self._reader_wake.clear()  # before looking: a wake-up from now on is not missed
        with self.cond:
            if not self._borrowed and (
                0 not in self._drained_at or not self._reading
                or time.monotonic() - self._lent_since >= LEND_WAIT_S
            ):
                return False
            wait = RECLAIM_EVERY_S if self._borrowed else LEND_WAIT_S
        self._reader_wake.wait(wait)
        return True

    def _borrow_read(self) -> bytes | None:
        """Take the reader's blocking read, if it is free and nothing waits in the assembler
        (whose batch timeout a read blocking up to READ_BLOCK_MS could overrun); the caller
        holds self.cond and then calls ``_read_lent``."""
        if not self._lends_reads or self._borrowed or self.assembler.buffered or not self._reading:
            return None
        wake_id = self._drained_at.pop(0, None)
        self._borrowed = wake_id is not None
        return wake_id

    def _wake_read(self, wake_id: bytes) -> WakeRead:
        """A lent blocking read after ``wake_id`` (caller holds self.cond)."""
        # Not reserved against the reader's reclaims: this read may block for READ_BLOCK_MS
        # at a time, again and again on an idle worker, and reclaims would find no room for
        # ever. A reclaim meanwhile (dead consumers' work, rare) may bring one look-ahead more.
        return WakeRead(wake_id, READ_BLOCK_MS, self.consumer, self._budget(), self._per_key(),
                        self.assembler.full_keys())

    def _return_read(self, wake_id: bytes) -> None:
        """Give back a borrowed read that was never sent, as it was."""
        with self.cond:
            self._borrowed = False
            if self._reading:
                self._drained_at[0] = wake_id
            self.cond.notify_all()

    def _read_lent(self, lent: bytes | PendingRead) -> None:
        """Block on the wake stream and read, as the reader would, from the thread that will
        run what comes (or finish such a read sent behind a reply); give the read back to the
        reader drained, or wake it to read on."""
        if isinstance(lent, PendingRead):
            read_now = lent.result
        else:
            with self.cond:
                wake_read = self._wake_read(lent)
            read_now = functools.partial(self.broker.wait_then_read, self.keys, wake_read)
        drained_at = None
        try:
            read = read_now()
            self._take_in_read(read, yield_gil=False)
            if read.drained or not (read.entries or read.skipped):
                drained_at = read.wake_id
        except RedisFailure:
            pass  # the reader reads next: its retries ride the outage out
        finally:
            with self.cond:
                self._borrowed = False
                if drained_at is not None and self._reading:
                    self._drained_at[0] = drained_at
                    self._lent_since = time.monotonic()
                self.cond.notify_all()
            # Work left in Redis, or batches long enough that work arriving meanwhile should be
            # read ahead of them: the reader reads next. Otherwise this thread is back before
            # LEND_WAIT_S and takes the read again, and waking the reader would only cost CPU.
            if drained_at is None or self.stages.recent_batch_s >= LEND_WAIT_S:
                self._reader_wake.set()

    def _take_in(self, entries: list[Entry], yield_gil: bool = True) -> None:
        if not entries:
            return
        slices, rows = self.intake.ingest(entries)
        if slices and self.serving.cost is not None:  # a moving average of an item's cost
            items = sum(len(piece.items) for _, piece in slices)
            weight = max(sum(piece.weight for _, piece in slices) / max(items, 1), 1e-3)
            self._item_weight = 0.8 * self._item_weight + 0.2 * weight
        now = time.monotonic()
        with self.cond:
            idle = self.assembler.buffered == 0  # an executor may be waiting for this
            # Every request taken in, also those answered only with errors: held until acked.
            self.held.update(piece.request.ref for _, piece in slices)
            self.held.update(row[0].ref for row in rows)
            packs = {p.request.ref for _, p in slices if p.request.pack is not None}
            if packs or any(row[0].pack is not None for row in rows):
                packs.update(row[0].ref for row in rows if row[0].pack is not None)
                self.packs.update(packs)
            if self.recent_cancels:
                self.cancelled.update(self.held.intersection(self.recent_cancels) - self.packs)
            for key, piece in slices:
                self.assembler.add(key, piece, now)
            self.cond.notify_all()
        if rows:  # only now: the replier forgets what it acks, so it must be held first
            self.outbox.put(rows)
        if idle and slices and yield_gil:
            # Let the woken executor have the GIL now: otherwise it waits until this thread
            # blocks in its next read, a few hundred µs of Python later, on the critical
            # path of an idle worker's answer. Reading ahead can wait.
            time.sleep(0)

    # -- executor ----------------------------------------------------------------------------
    def _next_batch(self) -> tuple[TakenBatch, list[Slice]] | None:
        assert isinstance(self.assembler, Assembler)  # step servings run a StepExecutor
        while True:
            with self.cond:
                while True:
                    now = time.monotonic()
                    chosen, wait = self.assembler.pick(now, flush=self._flushing)
                    if chosen is not None:
                        batch = self.assembler.take(chosen, now)
                        self.cond.notify_all()  # room for the reader
                        return batch, self._withdraw_cancelled(batch)
                    if self._read_ended and self.assembler.buffered == 0:
                        return None
                    wake_id = self._borrow_read()
                    if wake_id is not None:
                        break
                    if self._lends_reads and self.assembler.buffered and 0 in self._drained_at:
                        # A batch filling up until its timeout: the reader reads meanwhile.
                        self._reader_wake.set()
                    self.cond.wait(wait)
            self._read_lent(wake_id)

    def _withdraw_cancelled(self, batch: TakenBatch) -> list[Slice]:
        """Remove slices whose callers cancelled (caller holds self.cond); returns them."""
        if not self.cancelled:
            return []
        dropped = [s for s in batch.slices if s.request.ref in self.cancelled]
        if dropped:
            batch.slices = [s for s in batch.slices if s.request.ref not in self.cancelled]
        return dropped

    def _withdraw_cancelled_now(self, batch: TakenBatch) -> list[Slice]:
        with self.cond:
            return self._withdraw_cancelled(batch)

    def _count_delivery(self, piece: Slice) -> None:
        request = piece.request
        try:
            self.broker.count_delivery(request.stream, self.consumer, request.entry_id)
        except RedisFailure as e:
            log.warning("serving %s: could not count a redelivery: %s", self.serving.name, e)

    def _hand_over(self, item: Handover) -> None:
        """Give a batch's reply to the replier; or, when no batch waits to run, the last read
        left nothing unread and the replier has nothing to do, send it from this thread: the
        executor would idle meanwhile, and the answer leaves without waking another thread.
        With a backlog the replier sends, so the next batch never waits for a reply; and a
        serving with a finish stage always finishes on the replier, off the device's thread."""
        if (item is not None and self._caught_up and not self.serving.has_finish
                and self.assembler.buffered == 0 and self.outbox.claim()):
            # A batch's answer, on the thread that takes the next batch itself (no preparers):
            # its next step is the lent read, so that goes in the same write (see _send).
            read_next = isinstance(item, Reply) and not self.stages.preparers
            pending = None
            try:
                pending = self._send(item if isinstance(item, list) else item.rows(), read_next)
            finally:
                self.outbox.done()
            if pending is not None:
                self._read_lent(pending)
        else:
            self.outbox.put(item)

    # -- replier -----------------------------------------------------------------------------
    def _reply_loop(self) -> None:
        executors_left = self.executors  # each executor ends the outbox with None
        while executors_left:
            rows: list[Row] = []
            # Whatever is queued goes in the same round trip.
            for item in self.outbox.take():
                if item is None:
                    executors_left -= 1
                else:  # a Reply is split into rows here, off the device's thread
                    rows += item if isinstance(item, list) else item.rows()
            try:
                if rows:
                    self._send(rows)
            finally:
                self.outbox.done()

    def _send(self, rows: list[Row], read_next: bool = False) -> PendingRead | None:
        """Reply and ack. ``read_next``: when the reader's blocking read is free, borrow it and
        send it behind the reply, so Redis starts it as soon as the next request comes, while
        this thread still settles this reply; returned for ``_read_lent`` to finish."""
        out = compose(rows, self.codec, self.serving.max_reply_bytes)
        with self.cond:
            wake_id = self._borrow_read() if read_next else None
            then_read = None if wake_id is None else self._wake_read(wake_id)
        pending: PendingRead | None = None

        def attempt() -> None:
            nonlocal then_read, pending
            fused, then_read = then_read, None  # a retry sends the reply alone
            pending = self.broker.reply_and_ack(
                self.keys, out.messages, out.acks, INBOX_TTL_MS, out.events,
                durable=self.serving.durable, then_read=fused,
            )

        try:
            # Unacked work stays ours (our heartbeat holds it): retry until Redis takes it.
            self._reply_retry.run(attempt)
            self._settle(out)
        except BaseException:
            if pending is not None:
                pending.abandon()  # what it read is taken back as forgotten (intake)
                pending = None
            raise
        finally:
            if wake_id is not None and pending is None:
                self._return_read(wake_id)
        return pending

    def _settle(self, out: Composed) -> None:
        self.middleware.replied(self.serving, out.answered, len(out.finished), out.errors)
        with self.cond:
            self.held.difference_update(out.finished)
            if self.packs:
                self.packs.difference_update(out.finished)
            if self.cancelled:
                self.cancelled.difference_update(out.finished)

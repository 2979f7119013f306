"""The reader: one thread per shard that reads what is ready into the assembler, and keeps the
partition's house (sweeps, reclaims, run-time config, forgetting dead consumers).

The reader never polls batch keys. Enqueue marks a stream *ready* (a sorted set ranked by
priority and waiting time); one script call reads the ready streams in rank order and unmarks
those it drained. Only when nothing is ready for it does the reader block, on the serving's
wake stream, which enqueue writes to when a stream becomes ready: an idle key costs nothing,
and a key with work never waits behind an idle one. An idle worker's blocking read may be
lent to an executor (lease.py). Each shard has its own reader: each blocks on its own shard's
wake stream (on a cluster one blocking read cannot span slots), so an idle shard never delays
a busy one; they share the look-ahead budget and fill one assembler, so batches mix shards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from queueserve.broker.consumer import Consumer
from queueserve.broker.reads import ReadOutcome, WakeRead
from queueserve.broker.retry import RedisFailure, Retry
from queueserve.options.stored import parse_overrides
from queueserve.serving import Serving
from queueserve.wire.keys import Keys
from queueserve.wire.timing import FORGET_EVERY_S, RECLAIM_EVERY_S
from queueserve.worker.pipeline.batching import Assembler
from queueserve.worker.pipeline.declaration import Declaration
from queueserve.worker.pipeline.intake import Decisions, Entry, Intake
from queueserve.worker.pipeline.lease import READ_BLOCK_MS, ReadLease
from queueserve.worker.pipeline.ledger import Ledger
from queueserve.worker.pipeline.quiet_keys import QuietKeyWatch
from queueserve.worker.pipeline.reclaim import Reclaims
from queueserve.worker.pipeline.replies import ReplyQueue
from queueserve.worker.pipeline.shares import share_tenants
from queueserve.worker.runtime_config import apply_overrides
from queueserve.worker.stepping.joins import StepQueue

log = logging.getLogger(__name__)

# How often a bounded slice of the known keys (SWEEP_KEYS) is looked at for entries written
# without enqueue.lua and for idle keys to forget: a pass over n keys takes n / SWEEP_KEYS s.
SWEEP_EVERY_S = 1.0
CONFIG_EVERY_S = 1.0  # how often run-time option changes are looked for
FULL_WAIT_S = 0.002  # nothing readable but keys whose batch is full: look again this soon


class Reader:
    """Reads one serving's shards into its assembler (``loop``: one thread per shard)."""

    def __init__(
        self,
        serving: Serving,
        broker: Consumer,
        shards: list[Keys],
        consumer: str,
        intake: Intake,
        ledger: Ledger,
        assembler: Assembler | StepQueue,
        outbox: ReplyQueue,
        *,
        executors: int,
        declared_keys: tuple[str, ...],
        lends: bool,
        batch_s: Callable[[], float],
    ) -> None:
        self.serving = serving  # the runner's copy: run-time config changes it
        self.broker = broker
        self.shards = shards
        self.keys = shards[0]
        self.consumer = consumer
        self.intake = intake
        self.reclaims = Reclaims(serving, intake.keys, broker, consumer, intake.middleware)
        self.declaration = Declaration(serving, broker, shards)
        self.ledger = ledger
        self.cond = ledger.cond
        self.assembler = assembler
        self._tune_assembler()  # the serving's own options, however they were set
        self.outbox = outbox
        self.executors = executors
        self.declared_keys = declared_keys
        self.reading = True  # False once the partition stops: no read starts after
        self.flushing = False  # stopping: run what is buffered without waiting for timeouts
        self.ended = False  # set as the last shard's reader ends: nothing more comes in
        self._readers_left = len(shards)
        self._sweep_from: dict[int, int] = {}  # per shard: rank of the next known key to sweep
        self.caught_up = False  # the last read left nothing unread (runner._hand_over)
        self._config_seen: dict[str, str] = {}
        self._item_weight = 1.0  # cost per item read, averaged (1 without a cost function)
        self._reserved = 0  # items that reads in flight may bring (one reader per shard)
        self.quiet_keys = QuietKeyWatch(broker, consumer, batch_s, assembler, executors)
        self.lease = ReadLease(
            self.cond,
            assembler,
            broker,
            self.keys,
            consumer,
            lends=lends,
            reading=lambda: self.reading,
            room=lambda: (self.budget(), self.per_key(), self.age_ms()),
            take_in=self.take_in_read,
            batch_s=batch_s,
        )

    def stop(self) -> None:
        with self.cond:
            self.reading = False
            self.flushing = True
            self.cond.notify_all()
        self.lease.reader_wake.set()

    def loop(self, keys: Keys) -> None:
        """One shard's reader thread, until the partition stops."""
        shard = f" shard {keys.shard}" if len(self.shards) > 1 else ""
        retry = Retry(self.broker.outage, f"serving {self.serving.name}{shard} reader")
        now = time.monotonic()
        due = {"sweep": 0.0, "reclaim": 0.0, "forget": now + FORGET_EVERY_S}
        if keys.shard == 0:  # run-time config is the serving's, kept on shard 0
            due["config"] = now
        while self.reading:
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
            while self.lease.borrowed:  # a read lent out may still bring entries
                self.cond.wait()
            self.lease.drained_at.pop(keys.shard, None)  # nobody may start a read now
            self._readers_left -= 1
            self.ended = self._readers_left == 0
            self.cond.notify_all()

    def _housekeeping(self, due: dict[str, float], keys: Keys) -> None:
        # Each job's next time is set first: one Redis keeps refusing never stands between
        # the read loop (which rides the error out) and its reads.
        now = time.monotonic()
        if now >= due["sweep"]:
            due["sweep"] = now + SWEEP_EVERY_S
            forgotten, _, self._sweep_from[keys.shard] = self.broker.sweep(
                keys,
                int(self.serving.key_idle_ttl * 1000),
                self.declared_keys,
                self._sweep_from.get(keys.shard, 0),
            )
            if forgotten:
                log.info(
                    "serving %s: forgot %d batch keys idle for %gs",
                    self.serving.name,
                    forgotten,
                    self.serving.key_idle_ttl,
                )
        if now >= due["reclaim"]:
            due["reclaim"] = now + RECLAIM_EVERY_S
            with self.cond:
                room = self.budget()
                held = self.ledger.held_now()
                lent_since = self.lease.taken_since()
            if room > 0:
                streams = self.broker.active_streams(keys)
                self.take_in(self.reclaims.reclaim(streams, room, held, lent_since))
        if now >= due.get("config", float("inf")):
            due["config"] = now + CONFIG_EVERY_S
            self.apply_config()
            self.declaration.keep(self._config_seen)
        if now >= due["forget"]:
            due["forget"] = now + FORGET_EVERY_S
            self.reclaims.forget_dead_consumers(self.broker.active_streams(keys))

    def budget(self) -> int:
        """Items to read now over all keys (caller holds cond).

        The partition's look-ahead is one batch beyond each executor's: reading stops while
        that much waits. A key counts for one batch at most (``look_ahead``), and keys holding
        a whole batch are not read (``read_marks``, but for priorities above what they hold),
        so the look-ahead always has room for other keys and priorities: a quiet key is read
        while a busy key's backlog waits, however big its requests, and runs in one of the
        next batches (keys take turns by batch). Capacity is in items or cost; read.lua counts
        items: divide by what an item usually costs."""
        room = self.assembler.capacity * (self.executors + 1) - self.assembler.look_ahead()
        room -= self._reserved * self._item_weight
        return max(1, int(room / self._item_weight)) if room > 0 else 0

    def per_key(self) -> int:
        return max(1, int(self.assembler.capacity / self._item_weight))

    def apply_config(self) -> None:
        """Pick up options changed with `queueserve config set`, and the tenants' weights."""
        raw, tenants = self.broker.run_time_config(self.keys)
        share_tenants(self.assembler, tenants, self.cond, self.serving.name)
        if raw == self._config_seen:
            return
        self._config_seen = raw
        with self.cond:
            changed = apply_overrides(self.serving, parse_overrides(raw, self.keys))
            self._tune_assembler()
            self.cond.notify_all()
        for name, (old, new) in changed.items():  # an operator's own action: news, not a warning
            log.info("serving %s: %s changed from %s to %s", self.serving.name, name, old, new)

    def _tune_assembler(self) -> None:
        """The serving's batching options into the assembler: at the start (options set in
        code, as class attributes or by the worker's flags) and after each config change."""
        assembler, serving = self.assembler, self.serving
        assembler.capacity = serving.batch_size
        assembler.timeout = serving.batch_timeout
        if isinstance(assembler, Assembler):
            assembler.age_per_priority = serving.priority_age
            assembler.weights = serving.batch_key_weights
            assembler.plan_latency(serving.max_latency)

    def _read_once(self, keys: Keys) -> None:
        lease = self.lease
        if lease.lends and lease.reader_waits():
            return
        with self.cond:
            budget = self.budget()
            watch_ms = (
                self.quiet_keys.block_ms(keys) if budget <= 0 and len(self.shards) == 1 else 0
            )
            if budget <= 0 and not watch_ms:  # the look-ahead is full: a batch taken wakes us
                self.cond.wait(RECLAIM_EVERY_S)
                return
            marks = self.assembler.read_marks()
            per_key = self.per_key()
            if len(self.shards) > 1 and keys.shard in lease.drained_at:
                # This read blocks first (up to READ_BLOCK_MS) on a drained shard: it
                # reserves a share of the room, not all of it, or the other shards' readers
                # would find none while it waits.
                budget = max(1, budget // len(self.shards))
            self._reserved += budget
        if watch_ms:  # the look-ahead is full: but a quiet key goes first (quiet_keys.py)
            if self.reading:
                read = self.quiet_keys.read(keys, watch_ms, per_key, marks, self.age_ms())
                caught_up = self.caught_up  # (a read of leading keys says nothing of the rest)
                self.take_in_read(read)
                self.caught_up = caught_up
            return
        try:
            if not self.reading:
                return
            read = self._read(keys, budget, per_key, marks)
            self.quiet_keys.seen[keys.shard] = read.wake_id
            self.take_in_read(read)
        finally:
            with self.cond:
                self._reserved -= budget
                if len(self.shards) > 1:
                    self.cond.notify_all()  # another shard's reader may wait for this room
        self._after_read(keys, read, marks)

    def _after_read(self, keys: Keys, read: ReadOutcome, marks: list[str]) -> None:
        """What the reader does next: block for new work, wait for a batch to be taken, or
        leave its blocking read to an idle executor."""
        if read.entries:
            if read.drained:
                # Another read now would only cost a round trip (and, on an idle worker,
                # compete with the executor for the CPU): block for new work next.
                with self.cond:
                    self.lease.drained(keys.shard, read.wake_id)
            elif not read.skipped and not read.more:
                # This read looked at every ready stream: if all it read from now hold a
                # whole batch, reading again finds nothing until a batch is taken.
                self._wait_while_full({keys.batch_key_of(s) for s, _ in read.entries})
        elif read.skipped:  # work waits only on keys we hold a full batch of
            self._wait_while_full({mark[1:] for mark in marks if mark[0] not in "-=~@^!*"})
        elif self.lease.lends:
            # A blocking read that timed out: an idle executor takes the next one.
            with self.cond:
                self.lease.drained(keys.shard, read.wake_id)
                self.cond.notify_all()

    def _read(self, keys: Keys, budget: int, per_key: int, marks: list[str]) -> ReadOutcome:
        """What is ready of this shard; when the last read drained it (or nothing is ready),
        block on the wake stream and read in the same round trip."""
        drained_at = self.lease.drained_at
        with self.cond:
            wake_id = drained_at.pop(keys.shard, None)
        if wake_id is None:
            read = self.broker.read_ready(
                keys, self.consumer, budget, per_key, marks, self.age_ms()
            )
            if read.entries or read.skipped:
                return read
            if len(self.shards) > 1:  # block on the next turn, with a share of the room
                drained_at[keys.shard] = read.wake_id
                return read
            wake_id = read.wake_id
        return self.broker.wait_then_read(
            keys,
            WakeRead(wake_id, READ_BLOCK_MS, self.consumer, budget, per_key, marks, self.age_ms()),
        )

    def age_ms(self) -> int:
        """What read.lua ranks a priority level as: ms of waiting (priority_age)."""
        return int(self.serving.priority_age * 1000)

    def _wait_while_full(self, keys: set[str]) -> None:
        """Wait for an executor to take a batch, if every key of ``keys`` still holds a whole
        one (an executor that took one meanwhile notified before this wait began); at most
        FULL_WAIT_S, so work that became ready on other keys meanwhile is read soon."""
        with self.cond:
            if keys.issubset(self.assembler.full_keys()):
                self.cond.wait(FULL_WAIT_S)

    def take_in_read(self, read: ReadOutcome, yield_gil: bool = True) -> None:
        # Nothing known to wait in Redis: an idle executor may reply itself.
        self.caught_up = read.drained or not (read.entries or read.skipped)
        if read.entries:
            entries = [Entry(s, entry_id, f) for s, got in read.entries for entry_id, f in got]
            self.take_in(entries, yield_gil, read.leads)

    def take_in(
        self, entries: list[Entry], yield_gil: bool = True, leads: frozenset[str] = frozenset()
    ) -> None:
        """``leads``: streams read.lua read with a lead, whose batch goes first here too."""
        if not entries:
            return
        decided = self.intake.ingest(entries)
        if decided.dead or decided.splits:
            _write(self.broker, self.intake, decided)
        slices, rows = decided.slices, decided.rows
        if slices and self.serving.cost is not None:  # a moving average of an item's cost
            items = sum(len(piece.items) for _, piece in slices)
            weight = max(sum(piece.weight for _, piece in slices) / max(items, 1), 1e-3)
            self._item_weight = 0.8 * self._item_weight + 0.2 * weight
        now = time.monotonic()
        with self.cond:
            idle = self.assembler.buffered == 0  # an executor may be waiting for this
            self.ledger.hold(slices, rows)
            for key, piece in slices:
                self.assembler.add(key, piece, now, piece.request.stream in leads)
            self.cond.notify_all()
        if rows:  # only now: the replier forgets what it acks, so it must be held first
            self.outbox.put(rows)
        if idle and slices and yield_gil:
            # Let the woken executor have the GIL now: otherwise it waits until this thread
            # blocks in its next read, a few hundred µs of Python later, on the critical
            # path of an idle worker's answer. Reading ahead can wait.
            time.sleep(0)


def _write(broker: Consumer, intake: Intake, decided: Decisions) -> None:
    """Split the reclaimed packs (so that whatever killed their worker is blamed on one request
    each), then write every dead letter in one round trip: before the rows that tell their
    callers go to the replier, which acks them."""
    for entry in decided.splits:
        written = broker.split_pack(intake.keys, entry.stream, entry.entry_id)
        if written < 0:
            decided.dead.append(intake.split_refused(entry))
        else:
            log.warning(
                "serving %s: reclaimed pack %s of %s split into %d entries",
                intake.keys.name,
                entry.entry_id.decode(),
                entry.stream,
                written,
            )
    if decided.dead:
        broker.write_dead_letters(intake.keys, decided.dead)

"""One serving inside one partition: read, assemble, execute, reply, ack.

Threads, so that Redis I/O overlaps the batch function:

    reader     XREADGROUP / reclaim -> Intake -> Assembler (at most one batch beyond those running)
    executors  Assembler -> batch function -> rows (max_concurrent_batches of them, default 1)
    replier    rows -> RPUSH to each caller's inbox + XACK/XDEL, one round trip per batch

Executors never touch Redis, so the device never waits on it; a partition holds at most
max_concurrent_batches running batches plus one batch waiting per batch key, so a crash strands
little and other workers share the load. A pub/sub listener learns of requests cancelled after
they were read.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from . import protocol as P
from .batching import Assembler, Slice, TakenBatch
from .broker import RedisBroker, backoff
from .codec import get_codec
from .errors import RedisUnavailable
from .execute import Row, error_rows, rows_for, run_isolated
from .intake import FORGET_EVERY_S, RECLAIM_EVERY_S, Entry, Intake
from .middleware import Middleware
from .replies import compose
from .runtime_config import apply_overrides, parse_overrides
from .serving import Partition, Serving
from .streaming import BatchContext

log = logging.getLogger(__name__)

Ref = tuple[str, bytes]  # (stream, entry id): entry ids are unique only within one stream

INBOX_TTL_MS = 600_000  # an inbox outlives a client that died by ten minutes at most
KEY_REFRESH_S = 0.5  # how often new batch keys are looked for
CONFIG_EVERY_S = 1.0  # how often run-time option changes are looked for
READ_BLOCK_MS = 100
_EXPIRED = ["Timeout", "the request's deadline passed before its batch ran", "", P.ERR_TIMEOUT]



class ServingRunner:
    """Serves one serving from one partition process."""

    def __init__(
        self,
        serving: Serving,
        broker: RedisBroker,
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
        self.consumer = consumer
        self.partition = partition
        self.intake = Intake(
            serving, get_codec(serving.codec), self.keys, broker, consumer, self.middleware
        )
        self.codec = self.intake.codec
        self.assembler = Assembler(serving.batch_size, serving.batch_timeout)
        self.executors = max_concurrent_batches
        self.cond = threading.Condition()
        self.outbox: queue.SimpleQueue[list[Row] | None] = queue.SimpleQueue()
        self.streams: list[str] = []
        self.held: set[Ref] = set()  # entries read and not yet acked
        self.cancelled: set[Ref] = set()  # held entries whose callers cancelled them
        self.recent_cancels: dict[Ref, float] = {}  # cancels of entries not (yet) held
        self._declared_keys = ("default", *batch_keys)
        self._reading = True
        self._flushing = False  # stopping: run what is buffered without waiting for timeouts
        self.threads: list[threading.Thread] = []
        self._config_seen: dict[str, str] = {}
        self._cancel_listener_failed = False
        self._entry_weight = 1.0  # items (or cost) per entry read, averaged
        self._pubsub: Any = None
        self._pubsub_thread: Any = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._apply_config()
        self.broker.declare(self.keys, self.serving.options())
        self._refresh_streams(set(self._declared_keys))
        self._listen_for_cancels()
        roles = [("reader", self._read_loop), ("replier", self._reply_loop)]
        roles += [(f"executor{i}", self._execute_loop) for i in range(self.executors)]
        for name, target in roles:
            t = threading.Thread(
                target=self._guarded, args=(name, target),
                name=f"queueserve-{self.serving.name}-p{self.partition.index}-{name}",
                daemon=True,
            )
            t.start()
            self.threads.append(t)

    def _guarded(self, name: str, loop: Callable[[], None]) -> None:
        """Run a thread's loop; if it dies of a bug, the partition must not live on half-dead
        (heartbeating while it serves nothing): ``on_fatal`` ends it, and its work is
        reclaimed by others or by its restart."""
        try:
            loop()
        except BaseException:
            log.critical(
                "serving %s partition %d: %s thread died", self.serving.name,
                self.partition.index, name, exc_info=True,
            )
            self.on_fatal()

    def stop_reading(self) -> None:
        with self.cond:
            self._reading = False
            self._flushing = True
            self.cond.notify_all()

    def join(self, timeout: float | None) -> bool:
        """Wait until everything held was executed and answered; False if time ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._pubsub_thread is not None:
            self._pubsub_thread.stop()
        return not any(t.is_alive() for t in self.threads)

    def _listen_for_cancels(self) -> None:
        def on_cancel(message: dict[str, Any]) -> None:
            if self._cancel_listener_failed:
                self._cancel_listener_failed = False
                log.warning("serving %s: cancel listener reconnected", self.serving.name)
            stream, _, entry_id = message["data"].partition(b"\n")
            ref = (stream.decode(), entry_id)
            with self.cond:
                if ref in self.held:
                    self.cancelled.add(ref)
                else:  # maybe read but not yet recorded as held: _take_in looks here
                    now = time.monotonic()
                    self.recent_cancels[ref] = now
                    for old in [r for r, t in self.recent_cancels.items() if t < now - 60]:
                        del self.recent_cancels[old]

        def on_error(e: BaseException, pubsub: Any, thread: Any) -> None:
            if not self._reading:  # closing down: the listener's connection goes with it
                thread.stop()
                return
            log.warning("serving %s: cancel listener: %s; reconnecting", self.serving.name, e)
            time.sleep(0.5)
            self._cancel_listener_failed = True

        self._pubsub = self.broker.redis.pubsub(  # type: ignore[no-untyped-call]
            ignore_subscribe_messages=True
        )
        self._pubsub.subscribe(**{self.keys.cancel: on_cancel})
        self._pubsub_thread = self._pubsub.run_in_thread(
            sleep_time=1.0, daemon=True, exception_handler=on_error
        )

    # -- reader ------------------------------------------------------------------------------
    def _refresh_streams(self, keys: set[str]) -> None:
        known = {self.keys.batch_key_of(s) for s in self.streams}
        for key in sorted(keys - known):
            self.broker.ensure_group(self.keys.stream(key))
            self.streams.append(self.keys.stream(key))
            log.info("serving %s: consuming batch key %r", self.serving.name, key)

    def _read_loop(self) -> None:
        attempt = 0
        now = time.monotonic()
        due = {"keys": 0.0, "reclaim": 0.0, "config": now, "forget": now + FORGET_EVERY_S}
        while self._reading:
            try:
                self._housekeeping(due)
                self._read_once()
                if attempt:
                    log.warning("serving %s: Redis is reachable again", self.serving.name)
                attempt = 0
            except RedisUnavailable as e:
                log.warning("serving %s reader: %s; retrying", self.serving.name, e)
                time.sleep(backoff(attempt))
                attempt += 1
        with self.cond:
            self.cond.notify_all()

    def _housekeeping(self, due: dict[str, float]) -> None:
        now = time.monotonic()
        if now >= due["keys"]:
            self._refresh_streams(self.broker.batch_keys(self.keys))
            due["keys"] = now + KEY_REFRESH_S
        if now >= due["reclaim"]:
            room = self._room()
            if room > 0:
                with self.cond:
                    held = set(self.held)
                self._take_in(self.intake.reclaim(self.streams, room, held))
            due["reclaim"] = now + RECLAIM_EVERY_S
        if now >= due["config"]:
            self._apply_config()
            due["config"] = now + CONFIG_EVERY_S
        if now >= due["forget"]:
            self.intake.forget_dead_consumers(self.streams)
            due["forget"] = now + FORGET_EVERY_S

    def _open_streams(self) -> tuple[list[str], int]:
        """Streams whose batch key holds less than one batch beyond those running, and how
        many entries to read from each (caller holds self.cond). Per key, so that one key's
        waiting items never keep another key's batch from filling."""
        rooms = {s: self.assembler.room(self.keys.batch_key_of(s)) for s in self.streams}
        open_streams = [s for s, room in rooms.items() if room > 0]
        # COUNT is in entries, room in items (or cost): divide by what an entry usually weighs,
        # or a stream of 256-item requests would be read many batches ahead.
        room = max(rooms.values(), default=0.0)
        return open_streams, max(1, int(room / self._entry_weight))

    def _apply_config(self) -> None:
        """Pick up options changed with `queueserve config set`."""
        raw = self.broker.config(self.keys)
        if raw == self._config_seen:
            return
        self._config_seen = raw
        with self.cond:
            changed = apply_overrides(self.serving, parse_overrides(raw))
            self.assembler.capacity = self.serving.batch_size
            self.assembler.timeout = self.serving.batch_timeout
            self.cond.notify_all()
        for name, (old, new) in changed.items():
            log.warning("serving %s: %s changed from %s to %s", self.serving.name, name, old, new)

    def _room(self) -> int:
        with self.cond:
            streams, count = self._open_streams()
        return count if streams else 0

    def _read_once(self) -> None:
        with self.cond:
            streams, count = self._open_streams()
            while self._reading and not streams:
                self.cond.wait(RECLAIM_EVERY_S)
                streams, count = self._open_streams()
        if not self._reading:
            return
        read = self.broker.read(self.consumer, streams, count, READ_BLOCK_MS)
        self._take_in([
            Entry(stream.decode(), entry_id, fields)
            for stream, entries in read
            for entry_id, fields in entries
        ])

    def _take_in(self, entries: list[Entry]) -> None:
        if not entries:
            return
        slices, rows = self.intake.ingest(entries)
        if slices:  # a moving average of what one entry weighs
            weight = sum(piece.weight for _, piece in slices) / len(entries)
            self._entry_weight = 0.8 * self._entry_weight + 0.2 * max(weight, 1e-3)
        now = time.monotonic()
        with self.cond:
            # Every request taken in, also those answered only with errors: held until acked.
            self.held.update(piece.request.ref for _, piece in slices)
            self.held.update(row[0].ref for row in rows)
            if self.recent_cancels:
                self.cancelled.update(self.held.intersection(self.recent_cancels))
            for key, piece in slices:
                self.assembler.add(key, piece, now)
            self.cond.notify_all()
        if rows:  # only now: the replier forgets what it acks, so it must be held first
            self.outbox.put(rows)

    # -- executor ----------------------------------------------------------------------------
    def _next_batch(self) -> tuple[TakenBatch, list[Slice]] | None:
        with self.cond:
            while True:
                now = time.monotonic()
                chosen, wait = self.assembler.pick(now, flush=self._flushing)
                if chosen is not None:
                    batch = self.assembler.take(chosen, now)
                    self.cond.notify_all()  # room for the reader
                    return batch, self._withdraw_cancelled(batch)
                if not self._reading and self.assembler.buffered == 0:
                    return None
                self.cond.wait(wait)

    def _withdraw_cancelled(self, batch: TakenBatch) -> list[Slice]:
        """Remove slices whose callers cancelled (caller holds self.cond); returns them."""
        if not self.cancelled:
            return []
        dropped = [s for s in batch.slices if s.request.ref in self.cancelled]
        if dropped:
            batch.slices = [s for s in batch.slices if s.request.ref not in self.cancelled]
        return dropped

    def _execute_loop(self) -> None:
        try:
            while (taken := self._next_batch()) is not None:
                batch, dropped = taken
                rows = [(s.request, s.offset, len(s.items), P.DROP, None) for s in dropped]
                self.outbox.put(rows + self._execute(batch))
        finally:
            self.outbox.put(None)

    def _execute(self, batch: TakenBatch) -> list[Row]:
        now = time.time()
        live: list[Slice] = []
        expired: list[Slice] = []
        for s in batch.slices:
            (expired if s.request.deadline and s.request.deadline <= now else live).append(s)
        rows = error_rows(expired, _EXPIRED) if expired else []
        if not live:
            return rows
        batch.slices = live
        items = batch.items()
        if live[0].request.alone:  # redelivered: this run is what max_deliveries counts
            request = live[0].request
            try:
                self.broker.count_delivery(request.stream, self.consumer, request.entry_id)
            except RedisUnavailable as e:
                log.warning("serving %s: could not count a redelivery: %s", self.serving.name, e)
        self.middleware.batch_started(
            self.serving, batch.key, self.partition, len(items), time.monotonic() - batch.opened
        )
        started = time.perf_counter()
        context = BatchContext(
            self.serving.hooks, live, self.outbox.put, self.cancelled, self.serving.name
        )
        with context:
            segments = run_isolated(
                self.serving, items, batch.key, self.partition, context.drive
            )
        took = time.perf_counter() - started
        self.middleware.batch_finished(self.serving, batch.key, self.partition, len(items), took)
        log.debug(
            "serving %s key %s partition %d: batch of %d items (%d requests) in %.2f ms",
            self.serving.name, batch.key, self.partition.index, len(items), len(live),
            took * 1000,
        )
        if context.finished:  # answered mid-batch by a generator's per-item END
            return rows + [r for r in rows_for(live, segments) if id(r[0]) not in context.finished]
        return rows + rows_for(live, segments)

    # -- replier -----------------------------------------------------------------------------
    def _reply_loop(self) -> None:
        executors_left = self.executors  # each executor ends the outbox with None
        while executors_left:
            rows: list[Row] = []
            item = self.outbox.get()
            # Coalesce whatever else is ready into the same round trip.
            while True:
                if item is None:
                    executors_left -= 1
                else:
                    rows += item
                try:
                    item = self.outbox.get_nowait()
                except queue.Empty:
                    break
            if rows:
                self._send(rows)

    def _send(self, rows: list[Row]) -> None:
        out = compose(rows, self.codec)
        attempt = 0
        while True:
            try:
                self.broker.reply_and_ack(
                    self.keys, out.messages, out.acks, INBOX_TTL_MS, out.events
                )
                if attempt:
                    log.warning("serving %s replier: Redis is reachable again", self.serving.name)
                break
            except RedisUnavailable as e:
                # Unacked work stays ours (our heartbeat holds it); retry until Redis is back.
                log.warning("serving %s replier: %s; retrying", self.serving.name, e)
                time.sleep(backoff(attempt))
                attempt += 1
        self.middleware.replied(self.serving, out.answered, len(out.finished), out.errors)
        with self.cond:
            self.held.difference_update(out.finished)
            if self.cancelled:
                self.cancelled.difference_update(out.finished)

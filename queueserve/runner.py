"""One serving inside one partition: read, assemble, execute, reply, ack.

Threads, so that Redis I/O overlaps the batch function:

    reader     XREADGROUP -> decode -> Assembler (holds at most one batch beyond those running)
    executors  Assembler -> batch function -> rows (max_concurrent_batches of them, default 1)
    replier    rows -> RPUSH to each caller's inbox + XACK/XDEL, one round trip per batch

Executors never touch Redis, so the device never waits on it; a partition holds at most
max_concurrent_batches running batches plus one prefetched, so a crash strands little and other
workers share the load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from typing import Any

from . import protocol as P
from ._calls import error_to_wire
from .batching import Assembler, TakenBatch
from .broker import RedisBroker, StreamEntries
from .codec import get_codec
from .decode import Accepted, Rejected, decode_entry
from .errors import RedisUnavailable
from .execute import Row, error_rows, rows_for, run_isolated
from .serving import Partition, Serving

log = logging.getLogger(__name__)

INBOX_TTL_MS = 600_000  # an inbox outlives a client that died by ten minutes at most
KEY_REFRESH_S = 0.5  # how often new batch keys are looked for
READ_BLOCK_MS = 100


def _backoff(attempt: int) -> float:
    return float(min(0.05 * 2**attempt, 2.0))


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
    ) -> None:
        self.serving = serving
        self.broker = broker
        self.keys = P.Keys(prefix, serving.name)
        self.codec = get_codec(serving.codec)
        self.consumer = consumer
        self.partition = partition
        self.assembler = Assembler(serving.batch_size, serving.batch_timeout)
        self.executors = max_concurrent_batches
        self.prefetch_limit = serving.batch_size  # items held beyond the running batches
        self.cond = threading.Condition()
        self.outbox: queue.SimpleQueue[list[Row] | None] = queue.SimpleQueue()
        self.streams: list[str] = []
        self._declared_keys = ("default", *batch_keys)
        self._reading = True
        self._flushing = False  # stopping: run what is buffered without waiting for timeouts
        self._threads: list[threading.Thread] = []
        self.batches_run = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.broker.declare(self.keys, self.serving.options())
        self._refresh_streams(set(self._declared_keys))
        roles = [("reader", self._read_loop), ("replier", self._reply_loop)]
        roles += [(f"executor{i}", self._execute_loop) for i in range(self.executors)]
        for name, target in roles:
            t = threading.Thread(
                target=target,
                name=f"queueserve-{self.serving.name}-p{self.partition.index}-{name}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def stop_reading(self) -> None:
        with self.cond:
            self._reading = False
            self._flushing = True
            self.cond.notify_all()

    def join(self, timeout: float | None) -> bool:
        """Wait until everything held was executed and answered; False if time ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    # -- reader ------------------------------------------------------------------------------
    def _refresh_streams(self, keys: set[str]) -> None:
        known = {self.keys.batch_key_of(s) for s in self.streams}
        for key in sorted(keys - known):
            self.broker.ensure_group(self.keys.stream(key))
            self.streams.append(self.keys.stream(key))
            log.info("serving %s: consuming batch key %r", self.serving.name, key)

    def _read_loop(self) -> None:
        attempt = 0
        next_refresh = 0.0
        while self._reading:
            try:
                if time.monotonic() >= next_refresh:
                    self._refresh_streams(self.broker.batch_keys(self.keys))
                    next_refresh = time.monotonic() + KEY_REFRESH_S
                self._read_once()
                if attempt:
                    log.warning("serving %s: Redis is reachable again", self.serving.name)
                attempt = 0
            except RedisUnavailable as e:
                log.warning("serving %s reader: %s; retrying", self.serving.name, e)
                time.sleep(_backoff(attempt))
                attempt += 1
        with self.cond:
            self.cond.notify_all()

    def _read_once(self) -> None:
        with self.cond:
            while self._reading and self.assembler.buffered >= self.prefetch_limit:
                self.cond.wait()
            room = self.prefetch_limit - self.assembler.buffered
        if not self._reading:
            return
        entries = self.broker.read(self.consumer, self.streams, room, READ_BLOCK_MS)
        if not entries:
            return
        accepted, rejected = self._decode(entries)
        if rejected:
            self.outbox.put(rejected)
        now = time.monotonic()
        with self.cond:
            for key, decoded in accepted:
                for piece in decoded.slices:
                    self.assembler.add(key, piece, now)
            self.cond.notify_all()

    def _decode(
        self, entries: list[tuple[bytes, StreamEntries]]
    ) -> tuple[list[tuple[str, Accepted]], list[Row]]:
        rejected: list[Row] = []
        accepted: list[tuple[str, Accepted]] = []
        for stream_b, stream_entries in entries:
            stream = stream_b.decode()
            key = self.keys.batch_key_of(stream)
            for entry_id, fields in stream_entries:
                decoded = decode_entry(self.serving, self.codec, stream, entry_id, fields)
                if isinstance(decoded, Rejected):
                    self._reject(decoded, rejected)
                    continue
                accepted.append((key, decoded))
                for offset, reason in decoded.rejected_items:
                    rejected.append(
                        (decoded.request, offset, 1, P.ERROR,
                         error_to_wire(ValueError(reason), P.ERR_BAD_REQUEST))
                    )
        return accepted, rejected

    def _reject(self, rejected: Rejected, rows: list[Row]) -> None:
        log.warning(
            "serving %s: entry %s of %s rejected: %s",
            self.serving.name, rejected.entry_id.decode(), rejected.stream, rejected.reason,
        )
        request = rejected.request
        if request is None:
            self.broker.dead_letter(self.keys, rejected.stream, rejected.entry_id, rejected.reason)
            return
        body = ["BadRequest", rejected.reason, "", rejected.kind]
        rows.append((request, 0, request.n, P.ERROR, body))

    # -- executor ----------------------------------------------------------------------------
    def _next_batch(self) -> TakenBatch | None:
        with self.cond:
            while True:
                now = time.monotonic()
                chosen, wait = self.assembler.pick(now, flush=self._flushing)
                if chosen is not None:
                    batch = self.assembler.take(chosen, now)
                    self.cond.notify_all()  # room for the reader
                    return batch
                if not self._reading and self.assembler.buffered == 0:
                    return None
                self.cond.wait(wait)

    def _execute_loop(self) -> None:
        try:
            while (batch := self._next_batch()) is not None:
                self.outbox.put(self._execute(batch))
        finally:
            self.outbox.put(None)

    def _execute(self, batch: TakenBatch) -> list[Row]:
        now = time.time()
        live = [s for s in batch.slices if not (s.request.deadline and s.request.deadline <= now)]
        rows: list[Row] = []
        if len(live) != len(batch.slices):
            expired = [s for s in batch.slices if s not in live]
            rows += error_rows(
                expired,
                ["Timeout", "the request's deadline passed before its batch ran", "",
                 P.ERR_TIMEOUT],
            )
        if not live:
            return rows
        items = live[0].items if len(live) == 1 else [x for s in live for x in s.items]
        started = time.perf_counter()
        segments = run_isolated(self.serving, items, batch.key, self.partition)
        self.batches_run += 1
        log.debug(
            "serving %s key %s partition %d: batch of %d items (%d requests) in %.2f ms",
            self.serving.name, batch.key, self.partition.index, len(items), len(live),
            (time.perf_counter() - started) * 1000,
        )
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
        messages: dict[str, list[list[Any]]] = defaultdict(list)
        acks: dict[str, list[Any]] = defaultdict(list)
        for request, offset, count, kind, body in rows:
            messages[request.reply_to].append([request.rid, offset, count, kind, body])
            request.remaining -= count
            if request.remaining <= 0:
                acks[request.stream] += (request.entry_id, request.n)
        tag = bytes((self.codec.tag,))
        encoded = {inbox: [tag + self.codec.dumps(m)] for inbox, m in messages.items()}
        attempt = 0
        while True:
            try:
                self.broker.reply_and_ack(self.keys, encoded, acks, INBOX_TTL_MS)
                return
            except RedisUnavailable as e:
                # Not acked, so another worker could redo it; retry so callers get answers soon.
                log.warning("serving %s replier: %s; retrying", self.serving.name, e)
                time.sleep(_backoff(attempt))
                attempt += 1
                if attempt > 30:
                    log.error(
                        "serving %s: giving up on %d replies; the requests stay pending and "
                        "will be redelivered", self.serving.name, len(rows),
                    )
                    return

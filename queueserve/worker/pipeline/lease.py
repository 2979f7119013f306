"""The read lease: an idle worker's blocking read is done by the thread that will run what it
brings, not by the reader.

A reader that drained its shard would next block on the wake stream until work comes. An idle
executor (or preparer) takes that read instead (``borrow``, then ``read_lent``), so what it
brings runs on the thread that read it: one thread hand-off less on an idle worker's round
trip. While a taker holds it, the reader waits (``reader_waits``); when the read comes back
and the executor is busy with what it brought, the reader leaves it free for LEND_WAIT_S (the
executor usually finishes a small batch sooner, and takes it again) and then blocks itself, so
that work arriving during a long batch is read ahead of it. An executor that sends its own
reply may send the lent read behind it, in the same write (runner.py, ``_send``).

One shard only: a taker blocks on one shard's wake stream. Its state is guarded by the
ledger's cond, like everything the pipeline's threads share.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

from queueserve.broker.consumer import Consumer
from queueserve.broker.reads import PendingRead, ReadOutcome, WakeRead
from queueserve.broker.retry import RedisFailure
from queueserve.wire.keys import Keys
from queueserve.wire.timing import RECLAIM_EVERY_S
from queueserve.worker.pipeline.batching import Assembler
from queueserve.worker.stepping.joins import StepQueue

READ_BLOCK_MS = 100  # longest wait on the wake stream when nothing is ready
# How long a drained reader keeps its blocking read for a busy executor to come back idle and
# take it (see reader_waits), before blocking itself so that arrivals are read ahead.
LEND_WAIT_S = 0.002


class ReadLease:
    """The blocking read of each shard that drained (its wake id), and who holds shard 0's."""

    def __init__(
        self,
        cond: threading.Condition,
        assembler: Assembler | StepQueue,
        broker: Consumer,
        keys: Keys,
        consumer: str,
        *,
        lends: bool,
        reading: Callable[[], bool],
        room: Callable[[], tuple[int, int, int]],
        take_in: Callable[[ReadOutcome, bool], None],
        batch_s: Callable[[], float],
    ) -> None:
        self.cond = cond
        self.assembler = assembler
        self.broker = broker
        self.keys = keys
        self.consumer = consumer
        self.lends = lends  # whether idle executors take shard 0's read
        self._reading = reading  # False once the partition stops: no read starts after
        # (items to read, per key, ms a priority level is worth) now, as the reader would
        # (caller holds cond)
        self._room = room
        self._take_in = take_in  # the reader's: what a lent read brings goes where its reads go
        self._batch_s = batch_s  # how long batches take now (the executors' moving average)
        self.drained_at: dict[int, bytes] = {}  # per shard: wake id of a read that left nothing
        self.borrowed = False  # a taker holds the blocking read (shard 0's wake id)
        self.borrowed_at = 0.0  # when it was taken (unix time): it delivers after that
        self.lent_since = 0.0  # when the blocking read became free to take
        self.reader_wake = threading.Event()  # a waiting reader should look again

    def drained(self, shard: int, wake_id: bytes) -> None:
        """A read of ``shard`` left nothing unread: the next one blocks after ``wake_id``, and
        may be lent (caller holds cond)."""
        self.drained_at[shard] = wake_id
        self.lent_since = time.monotonic()

    def reader_waits(self) -> bool:
        """The reader's side of lending its blocking read; True when it must not read now."""
        self.reader_wake.clear()  # before looking: a wake-up from now on is not missed
        with self.cond:
            if not self.borrowed and (
                0 not in self.drained_at
                or not self._reading()
                or time.monotonic() - self.lent_since >= LEND_WAIT_S
            ):
                return False
            wait = RECLAIM_EVERY_S if self.borrowed else LEND_WAIT_S
        self.reader_wake.wait(wait)
        return True

    def borrow(self) -> bytes | None:
        """Take the reader's blocking read, if it is free and nothing waits in the assembler
        (whose batch timeout a read blocking up to READ_BLOCK_MS could overrun); the caller
        holds cond and then calls ``read_lent``."""
        if not self.lends or self.borrowed or self.assembler.buffered or not self._reading():
            return None
        wake_id = self.drained_at.pop(0, None)
        self.borrowed = wake_id is not None
        self.borrowed_at = time.time()
        return wake_id

    def taken_since(self) -> float | None:
        """When the read lent out now was taken (unix time), None when none is: what it
        delivered is not held until its taker took it in, however long that takes (caller
        holds cond)."""
        return self.borrowed_at if self.borrowed else None

    def wake_read(self, wake_id: bytes) -> WakeRead:
        """A lent blocking read after ``wake_id`` (caller holds cond)."""
        # Not reserved against the reader's reclaims: this read may block for READ_BLOCK_MS
        # at a time, again and again on an idle worker, and reclaims would find no room for
        # ever. A reclaim meanwhile (dead consumers' work, rare) may bring one look-ahead more.
        budget, per_key, age_ms = self._room()
        marks = self.assembler.read_marks()
        return WakeRead(wake_id, READ_BLOCK_MS, self.consumer, budget, per_key, marks, age_ms)

    def give_back(self, wake_id: bytes) -> None:
        """Give back a borrowed read that was never sent, as it was."""
        with self.cond:
            self.borrowed = False
            if self._reading():
                self.drained_at[0] = wake_id
            self.cond.notify_all()

    def read_lent(self, lent: bytes | PendingRead) -> None:
        """Block on the wake stream and read, as the reader would, from the thread that will
        run what comes (or finish such a read sent behind a reply); give the read back to the
        reader drained, or wake it to read on."""
        if isinstance(lent, PendingRead):
            read_now = lent.result
        else:
            with self.cond:
                wake_read = self.wake_read(lent)
            read_now = functools.partial(self.broker.wait_then_read, self.keys, wake_read)
        drained_at = None
        try:
            read = read_now()
            self._take_in(read, False)
            if read.drained or not (read.entries or read.skipped):
                drained_at = read.wake_id
        except RedisFailure:
            pass  # the reader reads next: its retries ride the outage out
        finally:
            with self.cond:
                self.borrowed = False
                if drained_at is not None and self._reading():
                    self.drained(0, drained_at)
                self.cond.notify_all()
            # Work left in Redis, or batches long enough that work arriving meanwhile should be
            # read ahead of them: the reader reads next. Otherwise this thread is back before
            # LEND_WAIT_S and takes the read again, and waking the reader would only cost CPU.
            if drained_at is None or self._batch_s() >= LEND_WAIT_S:
                self.reader_wake.set()

"""Reading a new key while the look-ahead is full.

A key that becomes ready is read before every key that had its turn (read.lua's lead), and its
batch goes before the batches the worker holds (``Assembler.add``). But a full look-ahead stops
the reader until an executor takes a batch, and the executor takes one of the held batches
first: a quiet key arriving behind keys with whole batches waiting would wait for one of them.
So while the look-ahead is full, the reader blocks on the wake stream instead, for half a
batch's time at most, and reads new keys only (read.lua's '+' mark): one batch of them over
the look-ahead. The executors never starve meanwhile: a full look-ahead holds a batch more
than they take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from queueserve.broker.consumer import Consumer
from queueserve.broker.reads import ReadOutcome, WakeRead
from queueserve.wire import protocol as P
from queueserve.worker.pipeline.lease import READ_BLOCK_MS

# Batches quicker than this turn the look-ahead over before a wake read would help; the
# reader then waits for room as it always did.
MIN_BATCH_S = 0.002


class NewKeyWatch:
    def __init__(self, broker: Consumer, consumer: str, batch_s: Callable[[], float]) -> None:
        self.broker = broker
        self.consumer = consumer
        self._batch_s = batch_s  # how long batches take now (the executors' moving average)
        self.seen: dict[int, bytes] = {}  # per shard: the wake id its last read returned

    def block_ms(self, keys: P.Keys) -> int:
        """How long a watch of ``keys``'s shard may block: 0 when there is no watch to make
        (batches too quick, or no read of the shard yet to wait after)."""
        batch_s = self._batch_s()
        if batch_s < MIN_BATCH_S or keys.shard not in self.seen:
            return 0
        return max(1, min(READ_BLOCK_MS, int(batch_s * 500)))

    def read(
        self, keys: P.Keys, block_ms: int, per_key: int, marks: Sequence[str], age_ms: int
    ) -> ReadOutcome:
        after = self.seen[keys.shard]
        watch = WakeRead(after, block_ms, self.consumer, per_key, per_key, [*marks, "+"], age_ms)
        read = self.broker.wait_then_read(keys, watch)
        self.seen[keys.shard] = read.wake_id
        return read

"""Reading a quiet key while the look-ahead is full.

A quiet key that becomes ready takes a lead: read.lua reads it before the
keys taking turns, and its batch goes before the batches the worker holds (``Assembler.add``).
But a full look-ahead stops the reader until an executor takes a batch, and the executor takes
one of the held batches first: the quiet key would wait for one of them. So while the
look-ahead is full, the reader blocks on the wake stream instead, for half a batch's time at
most, and reads leading keys only (read.lua's '+' mark): one batch of them over the
look-ahead. The executors do not starve meanwhile while batches take about as long as the
moving average says: a full look-ahead holds a batch more than they take. Only servings of one
shard watch (a reader of several shards waits for room as before), and not step servings,
whose requests join in arrival order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from queueserve.broker.consumer import Consumer
from queueserve.broker.reads import ReadOutcome, WakeRead
from queueserve.wire.keys import Keys
from queueserve.worker.pipeline.batching import Assembler
from queueserve.worker.pipeline.lease import READ_BLOCK_MS
from queueserve.worker.stepping.joins import StepQueue

# Batches quicker than this turn the look-ahead over before a wake read would help; the
# reader then waits for room as it always did.
MIN_BATCH_S = 0.002


class QuietKeyWatch:
    def __init__(
        self,
        broker: Consumer,
        consumer: str,
        batch_s: Callable[[], float],
        assembler: Assembler | StepQueue,
        executors: int,
    ) -> None:
        self.broker = broker
        self.consumer = consumer
        self._batch_s = batch_s  # how long batches take now (the executors' moving average)
        self._assembler = assembler
        self._executors = executors
        self.seen: dict[int, bytes] = {}  # per shard: the wake id its last read returned

    def block_ms(self, keys: Keys) -> int:
        """How long a watch of ``keys``'s shard may block (caller holds cond): 0 when there is
        no watch to make (batches too quick, no read of the shard yet to wait after, or a
        watch's batch over the look-ahead waiting already)."""
        batch_s = self._batch_s()
        assembler = self._assembler
        if (
            not isinstance(assembler, Assembler)  # steps join in arrival order: no lead there
            or batch_s < MIN_BATCH_S
            or keys.shard not in self.seen
            or assembler.look_ahead() > assembler.capacity * (self._executors + 1)
        ):
            return 0
        return max(1, min(READ_BLOCK_MS, int(batch_s * 500)))

    def read(
        self, keys: Keys, block_ms: int, per_key: int, marks: Sequence[str], age_ms: int
    ) -> ReadOutcome:
        after = self.seen[keys.shard]
        watch = WakeRead(after, block_ms, self.consumer, per_key, per_key, [*marks, "+"], age_ms)
        read = self.broker.wait_then_read(keys, watch)
        self.seen[keys.shard] = read.wake_id
        return read

"""A serving with a preparation stage, for the SIGTERM test of ``tests/test_prepare_stage.py``
(``queueserve worker tests.support.prepare_app:staged``).

It records into the test's Redis (``$QS_TEST_PREFIX:fault:*`` on ``$QS_TEST_URL``, as
``tests/fault_app.py`` does): each item prepared (``prepared``) and run (``exec``). The device
holds its first batch until the test sets ``go``. Every SIGTERM the partition receives is
recorded (``sigterm``) before the worker's own handler runs, so the test knows the partition is
draining before it lets the device go on.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import queueserve as qs

from .fault_app import _connect, wait_for_key


class Staged(qs.Serving):
    name = "staged"
    batch_size = 1
    batch_timeout = 0.0
    prepare_concurrency = 2

    def setup(self, partition: qs.Partition) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def record(signum: int, frame: FrameType | None) -> None:
            r, rec = _connect()
            r.rpush(f"{rec}:sigterm", 1)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, record)

    def prepare_batch(self, batch: qs.Batch) -> list[int]:
        r, rec = _connect()
        r.rpush(f"{rec}:prepared", *batch)
        return [2 * x for x in batch]

    def handle_batch(self, batch: qs.Batch) -> Any:
        r, rec = _connect()
        r.rpush(f"{rec}:exec", *batch)
        wait_for_key(r, f"{rec}:go")
        return batch.prepared


staged = Staged()

"""A serving with a fixed preparation time and a fixed device time, for ``bench/pipeline.py``.

``QS_BENCH_P`` and ``QS_BENCH_T`` (seconds) are the preparation and device times per batch,
``QS_BENCH_PREP`` the preparation pool's size and ``QS_BENCH_BATCH`` the batch size; all read
when the worker imports this module. Both stages sleep, which releases the GIL as tokenizers and
numpy do: the question is whether the stages overlap, not what the CPU can do.
"""

from __future__ import annotations

import os
import time
from typing import Any

import queueserve as qs

P = float(os.environ.get("QS_BENCH_P", "0.01"))
T = float(os.environ.get("QS_BENCH_T", "0.02"))
PREP = int(os.environ.get("QS_BENCH_PREP", "1"))
BATCH = int(os.environ.get("QS_BENCH_BATCH", "64"))


class Staged(qs.Serving):
    name = "staged"
    batch_size = BATCH
    batch_timeout = 0.0
    prepare_concurrency = PREP

    def prepare_batch(self, batch: qs.Batch) -> list[Any]:
        time.sleep(P)  # tokenize, collate, pin, copy
        return list(batch)

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        time.sleep(T)  # the device
        return batch.prepared

"""The embeddings serving as ``bench/model.py`` serves it: one batch key, a fixed thread count.

``QS_BENCH_THREADS`` is the partition's torch thread count (the direct loop it is compared with
uses the same) and ``QS_BENCH_BATCH`` the batch size; both are read when the worker imports this
module. Each batch adds its compute time and size to ``bench:model:*`` keys in
``QS_BENCH_URL``'s Redis, so the benchmark can tell a slow model from an idle one.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import queueserve as qs
from tasks.embed import Embed

THREADS = int(os.environ.get("QS_BENCH_THREADS", "1"))
BATCH = int(os.environ.get("QS_BENCH_BATCH", "32"))


class BenchEmbed(Embed):
    name = "embed_bench"
    batch_size = BATCH
    batch_timeout = 0.0

    def __init__(self, **options: Any) -> None:
        super().__init__(buckets=False, **options)

    def setup(self, partition: qs.Partition) -> None:
        import redis

        super().setup(partition)
        self.torch.set_num_threads(THREADS)
        self.redis = redis.Redis.from_url(os.environ["QS_BENCH_URL"])

    def handle_batch(self, batch: qs.Batch) -> np.ndarray:
        started = time.perf_counter()
        out = self.embed_texts(batch)
        took = time.perf_counter() - started
        pipe = self.redis.pipeline(transaction=False)
        pipe.incrbyfloat("bench:model:busy", took)
        pipe.incr("bench:model:batches")
        pipe.incrby("bench:model:items", len(batch))
        pipe.execute()
        return out

"""The embeddings serving as ``bench/model.py`` serves it: one batch key, a fixed thread count.

``QS_BENCH_THREADS`` is the partition's torch thread count (the direct loop it is compared with
uses the same), ``QS_BENCH_BATCH`` the batch size and ``QS_BENCH_DTYPE`` the model's dtype on
CUDA (float32 unless set); all are read when the worker imports this module. Each batch adds its
device-stage time (``handle_batch``: tokenizing runs before it, in the preparation stage) and
size to ``bench:model:*`` keys in ``QS_BENCH_URL``'s Redis, so the benchmark can tell a slow
model from an idle one.
"""

from __future__ import annotations

import os
import time
from typing import Any

import queueserve as qs
from tasks.embed import Embed

THREADS = int(os.environ.get("QS_BENCH_THREADS", "1"))
BATCH = int(os.environ.get("QS_BENCH_BATCH", "32"))
DTYPE = os.environ.get("QS_BENCH_DTYPE", "float32")


class BenchEmbed(Embed):
    name = "embed_bench"
    batch_size = BATCH
    batch_timeout = 0.0

    def __init__(self, **options: Any) -> None:
        options.setdefault("dtype", DTYPE)
        super().__init__(buckets=False, **options)

    def setup(self, partition: qs.Partition) -> None:
        import redis

        super().setup(partition)
        self.torch.set_num_threads(THREADS)
        self.redis = redis.Redis.from_url(os.environ["QS_BENCH_URL"])

    def handle_batch(self, batch: qs.Batch) -> Any:
        started = time.perf_counter()
        out = super().handle_batch(batch)
        took = time.perf_counter() - started
        pipe = self.redis.pipeline(transaction=False)
        pipe.incrbyfloat("bench:model:busy", took)
        pipe.incr("bench:model:batches")
        pipe.incrby("bench:model:items", len(batch))
        pipe.execute()
        return out

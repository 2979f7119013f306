"""The servings bench/models.py runs (``queueserve worker bench.models_servings:NAME``): a model
per batch key, whose load takes LOAD_S and whose batch takes BATCH_S of (simulated) device
time, so the figures are the scheduling's on any machine. Each records into the bench's Redis
(``$QS_BENCH_URL``): every load (``models:loads``) and every batch's key with its partition
process (``models:batches``, in the order each partition ran them)."""

from __future__ import annotations

import os
import time
from typing import Any

import redis

import queueserve as qs

LOAD_S = 0.05  # a model's load (an adapter read and moved to the device)
BATCH_S = 0.01  # one batch on the device
BATCH_SIZE = 8
CACHE = 4  # models one partition holds
# Loads at once per partition, in its preparation stage, while the device runs other keys'
# batches (prepare_concurrency): what a serving whose loads cost 5 batches would set
PREPARERS = 3
STATIC_PARTITIONS = 4  # static0..static3: one partition each, keys assigned by index

_REDIS: redis.Redis | None = None


def _record(key: str, value: str) -> None:
    global _REDIS
    if _REDIS is None:
        _REDIS = redis.Redis.from_url(os.environ["QS_BENCH_URL"])
    _REDIS.rpush(key, value)


class Cached(qs.Serving):
    """The feature: an LRU of CACHE models per partition, reads that follow what is loaded."""

    name = "cached"
    batch_size = BATCH_SIZE
    batch_timeout = 0.002
    max_loaded_keys = CACHE
    prepare_concurrency = PREPARERS

    def load_key(self, key: str) -> str:
        _record("models:loads", f"{os.getpid()}:{key}")
        time.sleep(LOAD_S)
        return f"model-{key}"

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        _record("models:batches", f"{os.getpid()}:{batch.key}")
        time.sleep(BATCH_S)
        return [f"{batch.state}:{x}" for x in batch]


class PerBatch(qs.Serving):
    """(a) The model loaded for every batch (no cache)."""

    name = "per_batch"
    batch_size = BATCH_SIZE
    batch_timeout = 0.002

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        _record("models:loads", f"{os.getpid()}:{batch.key}")
        _record("models:batches", f"{os.getpid()}:{batch.key}")
        time.sleep(LOAD_S + BATCH_S)
        return [f"model-{batch.key}:{x}" for x in batch]


class Ideal(qs.Serving):
    """Every model preloaded (where memory allows): the batches' device time alone."""

    name = "ideal"
    batch_size = BATCH_SIZE
    batch_timeout = 0.002

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        _record("models:batches", f"{os.getpid()}:{batch.key}")
        time.sleep(BATCH_S)
        return [f"model-{batch.key}:{x}" for x in batch]


cached, per_batch, ideal = Cached(), PerBatch(), Ideal()
# (b) a static assignment: key i is served by serving static<i % partitions> alone, one
# partition each, with the same cache
static0, static1, static2, static3 = (
    type(f"Static{i}", (Cached,), {"name": f"static{i}"})() for i in range(STATIC_PARTITIONS)
)

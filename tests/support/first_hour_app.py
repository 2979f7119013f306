"""Servings for tests/test_first_hour.py, loaded by worker processes as
``tests.first_hour_app:NAME``. Nothing here imports torch, so workers start fast."""

from __future__ import annotations

import os
from typing import Any

import redis

import queueserve as qs

GATE_TIMEOUT_S = 30


class Broken(qs.Serving):
    """A serving whose setup() fails, as a missing model file would make it."""

    name = "broken"

    def setup(self, partition: qs.Partition) -> None:
        raise FileNotFoundError("model file /models/missing.bin not found")

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        return list(batch)


class Held(qs.Serving):
    """A batch that SETs ``{prefix}:started`` and blocks until the list ``{prefix}:go`` gets a
    value; the URL and prefix come from FIRST_HOUR_REDIS_URL / FIRST_HOUR_PREFIX."""

    name = "held"
    batch_size = 8
    batch_timeout = 0.0

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        prefix = os.environ["FIRST_HOUR_PREFIX"]
        client = redis.Redis.from_url(os.environ["FIRST_HOUR_REDIS_URL"])
        try:
            client.set(f"{prefix}:started", len(batch), ex=120)
            if client.blpop([f"{prefix}:go"], timeout=GATE_TIMEOUT_S) is None:
                raise TimeoutError("the test never said go")
        finally:
            client.close()
        return list(batch)

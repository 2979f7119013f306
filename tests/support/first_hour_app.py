"""Servings for tests/test_first_hour.py, loaded by worker processes as
``tests.first_hour_app:NAME``. Nothing here imports torch, so workers start fast."""

from __future__ import annotations

import os
from typing import Any

import redis

import queueserve as qs
from tests.support.cli_app import wait_for_go


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
        url = os.environ["FIRST_HOUR_REDIS_URL"]
        client = redis.Redis.from_url(url)
        try:
            client.set(f"{prefix}:started", len(batch), ex=120)
        finally:
            client.close()
        wait_for_go(url, f"{prefix}:go")
        return list(batch)

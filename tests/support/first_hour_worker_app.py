"""Servings for tests/integration/test_first_hour_worker.py, loaded by worker processes as
``tests.support.first_hour_worker_app:NAME``. Nothing here imports torch, so workers start fast."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import queueserve as qs

MISSING_MODEL = "model file /models/missing.bin not found"


def _square(xs: list[int]) -> list[int]:
    return [x * x for x in xs]


square = qs.Serving(_square, name="square", batch_size=10, batch_timeout=0.1)


class Unloadable(qs.Serving):
    """A serving whose setup() always fails, as a missing model file makes it."""

    name = "unloadable"

    def setup(self, partition: qs.Partition) -> None:
        raise FileNotFoundError(MISSING_MODEL)

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        return list(batch)


class Fragile(qs.Serving):
    """A serving whose setup() succeeds once, and fails in every partition started after it
    (its model was deleted meanwhile): the file FIRST_HOUR_SETUP_MARK says it ran."""

    name = "fragile"
    batch_timeout = 0.0

    def setup(self, partition: qs.Partition) -> None:
        mark = Path(os.environ["FIRST_HOUR_SETUP_MARK"])
        if mark.exists():
            raise FileNotFoundError(MISSING_MODEL)
        mark.write_text("set up once")

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        return list(batch)

"""Servings for tests/integration/test_first_hour_worker.py, loaded by worker processes as
``tests.support.first_hour_worker_app:NAME``. Nothing here imports torch, so workers start fast."""

from __future__ import annotations

import queueserve as qs


def _square(xs: list[int]) -> list[int]:
    return [x * x for x in xs]


square = qs.Serving(_square, name="square", batch_size=10, batch_timeout=0.1)

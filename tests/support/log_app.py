"""A serving for the log tests (tests/integration/test_logs.py), loaded by worker processes as
``tests.support.log_app:flaky``. Nothing here imports torch."""

from __future__ import annotations

import logging

import queueserve as qs

log = logging.getLogger("log_app")
BAD = 13  # the item the batch function fails on


def _flaky(xs: list[int]) -> list[int]:
    log.info("handling %d items", len(xs))
    if BAD in xs:
        raise ValueError(f"bad item {BAD}\nsecond line, for the caller only")
    return [x + 1 for x in xs]


flaky = qs.Serving(_flaky, name="flaky", batch_size=8, batch_timeout=0)

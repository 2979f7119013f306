"""Servings of ``bench/keys.py``, run in ``queueserve worker bench.keys_servings:<name>``."""

from __future__ import annotations

import time
from typing import Any

import queueserve as qs

BATCH_S = 0.02  # the fixed time of one batch of ``timed``


def _fixed_time(xs: list[Any]) -> list[Any]:
    time.sleep(BATCH_S)
    return xs


# No work: throughput is queueserve's own cost per item and per batch.
noop = qs.Serving(lambda xs: xs, name="knoop", batch_size=256, batch_timeout=0)
# A device-like batch that takes BATCH_S whatever it holds: the quiet-key latency in batches.
timed = qs.Serving(_fixed_time, name="ktimed", batch_size=256, batch_timeout=0)

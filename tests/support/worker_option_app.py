"""Servings for the worker's option-effect table (tests/integration/test_worker_option_effects.py),
run by real worker processes as ``tests.support.worker_option_app:NAME``.

Each answers with what a test needs to see an option act: the size of the batch an item ran
in, the process that ran it. ``hold`` waits for a gate key in the test's Redis
(``$QS_TEST_URL``, under ``$QS_TEST_PREFIX``), read when a batch runs.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import redis

import queueserve as qs

GATE_LIMIT_S = 60.0  # a gate nobody opens fails the batch after this long, instead of hanging
PAIR_WAIT_S = 15.0


def holding_key(prefix: str) -> str:
    return f"{prefix}:opt:holding"


def gate_key(prefix: str) -> str:
    return f"{prefix}:opt:go"


class Sizes(qs.Serving):
    """Answers each item with the size of its batch. Batches are as large and as patient as
    they can be (the worker's --batch-size and --batch-timeout override them); an item "hold"
    waits for the test's gate."""

    name = "sizes"
    batch_size = 32
    batch_timeout = 3600.0

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        if "hold" in batch:
            r = redis.Redis.from_url(os.environ["QS_TEST_URL"], socket_timeout=5.0)
            prefix = os.environ["QS_TEST_PREFIX"]
            r.set(holding_key(prefix), os.getpid())
            deadline = time.monotonic() + GATE_LIMIT_S
            while not r.exists(gate_key(prefix)):  # polls a condition, bounded
                if time.monotonic() > deadline:
                    raise TimeoutError("the gate stayed shut")
                time.sleep(0.01)
        return [len(batch)] * len(batch)


class Pair(qs.Serving):
    """A batch returns (its process) only once another batch of this process runs beside it:
    one executor at a time never gets there (the barrier breaks, and the batch fails)."""

    name = "pair"
    batch_size = 1
    batch_timeout = 0.0

    def setup(self, partition: qs.Partition) -> None:
        self.both = threading.Barrier(2, timeout=PAIR_WAIT_S)

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        self.both.wait()
        return [os.getpid()] * len(batch)


def _whoami(items: list[Any]) -> list[int]:
    return [os.getpid()] * len(items)


sizes = Sizes()
pair = Pair()
whoami = qs.Serving(_whoami, name="whoami", batch_size=8, batch_timeout=0)

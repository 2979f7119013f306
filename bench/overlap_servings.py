"""Servings with a fixed device time per batch, for ``bench/overlap.py``.

``QS_BENCH_T`` (seconds) is the device time per batch and ``QS_BENCH_BATCH`` the batch size;
the matmul publishes its standalone calibration on ``QS_BENCH_URL`` as ``bench:matmul_t``. The
device time batches take under load is read from the worker's own metrics.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import redis

import queueserve as qs

T = float(os.environ.get("QS_BENCH_T", "0.02"))
BATCH = int(os.environ.get("QS_BENCH_BATCH", "64"))


class _Timed(qs.Serving):
    batch_size = BATCH
    batch_timeout = 0.0

    def device(self) -> None:
        raise NotImplementedError

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        self.device()
        return list(batch)


class Sleep(_Timed):
    """The device is a GIL-releasing sleep of T."""

    name = "sleep"

    def device(self) -> None:
        time.sleep(T)


class Matmul(_Timed):
    """The device is a real torch matmul on one thread (one core is the device), sized in
    setup() to take about T when run alone; that calibration is published as bench:matmul_t."""

    name = "matmul"

    def setup(self, partition: qs.Partition) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        n = 64
        while True:  # grow the matrix until one product takes T (median of 3: spikes happen)
            self.a = torch.randn(n, n)
            took = statistics.median(self._time() for _ in range(3))
            if took >= T or n >= 4096:
                break
            n = int(n * min(1.25, max(1.02, (T / took) ** (1 / 3))))
        calibrated = statistics.median(self._time() for _ in range(9))
        redis.Redis.from_url(os.environ["QS_BENCH_URL"]).set("bench:matmul_t", calibrated)

    def _time(self) -> float:
        started = time.perf_counter()
        self.device()
        return time.perf_counter() - started

    def device(self) -> None:
        self.torch.mm(self.a, self.a)

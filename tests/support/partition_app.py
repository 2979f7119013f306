"""Servings that the partition tests run in real worker processes.

They record into Redis, under ``$QS_TEST_PREFIX:rec:*`` on ``$QS_TEST_URL``, so the test can
observe what happened inside the partitions; the variables are read when a batch runs.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import redis

import queueserve as qs

WAIT_S = 30.0


def _redis() -> tuple[redis.Redis, str]:
    return redis.Redis.from_url(os.environ["QS_TEST_URL"]), os.environ["QS_TEST_PREFIX"]


def _wait_for(r: redis.Redis, key: str, at_least: int) -> None:
    """Poll until list ``key`` has ``at_least`` entries (a condition, bounded by WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while r.llen(key) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key} never reached {at_least} entries")
        time.sleep(0.005)


class Recording(qs.Serving):
    """Records setup per partition and each batch's time window; ``rendezvous`` makes every
    batch wait until that many batches have started, which only concurrent partitions reach."""

    name = "recording"
    batch_size = 4
    batch_timeout = 0.0
    rendezvous = 1

    def setup(self, partition: qs.Partition) -> None:
        r, prefix = _redis()
        r.rpush(f"{prefix}:rec:setup", f"{partition.index}:{partition.device}:{os.getpid()}")

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        r, prefix = _redis()
        started = time.time()
        r.rpush(f"{prefix}:rec:started", os.getpid())
        _wait_for(r, f"{prefix}:rec:started", self.rendezvous)
        window = f"{os.getpid()}:{batch.partition.index}:{started}:{time.time()}"
        r.rpush(f"{prefix}:rec:windows", window)
        return [x * 10 for x in batch]


class Pair(Recording):
    name = "pair"
    rendezvous = 2


class SlowSetup(Recording):
    """Records its setup, then stays in it until the test says go: a model still loading."""

    name = "slow-setup"

    def setup(self, partition: qs.Partition) -> None:
        super().setup(partition)
        r, prefix = _redis()
        _wait_for(r, f"{prefix}:rec:go", 1)


class Crashy(qs.Serving):
    """Kills its own process (as a segfault or OOM kill would) on the item -1."""

    name = "crashy"
    batch_size = 1
    batch_timeout = 0.0

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        if -1 in batch:
            os._exit(9)
        return [x + 1 for x in batch]


class Unstable(qs.Serving):
    """A partition that dies outside any batch (a bug in its own threads) each time the test
    sets ``rec:die``: the kind of death that counts towards the worker's crash loop."""

    name = "unstable"
    batch_size = 1
    batch_timeout = 0.0

    def setup(self, partition: qs.Partition) -> None:
        threading.Thread(target=self._die_when_told, daemon=True).start()

    @staticmethod
    def _die_when_told() -> None:
        r, prefix = _redis()
        while not r.delete(f"{prefix}:rec:die"):
            time.sleep(0.01)
        os._exit(9)

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        return [x + 1 for x in batch]


class Gated(qs.Serving):
    """Marks that its batch started, and which worker (the partition's parent process) runs
    each item (``ran``: ``<worker pid>:<item>``), then waits for the test to say go."""

    name = "gated"
    batch_size = 8
    batch_timeout = 0.0

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        r, prefix = _redis()
        r.rpush(f"{prefix}:rec:ran", *[f"{os.getppid()}:{x}" for x in batch])
        r.rpush(f"{prefix}:rec:started", len(batch))
        _wait_for(r, f"{prefix}:rec:go", 1)
        return [x * 2 for x in batch]


class Device(qs.Serving):
    """Reports the torch device a partition is bound to."""

    name = "device"
    batch_size = 1
    batch_timeout = 0.0

    def setup(self, partition: qs.Partition) -> None:
        import torch

        self.device = torch.device(partition.device)
        self.current = torch.cuda.current_device()

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        import torch

        t = torch.ones(1, device=self.device)
        return [f"{t.device}|{self.current}" for _ in batch]


class Heap(qs.Serving):
    """Answers how its partition process's garbage collector sees the heap: how many objects
    are frozen, whether the one its setup() made is still walked by collections, and after how
    many objects the young generation is collected."""

    name = "heap"
    batch_size = 1
    batch_timeout = 0.0

    def setup(self, partition: qs.Partition) -> None:
        self.made_in_setup = {"weights": list(range(10))}

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        import gc

        walked = any(o is self.made_in_setup for o in gc.get_objects())
        return [
            {
                "frozen": gc.get_freeze_count(),
                "setup_walked": walked,
                "young_threshold": gc.get_threshold()[0],
            }
            for _ in batch
        ]

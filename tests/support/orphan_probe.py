"""A stand-in supervisor for the orphan test: it spawns one partition-like child and prints its
pid. The child waits until the test sets ``<key>`` (its model "loading"), then sits in the
partition's serve loop, and records its exit code under ``<key>:exited`` once that loop ends.

Run as ``python -m tests.support.orphan_probe REDIS_URL KEY``.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time

import redis

from queueserve.serving import Partition
from queueserve.worker.partition_process import _serve_until_stopped
from queueserve.worker.watchdog import BatchClock, Limits, shared_clock

WAIT_S = 60.0


def _child(url: str, key: str, shared: object) -> None:
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + WAIT_S
    while not r.exists(key):  # polls a condition, bounded
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    stop, wake = threading.Event(), threading.Event()
    code = _serve_until_stopped(Partition(), Limits(), BatchClock(shared, wake), stop, wake)
    r.rpush(f"{key}:exited", code)


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_child, args=(sys.argv[1], sys.argv[2], shared_clock(context)))
    child.start()
    print(child.pid, flush=True)
    child.join()

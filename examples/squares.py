"""End-to-end demo: a worker process with two partitions, callers from threads, and a packed map.

Run with ``scripts/demo`` (or ``python -m examples.squares``). Uses ``$QUEUESERVE_REDIS_URL``
when set, else starts a private redis-server for the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import queueserve as qs
from queueserve.embedded import EmbeddedRedis


def square_batch(xs: list[int]) -> list[int]:
    return [x * x for x in xs]


square = qs.Serving(square_batch, name="square", batch_size=256, batch_timeout="2ms")


def _redis_url(stack: contextlib.ExitStack) -> str:
    url = os.environ.get("QUEUESERVE_REDIS_URL")
    if url:
        print(f"using Redis at {url}")
        return url
    url = stack.enter_context(EmbeddedRedis())
    print(f"started a private redis-server at {url}")
    return url


def _callers(client: qs.Client, threads: int, per_thread: int) -> float:
    def call(base: int) -> None:
        for i in range(base, base + per_thread):
            assert client.dispatch("square", i, timeout=30) == i * i

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(call, range(0, threads * per_thread, per_thread)))
    return threads * per_thread / (time.perf_counter() - started)


def main() -> int:
    with contextlib.ExitStack() as stack:
        url = _redis_url(stack)
        prefix = f"demo{os.getpid()}"
        worker = subprocess.Popen(
            [sys.executable, "-m", "queueserve", "worker", "examples.squares:square",
             "--redis-url", url, "--prefix", prefix, "--partitions", "2", "--log-level", "WARNING"]
        )
        client = stack.enter_context(qs.Client(url, prefix=prefix))
        try:
            print("dispatch(square, 12) ->", client.dispatch("square", 12, timeout=60))
            print("dispatch_many with a bad item ->",
                  client.dispatch_many("square", [2, "x", 4], return_exceptions=True))
            rate = _callers(client, threads=32, per_thread=300)
            print(f"32 threads, one dispatch per item: {rate:,.0f} items/s")
            started = time.perf_counter()
            total = sum(client.map("square", range(200_000), chunk_size=256))
            rate = 200_000 / (time.perf_counter() - started)
            print(f"map over 200,000 items (256 per request): {rate:,.0f} items/s, sum {total}")
        finally:
            worker.send_signal(signal.SIGTERM)
            code = worker.wait(60)
        print(f"worker stopped gracefully with exit code {code}")
        return code


if __name__ == "__main__":
    sys.exit(main())

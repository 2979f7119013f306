"""The yardstick: a minimal hand-written redis-py loop doing the work of queueserve's single-item
path, and nothing else (docs/design.md §8 measures queueserve as a ratio of it). No queueserve
imports.

Producer side (:class:`BaselineClient`, in the benchmark process):

- one entry per item: ``XADD <stream> * m msgpack([request_id, inbox, item])``; a caller thread
  sends a window of items as one pipeline (one round trip per window), then waits for each
  (:meth:`BaselineClient.submit_window`: the reference of docs/design.md §8); :meth:`BaselineClient.
  dispatch` is the unpipelined form, one XADD per item from a blocked caller thread, for
  comparing like with like against 64 threads calling ``dispatch``; :class:`AsyncBaselineClient`
  is that form for asyncio (``redis.asyncio``: one XADD per item from a waiting coroutine, one
  reader task on the inbox), for comparing against coroutines awaiting ``AsyncClient.dispatch``;
- one reader thread per client: ``BLPOP`` the client's inbox list, then ``LPOP inbox 512`` until
  it is empty, and completes each item's waiter (a pre-acquired ``threading.Lock``, the cheapest
  waiter in the standard library; queueserve uses the same primitive).

Consumer side (:func:`consume`, its own process, ``python -m bench.baseline URL STREAM``):

- ``XREADGROUP GROUP g c COUNT 256 BLOCK 100`` on the stream;
- decode the entries, run the no-op batch function ``lambda xs: xs`` over the items;
- one pipeline: one ``RPUSH inbox msgpack([[request_id, result], ...])`` per (client, batch),
  then ``XACK`` and ``XDEL`` of the batch's entry ids.

It reads, then writes: no overlap of I/O and work, no admission control, no deadlines, no error
handling or redelivery — the minimum a correct loop needs. Round trips (:meth:`BaselineClient.
call`) are one ``XADD`` and a ``BLPOP`` on a private inbox, with no reader thread in between.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
import threading
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import msgpack
import redis
import redis.asyncio

GROUP = "g"
READ_COUNT = 256
DRAIN_COUNT = 512
WAIT_S = 60.0


class Waiter:
    """One item's result; ``wait()`` blocks until ``set()``."""

    __slots__ = ("_lock", "result")

    def __init__(self) -> None:
        self.result: Any = None
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self, result: Any) -> None:
        self.result = result
        self._lock.release()

    def wait(self, timeout: float = WAIT_S) -> Any:
        if not self._lock.acquire(timeout=timeout):
            raise TimeoutError(f"no reply within {timeout:g}s: is the baseline consumer alive?")
        return self.result


class BaselineClient:
    def __init__(self, url: str, stream: str) -> None:
        # redis-py's return types are unions of everything a command may return; Any here.
        self.redis: Any = redis.Redis.from_url(url)
        self.stream = stream
        self.inbox = f"bl:inbox:{uuid.uuid4().hex[:12]}"
        self.rt_inbox = self.inbox + ":rt"
        self.waiters: dict[int, Waiter] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="baseline-inbox", daemon=True)
        self._reader.start()

    def submit_window(self, items: Sequence[Any]) -> list[Waiter]:
        """XADD one entry per item, all in one pipeline; a waiter per item."""
        pipe = self.redis.pipeline(transaction=False)
        waiters = []
        for item in items:
            rid = next(self._ids)
            waiter = self.waiters[rid] = Waiter()
            waiters.append(waiter)
            pipe.xadd(self.stream, {"m": msgpack.packb([rid, self.inbox, item])})
        pipe.execute()
        return waiters

    def dispatch(self, item: Any) -> Any:
        """One item, one XADD, then wait: the hand-written form of a blocking dispatch."""
        rid = next(self._ids)
        waiter = self.waiters[rid] = Waiter()
        self.redis.xadd(self.stream, {"m": msgpack.packb([rid, self.inbox, item])})
        return waiter.wait()

    def call(self, item: Any) -> Any:
        """One round trip: XADD, then BLPOP the private inbox (no reader thread involved)."""
        self.redis.xadd(self.stream, {"m": msgpack.packb([0, self.rt_inbox, item])})
        popped = self.redis.blpop([self.rt_inbox], timeout=WAIT_S)
        if popped is None:
            raise TimeoutError(f"no reply within {WAIT_S:g}s: is the baseline consumer alive?")
        return msgpack.unpackb(popped[1])[0][1]

    def _deliver(self, message: bytes) -> None:
        waiters = self.waiters
        for rid, result in msgpack.unpackb(message):
            waiter = waiters.pop(rid, None)
            if waiter is not None:
                waiter.set(result)

    def _read(self) -> None:
        r: Any = self.redis
        while not self._closed:
            popped = r.blpop([self.inbox], timeout=1)
            if popped is None or not popped[1]:
                continue
            self._deliver(popped[1])
            while more := r.lpop(self.inbox, DRAIN_COUNT):
                for message in more:
                    if message:
                        self._deliver(message)

    def close(self) -> None:
        self._closed = True
        self.redis.rpush(self.inbox, b"")
        self._reader.join(timeout=5)
        self.redis.delete(self.inbox, self.rt_inbox)
        self.redis.close()


class AsyncBaselineClient:
    """``BaselineClient.dispatch`` for asyncio; make it and use it in one event loop."""

    def __init__(self, url: str, stream: str) -> None:
        self.redis: Any = redis.asyncio.Redis.from_url(url)
        self.reader: Any = redis.asyncio.Redis.from_url(url)  # its BLPOP holds a connection
        self.stream = stream
        self.inbox = f"bl:ainbox:{uuid.uuid4().hex[:12]}"
        self.futures: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def dispatch(self, item: Any) -> Any:
        rid = next(self._ids)
        future = self.futures[rid] = asyncio.get_running_loop().create_future()
        await self.redis.xadd(self.stream, {"m": msgpack.packb([rid, self.inbox, item])})
        return await asyncio.wait_for(future, WAIT_S)

    def _deliver(self, message: bytes) -> None:
        futures = self.futures
        for rid, result in msgpack.unpackb(message):
            future = futures.pop(rid, None)
            if future is not None and not future.done():
                future.set_result(result)

    async def _read(self) -> None:
        r = self.reader
        while not self._closed:
            popped = await r.blpop([self.inbox], timeout=1)
            if popped is None or not popped[1]:
                continue
            self._deliver(popped[1])
            while more := await r.lpop(self.inbox, DRAIN_COUNT):
                for message in more:
                    if message:
                        self._deliver(message)

    async def close(self) -> None:
        self._closed = True
        await self.redis.rpush(self.inbox, b"")
        await asyncio.wait_for(self._task, 5)
        await self.redis.delete(self.inbox)
        await self.redis.aclose()
        await self.reader.aclose()


def consume(url: str, stream: str) -> None:
    """Serve ``stream`` until SIGTERM: read a batch, run it, reply per client, ack + delete."""
    r: Any = redis.Redis.from_url(url)
    try:
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
    running = True

    def stop(*_: object) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)

    def batch_fn(xs: list[Any]) -> list[Any]:
        return xs

    while running:
        out = r.xreadgroup(GROUP, "c", {stream: ">"}, count=READ_COUNT, block=100)
        if not out:
            continue
        entries = out[0][1]
        ids = [entry_id for entry_id, _ in entries]
        headers = [msgpack.unpackb(fields[b"m"]) for _, fields in entries]
        results = batch_fn([item for _, _, item in headers])
        replies: dict[str, list[Any]] = defaultdict(list)
        for (rid, inbox, _), result in zip(headers, results, strict=True):
            replies[inbox].append([rid, result])
        pipe = r.pipeline(transaction=False)
        for inbox, rows in replies.items():
            pipe.rpush(inbox, msgpack.packb(rows))
        pipe.xack(stream, GROUP, *ids)
        pipe.xdel(stream, *ids)
        pipe.execute()
    r.close()


if __name__ == "__main__":
    consume(sys.argv[1], sys.argv[2])

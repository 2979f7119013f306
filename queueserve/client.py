"""The synchronous client: dispatch items to servings from any number of threads.

Sending is combined: a caller that finds no send in progress sends its own request and every
request other threads queued meanwhile, in one Lua call; so one caller pays one round trip and
many concurrent callers share them. One background thread per client drains the client's inbox
and completes calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

from . import protocol as P
from ._calls import Call, deadline_after, encode_request
from ._client_base import (
    ALIVE_WITHIN,
    RECONNECT_WITHIN,
    ClientBase,
    Part,
    ServingRef,
    Target,
    collect,
)
from .broker import RedisBroker, backoff
from .errors import (
    BadRequest,
    Cancelled,
    QueueFull,
    QueueServeError,
    RedisUnavailable,
    Timeout,
)
from .progress import Progress, ProgressCallback, total_of

log = logging.getLogger(__name__)

_Outgoing = tuple[Target, str, Call, bytes, bytes]


class Ticket:
    """A submitted request: ``.result(timeout)``, ``.cancel()``, ``.done()``, ``.id``."""

    __slots__ = ("_calls", "_client", "_deadline", "_parts", "_target", "_timeout")

    def __init__(
        self,
        client: Client,
        target: Target,
        parts: list[Part],
        calls: list[Call],
        timeout: float | None,
    ) -> None:
        self._client = client
        self._target = target
        self._parts = parts
        self._calls = calls
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout

    @property
    def id(self) -> str:
        """Request id, unique across clients (``client_id-request``; one per batch key)."""
        return ",".join(f"{self._client.client_id}-{c.rid}" for c in self._calls)

    def done(self) -> bool:
        return all(c.state != "pending" for c in self._calls)

    def result(self, timeout: float | None = None, *, return_exceptions: bool = False) -> list[Any]:
        """Results in item order; raises the first item's error unless return_exceptions."""
        for call in self._calls:
            self._wait(call, timeout)
        return collect(self._target, self._parts, self._calls, return_exceptions)

    def _wait(self, call: Call, timeout: float | None) -> None:
        limit = timeout
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            limit = left if limit is None else min(limit, left)
        if call.wait(limit):
            return
        expired = self._deadline is not None and time.monotonic() >= self._deadline
        if expired:
            self._client.table.forget(call)
            call.fail(Timeout(self._client.timeout_text(self._target, self._timeout)))
            return
        raise Timeout(self._client.timeout_text(self._target, timeout))

    def cancel(self) -> bool:
        """Withdraw the request. True when it will never run; False when a worker already
        holds it (its result is then dropped) or it had finished."""
        never_runs = True
        for call in self._calls:
            if call.state != "pending":
                never_runs = False
                continue
            self._client.table.forget(call)
            call.fail(Cancelled(f"request {self._client.client_id}-{call.rid} was cancelled"))
            call.state = "cancelled"
            if call.entry_id is None or not self._client.broker.cancel(
                call.keys, call.keys.stream(call.batch_key), call.entry_id, call.n
            ):
                never_runs = False
        return never_runs


class Client:
    """Dispatch items to servings over Redis.

    >>> client = qs.Client("redis://localhost:6379/0")
    >>> client.dispatch("square", 2)
    4
    """

    def __init__(self, url: str | None = None, *, prefix: str | None = None) -> None:
        self._base = ClientBase(url, prefix)
        self.url = self._base.url
        self.client_id = self._base.client_id
        self.table = self._base.table
        self.broker = RedisBroker(self.url)
        self._out_lock = threading.Lock()
        self._outbox: list[_Outgoing] = []
        self._flushing = False
        self._reader: threading.Thread | None = None
        self._closed = False
        self._start_lock = threading.Lock()

    # -- public API ------------------------------------------------------------------------
    def dispatch(
        self, serving: ServingRef, item: Any, *, batch_key: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Run one item; returns its result or raises its error."""
        return self.submit(serving, [item], batch_key=batch_key, timeout=timeout).result()[0]

    def dispatch_many(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, return_exceptions: bool = False,
    ) -> list[Any]:
        """Run items as one request; results in item order."""
        ticket = self.submit(serving, items, batch_key=batch_key, timeout=timeout)
        return ticket.result(return_exceptions=return_exceptions)

    def submit(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None,
    ) -> Ticket:
        """Send items as one request (one per batch key) without waiting; returns a Ticket."""
        if self._closed:
            raise QueueServeError("this client is closed; create a new qs.Client")
        target = self._target(serving)
        items = items if isinstance(items, list) else list(items)
        parts = ClientBase.plan(target, items, batch_key)
        deadline = deadline_after(timeout)
        self._ensure_reader()
        calls = []
        for part in parts:
            call = self.table.new(len(part.items), target.keys, part.batch_key)
            header, payload = encode_request(
                target.codec, call.rid, part.items, self._base.inbox, deadline
            )
            try:
                target.check_payload(payload, call.n)
            except BadRequest:
                self.table.forget(call)
                raise
            calls.append(call)
            self._send((target, part.batch_key, call, header, payload))
        return Ticket(self, target, parts, calls, timeout)

    def map(
        self, serving: ServingRef, items: Iterable[Any], *, chunk_size: int = 256,
        batch_key: str | None = None, timeout: float | None = None,
        max_in_flight: int = 16, return_exceptions: bool = False, progress: bool = False,
        on_progress: ProgressCallback | None = None,
    ) -> Iterator[Any]:
        """Results of ``items`` in input order, sending ``chunk_size`` items per request and
        keeping at most ``max_in_flight`` requests outstanding (constant memory).

        ``progress=True`` draws a tqdm bar (items, items/s, ETA) when stderr is a terminal;
        ``on_progress(done, total)`` is called as results arrive (total None without len()).
        """
        if chunk_size < 1 or max_in_flight < 1:
            raise ValueError("chunk_size and max_in_flight must be >= 1")
        meter = Progress(total_of(items), progress, on_progress)
        it = iter(items)
        window: deque[Ticket] = deque()
        try:
            while True:
                while len(window) < max_in_flight:
                    chunk = list(islice(it, chunk_size))
                    if not chunk:
                        break
                    window.append(
                        self.submit(serving, chunk, batch_key=batch_key, timeout=timeout)
                    )
                if not window:
                    return
                results = window.popleft().result(return_exceptions=return_exceptions)
                meter.advance(len(results))
                yield from results
        finally:
            meter.close()

    def close(self) -> None:
        """Stop the inbox reader; calls still waiting fail with Cancelled."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            try:
                self.broker.redis.rpush(self._base.inbox, b"")  # wakes the reader
                self.broker.redis.pexpire(self._base.inbox, 1000)
            except Exception:
                log.debug("could not wake the inbox reader", exc_info=True)
            self._reader.join(timeout=5)
        self.table.fail_all(Cancelled("the client was closed before the answer came"))
        self.broker.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _target(self, serving: ServingRef) -> Target:
        target = self._base.cached(serving)
        if target is not None:
            return target
        name = serving if isinstance(serving, str) else None
        meta = self.broker.meta(P.Keys(self._base.prefix, name)) if name else {}
        return self._base.remember(serving, meta)

    def timeout_text(self, target: Target, timeout: float | None) -> str:
        try:
            alive: int | None = self.broker.alive_workers(target.keys, ALIVE_WITHIN)
        except RedisUnavailable:
            alive = None
        return ClientBase.timeout_message(target, timeout, alive)

    def _send(self, outgoing: _Outgoing) -> None:
        with self._out_lock:
            self._outbox.append(outgoing)
            if self._flushing:
                return  # the thread flushing now sends it too
            self._flushing = True
        self._flush()

    def _flush(self) -> None:
        while True:
            with self._out_lock:
                batch, self._outbox = self._outbox, []
                if not batch:
                    self._flushing = False
                    return
            try:
                self._enqueue_retrying(batch)
            except QueueServeError as e:
                for _, _, call, _, _ in batch:
                    self.table.forget(call)
                    call.fail(e)
            except BaseException:
                with self._out_lock:
                    self._flushing = False
                raise

    def _enqueue_retrying(self, batch: list[_Outgoing]) -> None:
        give_up = time.monotonic() + RECONNECT_WITHIN
        attempt = 0
        while True:
            try:
                self._enqueue(batch)
            except RedisUnavailable as e:
                if time.monotonic() >= give_up or self._closed:
                    raise
                log.warning("sending to Redis: %s; retrying", e)
                time.sleep(backoff(attempt))
                attempt += 1
                continue
            if attempt:
                log.warning("sending to Redis at %s works again", self.url)
            return

    def _enqueue(self, batch: list[_Outgoing]) -> None:
        by_serving: dict[str, list[_Outgoing]] = {}
        for out in batch:
            by_serving.setdefault(out[0].keys.name, []).append(out)
        for group in by_serving.values():
            target = group[0][0]
            requests = [(key, call.n, h, p) for _, key, call, h, p in group]
            limit, queued, ids = self.broker.enqueue(target.keys, requests, target.max_queue)
            for (_, _, call, _, _), entry_id in zip(group, ids, strict=True):
                if entry_id == 0:
                    self.table.forget(call)
                    call.fail(QueueFull(ClientBase.full_message(target, limit, queued, call.n)))
                else:
                    call.entry_id = entry_id  # type: ignore[assignment]

    def _ensure_reader(self) -> None:
        if self._reader is not None:
            return
        with self._start_lock:
            if self._reader is None:
                self._reader = threading.Thread(
                    target=self._read_inbox, name=f"queueserve-inbox-{self.client_id}", daemon=True
                )
                self._reader.start()

    def _read_inbox(self) -> None:
        attempt = 0
        while not self._closed:
            try:
                messages = self.broker.read_inbox(self._base.inbox, timeout=1.0)
            except RedisUnavailable as e:
                log.warning("inbox reader: %s; retrying", e)
                time.sleep(backoff(attempt))
                attempt += 1
                continue
            if attempt:
                log.warning("inbox reader: Redis at %s is reachable again", self.url)
                attempt = 0
            for message in messages:
                if message:
                    try:
                        self.table.deliver(message)
                    except Exception:
                        log.exception("dropped an undecodable reply in %s", self._base.inbox)

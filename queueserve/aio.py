"""The asyncio client: the same methods as ``qs.Client``, awaitable.

Same wire protocol and call table as the sync client; sends are combined the same way (the task
that finds no send in progress sends everything queued), and one task drains the inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from itertools import islice
from typing import Any

import redis
import redis.asyncio as aioredis

from . import protocol as P
from ._calls import Call, deadline_after, encode_request
from ._client_base import (
    ALIVE_WITHIN,
    ClientBase,
    Outgoing,
    Part,
    ServingRef,
    Target,
    admitted,
    by_serving,
    collect,
    send_window,
)
from ._streams import Event, RequestStream
from .broker import backoff, enqueue_arguments, load_script, redis_errors, text
from .client import STREAM_GRACE
from .errors import (
    BadRequest,
    Cancelled,
    QueueServeError,
    RedisUnavailable,
    Timeout,
)
from .progress import Progress, ProgressCallback, total_of

log = logging.getLogger(__name__)



async def _stragglers(rs: RequestStream, events: asyncio.Queue[Any]) -> list[Event]:
    """Events the answer says were sent, still on their way: wait a moment for them."""
    ready: list[Event] = []
    grace_end = time.monotonic() + STREAM_GRACE
    while rs.waiting_for_events and (left := grace_end - time.monotonic()) > 0:
        try:
            event = await asyncio.wait_for(events.get(), left)
        except TimeoutError:
            break
        if event is not None:
            ready += rs.add(*event)
    return ready


class AsyncTicket:
    """A submitted request: ``await .result(timeout)``, ``await .cancel()``, ``.done()``."""

    __slots__ = ("_calls", "_client", "_futures", "_parts", "_target", "_timeout")

    def __init__(
        self, client: AsyncClient, target: Target, parts: list[Part], calls: list[Call],
        futures: list[asyncio.Future[None]], timeout: float | None,
    ) -> None:
        self._client = client
        self._target = target
        self._parts = parts
        self._calls = calls
        self._futures = futures
        self._timeout = timeout

    @property
    def id(self) -> str:
        return ",".join(f"{self._client.client_id}-{c.rid}" for c in self._calls)

    def done(self) -> bool:
        return all(c.state != "pending" for c in self._calls)

    async def result(
        self, timeout: float | None = None, *, return_exceptions: bool = False
    ) -> list[Any]:
        limit = self._timeout if timeout is None else (
            timeout if self._timeout is None else min(timeout, self._timeout)
        )
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.gather(*self._futures)), limit)
        except TimeoutError:
            text = await self._client.timeout_text(self._target, limit)
            if limit == self._timeout:  # the request's own deadline: it is over
                for call in self._calls:
                    self._client.table.forget(call)
                    call.fail(Timeout(text))
            else:
                raise Timeout(text) from None
        return collect(self._target, self._parts, self._calls, return_exceptions)

    async def cancel(self) -> bool:
        """Withdraw the request; True when it will never run."""
        never_runs = True
        for call in self._calls:
            if call.state != "pending":
                never_runs = False
                continue
            self._client.table.forget(call)
            call.fail(Cancelled(f"request {self._client.client_id}-{call.rid} was cancelled"))
            call.state = "cancelled"
            if call.entry_id is None or not await self._client.withdraw(call):
                never_runs = False
        return never_runs


class AsyncClient:
    """Dispatch items to servings from asyncio code.

    >>> async with qs.AsyncClient("redis://localhost:6379/0") as client:
    ...     await client.dispatch("square", 2)
    4
    """

    def __init__(self, url: str | None = None, *, prefix: str | None = None) -> None:
        self._base = ClientBase(url, prefix)
        self.url = self._base.url
        self.client_id = self._base.client_id
        self.table = self._base.table
        self.redis = aioredis.Redis.from_url(self.url)
        self._enqueue_script = self.redis.register_script(load_script("enqueue.lua"))
        self._cancel_script = self.redis.register_script(load_script("cancel.lua"))
        self._outbox: list[Outgoing] = []
        self._flushing = False
        self._reader: asyncio.Task[None] | None = None
        self._events: asyncio.Task[None] | None = None
        self._events_channel = P.events_channel(self._base.prefix, self.client_id)
        self._closed = False

    async def dispatch(
        self, serving: ServingRef, item: Any, *, batch_key: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        ticket = await self.submit(serving, [item], batch_key=batch_key, timeout=timeout)
        return (await ticket.result())[0]

    async def dispatch_many(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, return_exceptions: bool = False,
    ) -> list[Any]:
        ticket = await self.submit(serving, items, batch_key=batch_key, timeout=timeout)
        return await ticket.result(return_exceptions=return_exceptions)

    async def submit(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None,
    ) -> AsyncTicket:
        if self._closed:
            raise QueueServeError("this client is closed; create a new qs.AsyncClient")
        target = await self._target(serving)
        items = items if isinstance(items, list) else list(items)
        parts = ClientBase.plan(target, items, batch_key)
        deadline = deadline_after(timeout)
        self._ensure_reader()
        loop = asyncio.get_running_loop()
        calls, futures = [], []
        for part in parts:
            call = self.table.new(len(part.items), target.keys, part.batch_key)
            call.deadline = deadline
            future: asyncio.Future[None] = loop.create_future()
            call.on_done = lambda _c, f=future: f.done() or f.set_result(None)
            header, payload = encode_request(
                target.codec, call.rid, part.items, self._base.inbox, deadline
            )
            try:
                target.check_payload(payload, call.n)
            except BadRequest:
                self.table.forget(call)
                raise
            calls.append(call)
            futures.append(future)
            self._outbox.append((target, part.batch_key, call, header, payload))
        if not self._flushing:
            await self._flush()
        return AsyncTicket(self, target, parts, calls, futures, timeout)

    async def map(
        self, serving: ServingRef, items: Iterable[Any], *, chunk_size: int = 256,
        batch_key: str | None = None, timeout: float | None = None,
        max_in_flight: int = 16, return_exceptions: bool = False, progress: bool = False,
        on_progress: ProgressCallback | None = None,
    ) -> AsyncIterator[Any]:
        """Results in input order, ``chunk_size`` items per request, bounded in flight;
        ``progress``/``on_progress`` as in ``Client.map``."""
        if chunk_size < 1 or max_in_flight < 1:
            raise ValueError("chunk_size and max_in_flight must be >= 1")
        meter = Progress(total_of(items), progress, on_progress)
        it = iter(items)
        window: deque[AsyncTicket] = deque()
        try:
            while True:
                while len(window) < max_in_flight:
                    chunk = list(islice(it, chunk_size))
                    if not chunk:
                        break
                    window.append(
                        await self.submit(serving, chunk, batch_key=batch_key, timeout=timeout)
                    )
                if not window:
                    return
                results = await window.popleft().result(return_exceptions=return_exceptions)
                meter.advance(len(results))
                for r in results:
                    yield r
        finally:
            meter.close()

    async def stream(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, max_in_flight: int = 4,
    ) -> AsyncIterator[Event]:
        """``Client.stream`` for asyncio: ``async for event in client.stream(...)``."""
        target = await self._target(serving)
        parts = ClientBase.stream_parts(target, list(items), batch_key)
        await self._ensure_events()
        deadline = deadline_after(timeout)
        window: deque[tuple[RequestStream, asyncio.Queue[Any]]] = deque()
        todo = deque(parts)
        try:
            while todo or window:
                while todo and len(window) < max_in_flight:
                    offset, part = todo.popleft()
                    window.append(await self._submit_streamed(target, offset, part, deadline))
                rs, events = window[0]
                async for event in self._stream_events(target, rs, events, deadline, timeout):
                    yield event
                window.popleft()  # only now: leaving mid-request must cancel this one too
        finally:
            for rs, _ in window:
                self.table.streamed.pop(rs.call.rid, None)
                await AsyncTicket(self, target, [], [rs.call], [], None).cancel()

    async def _submit_streamed(
        self, target: Target, offset: int, part: Part, deadline: float | None
    ) -> tuple[RequestStream, asyncio.Queue[Any]]:
        call = self.table.new(len(part.items), target.keys, part.batch_key)
        call.deadline = deadline
        events: asyncio.Queue[Any] = asyncio.Queue()
        call.on_event = lambda seq, body: events.put_nowait((seq, body))
        call.on_done = lambda _call: events.put_nowait(None)
        self.table.streamed[call.rid] = call
        header, payload = encode_request(
            target.codec, call.rid, part.items, self._base.inbox, deadline, self._events_channel
        )
        target.check_payload(payload, call.n)
        self._outbox.append((target, part.batch_key, call, header, payload))
        if not self._flushing:
            await self._flush()
        return RequestStream(call, offset), events

    async def _stream_events(
        self, target: Target, rs: RequestStream, events: asyncio.Queue[Any],
        deadline: float | None, timeout: float | None,
    ) -> AsyncIterator[Event]:
        try:
            while True:  # until the answer
                left = None if deadline is None else max(0.0, deadline - time.time())
                try:
                    event = await asyncio.wait_for(events.get(), left)
                except TimeoutError:
                    raise Timeout(await self.timeout_text(target, timeout)) from None
                if event is None:
                    break
                for ready in rs.add(*event):
                    yield ready
            for ready in await _stragglers(rs, events):
                yield ready
            done, error = rs.complete()
            for ready in done:
                yield ready
            if error is not None:
                raise error
        finally:
            self.table.streamed.pop(rs.call.rid, None)

    async def _ensure_events(self) -> None:
        """Subscribe this client's event channel (once), confirmed before anything is sent."""
        if self._events is not None:
            return
        self._ensure_reader()
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self._events_channel)
        self._events = asyncio.get_running_loop().create_task(
            self._read_events(pubsub), name=f"queueserve-events-{self.client_id}"
        )

    async def _read_events(self, pubsub: Any) -> None:
        attempt = 0
        try:
            while not self._closed:
                try:
                    message = await pubsub.get_message(timeout=1.0)
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    log.warning("event reader: Redis at %s unavailable (%s); retrying",
                                self.url, e)
                    await asyncio.sleep(backoff(attempt))
                    attempt += 1
                    continue
                attempt = 0
                if message is not None and message["type"] == "message":
                    try:
                        self.table.deliver_event(message["data"])
                    except Exception:
                        log.exception("dropped an undecodable event on %s", self._events_channel)
        finally:
            await pubsub.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            # redis-py may absorb the cancellation of a blocking read; the loop then sees
            # _closed within one BLMPOP timeout.
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._reader, 2.0)
        if self._events is not None:
            self._events.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._events, 2.0)
        self.table.fail_all(Cancelled("the client was closed before the answer came"))
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals -------------------------------------------------------------------------
    async def _target(self, serving: ServingRef) -> Target:
        target = self._base.cached(serving)
        if target is not None:
            return target
        meta: dict[str, str] = {}
        if isinstance(serving, str):
            with redis_errors(self.url):
                raw = await self.redis.hgetall(P.Keys(self._base.prefix, serving).meta)
            meta = {text(k): text(v) for k, v in raw.items()}
        return self._base.remember(serving, meta)

    async def timeout_text(self, target: Target, timeout: float | None) -> str:
        try:
            alive: int | None = int(
                await self.redis.zcount(
                    target.keys.workers, int((time.time() - ALIVE_WITHIN) * 1000), "+inf"
                )
            )
        except (redis.ConnectionError, redis.TimeoutError):
            alive = None
        return ClientBase.timeout_message(target, timeout, alive)

    async def withdraw(self, call: Call) -> bool:
        keys = call.keys
        with redis_errors(self.url):
            return bool(
                await self._cancel_script(
                    keys=[keys.stream(call.batch_key), keys.queued, keys.cancel],
                    args=[P.GROUP, call.entry_id or b"", call.n],
                )
            )

    async def _flush(self) -> None:
        self._flushing = True
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                try:
                    await self._enqueue_retrying(batch)
                except QueueServeError as e:
                    for _, _, call, _, _ in batch:
                        self.table.forget(call)
                        call.fail(e)
        finally:
            self._flushing = False

    async def _enqueue_retrying(self, batch: list[Outgoing]) -> None:
        give_up = time.monotonic() + send_window(batch)
        attempt = 0
        while True:
            try:
                await self._enqueue(batch)
            except RedisUnavailable as e:
                if time.monotonic() >= give_up or self._closed:
                    raise
                log.warning("sending to Redis: %s; retrying", e)
                await asyncio.sleep(backoff(attempt))
                attempt += 1
                continue
            if attempt:
                log.warning("sending to Redis at %s works again", self.url)
            return

    async def _enqueue(self, batch: list[Outgoing]) -> None:
        for group in by_serving(batch):
            target = group[0][0]
            requests = [(key, call.n, h, p) for _, key, call, h, p in group]
            script_keys, args = enqueue_arguments(target.keys, requests, target.max_queue)
            with redis_errors(self.url):
                out = await self._enqueue_script(keys=script_keys, args=args)
            admitted(self.table, group, int(out[0]), int(out[1]), out[2:])

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(
                self._read_inbox(), name=f"queueserve-inbox-{self.client_id}"
            )

    async def _read_inbox(self) -> None:
        attempt = 0
        while not self._closed:
            try:
                out = await self.redis.execute_command(  # type: ignore[no-untyped-call]
                    "BLMPOP", 1, 1, self._base.inbox, "LEFT", "COUNT", 512
                )
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("inbox reader: Redis at %s unavailable (%s); retrying", self.url, e)
                await asyncio.sleep(backoff(attempt))
                attempt += 1
                continue
            if attempt:
                log.warning("inbox reader: Redis at %s is reachable again", self.url)
                attempt = 0
            for message in [] if out is None else out[1]:
                try:
                    self.table.deliver(message)
                except Exception:
                    log.exception("dropped an undecodable reply in %s", self._base.inbox)

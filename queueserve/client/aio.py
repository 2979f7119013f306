"""The asyncio client: the same methods as ``qs.Client``, awaitable.

Same wire protocol and call table as the sync client; sends are combined the same way (the task
that finds no send in progress sends everything queued), and one task drains the inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

from queueserve.broker.aio import AsyncProducer
from queueserve.broker.retry import RedisFailure, Retry
from queueserve.client.base import (
    INBOX_BLOCK_S,
    ClientBase,
    MapWindow,
    Outgoing,
    Part,
    ServingRef,
    StreamPacer,
    Target,
    admitted,
    collect,
    enqueue_groups,
    kept_parts,
    send_window,
)
from queueserve.client.calls import Call, deadline_after
from queueserve.client.events import RequestStream
from queueserve.client.progress import ProgressCallback
from queueserve.errors import Cancelled, NotReplicated, QueueServeError, Timeout
from queueserve.hooks import Event
from queueserve.wire.timing import ALIVE_WITHIN_S, RECONNECT_WITHIN_S


async def wait_uncancelled(waiting: asyncio.Future[Any], limit: float | None) -> None:
    """Await ``waiting`` up to ``limit`` seconds (TimeoutError after), never cancelling it: a
    caller cancelled or timed out here may await the same ticket again. The per-call cost of
    ``asyncio.wait_for(asyncio.shield(...))`` (a shield future, a wait_for future and its
    callbacks) was a fifth of an awaited dispatch's CPU (docs/benchmarks.md)."""
    if not waiting.done():
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        waiting.add_done_callback(wake)
        timer = None if limit is None else loop.call_later(limit, wake)
        try:
            await woken
        finally:
            waiting.remove_done_callback(wake)
            if timer is not None:
                timer.cancel()
        if not waiting.done():
            raise TimeoutError
    waiting.result()


class AsyncTicket:
    """A submitted request: ``await .result(timeout)``, ``await .cancel()``, ``.done()``."""

    __slots__ = ("_calls", "_client", "_futures", "_parts", "_target", "_timeout")

    def __init__(
        self, client: AsyncClient, target: Target, parts: list[Part], calls: list[Call],
        futures: list[asyncio.Future[None]], timeout: float | None,
    ) -> None:
        self._client = client
        self._target = target
        self._parts = kept_parts(parts)
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
            futures = self._futures
            waiting = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
            await self._client.wait_watched(self._target, waiting, limit)
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
        """Withdraw the request; True when it will never run (False: it may run, as
        ``Ticket.cancel`` says, and its result is dropped)."""
        return all([await self._client.withdraw(call) for call in self._calls])


class AsyncClient:
    """Dispatch items to servings from asyncio code.

    >>> async with qs.AsyncClient("redis://localhost:6379/0") as client:
    ...     await client.dispatch("square", 2)
    4
    """

    def __init__(
        self, url: str | None = None, *, prefix: str | None = None, codec: str | None = None
    ) -> None:
        self._base = ClientBase(url, prefix, codec)
        self.url = self._base.url
        self.client_id = self._base.client_id
        self.table = self._base.table
        self.broker = AsyncProducer(self.url, owner=self._base.owner)
        self._send_retry = Retry(self.broker.outage, "sender")
        self._outbox: list[Outgoing] = []
        self._flushing = False
        # Requests of durable servings wait for a replica (up to DURABLE_WAIT_MS) in a task
        # of their own, so that wait never holds up the sends of other servings.
        self._durable_box: list[Outgoing] = []
        self._durable_task: asyncio.Task[None] | None = None
        self._durable_retry = Retry(self.broker.outage, "durable sender")
        self._reader: asyncio.Task[None] | None = None
        self._events: asyncio.Task[None] | None = None
        self._closed = False

    async def dispatch(
        self, serving: ServingRef, item: Any, *, batch_key: str | None = None,
        timeout: float | None = None, priority: int = 0,
    ) -> Any:
        ticket = await self.submit(
            serving, [item], batch_key=batch_key, timeout=timeout, priority=priority
        )
        return (await ticket.result())[0]

    async def dispatch_many(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, priority: int = 0, return_exceptions: bool = False,
    ) -> list[Any]:
        ticket = await self.submit(
            serving, items, batch_key=batch_key, timeout=timeout, priority=priority
        )
        return await ticket.result(return_exceptions=return_exceptions)

    async def submit(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, priority: int = 0,
    ) -> AsyncTicket:
        if self._closed:
            raise self._base.closed_error("AsyncClient")
        timeout = self._base.timeout_for(timeout)
        priority = ClientBase.priority(priority)
        target = await self._target(serving)
        parts = ClientBase.plan(target, items if isinstance(items, list) else list(items),
                                batch_key)
        deadline = deadline_after(timeout)
        self._ensure_reader()
        loop = asyncio.get_running_loop()
        calls, futures = [], []
        for part in parts:
            outgoing = self._base.request(target, part, deadline, priority)
            future: asyncio.Future[None] = loop.create_future()
            outgoing[2].on_done = lambda _c, f=future: f.done() or f.set_result(None)
            calls.append(outgoing[2])
            futures.append(future)
            self._outbox.append(outgoing)
        if not self._flushing:
            await self._flush()
        return AsyncTicket(self, target, parts, calls, futures, timeout)

    async def map(
        self, serving: ServingRef, items: Iterable[Any], *, chunk_size: int = 256,
        batch_key: str | None = None, timeout: float | None = None, priority: int = 0,
        max_in_flight: int = 16, return_exceptions: bool = False, progress: bool = False,
        on_progress: ProgressCallback | None = None,
    ) -> AsyncIterator[Any]:
        """Results in input order, ``chunk_size`` items per request, bounded in flight;
        ``progress``/``on_progress`` as in ``Client.map``."""
        window: MapWindow[AsyncTicket] = MapWindow(
            items, chunk_size, max_in_flight, progress, on_progress
        )
        try:
            while True:
                for chunk in window.chunks():
                    window.in_flight.append(
                        await self.submit(serving, chunk, batch_key=batch_key, timeout=timeout,
                                       priority=priority)
                    )
                if not window.in_flight:
                    return
                ticket = window.in_flight.popleft()
                for r in window.done(await ticket.result(return_exceptions=return_exceptions)):
                    yield r
        finally:
            window.meter.close()

    async def stream(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, priority: int = 0, max_in_flight: int = 4,
    ) -> AsyncIterator[Event]:
        """``Client.stream`` for asyncio: ``async for event in client.stream(...)``."""
        timeout = self._base.timeout_for(timeout)
        priority = ClientBase.priority(priority)
        target = await self._target(serving)
        todo = deque(ClientBase.stream_parts(target, list(items), batch_key))
        await self._ensure_events()  # subscribed before anything is enqueued
        deadline = deadline_after(timeout)
        window: deque[tuple[RequestStream, asyncio.Queue[Any]]] = deque()
        try:
            while todo or window:
                while todo and len(window) < max_in_flight:
                    offset, part = todo.popleft()
                    events: asyncio.Queue[Any] = asyncio.Queue()
                    rs, outgoing = self._base.streamed_request(
                        target, offset, part, deadline, events.put_nowait, priority
                    )
                    self._outbox.append(outgoing)
                    if not self._flushing:
                        await self._flush()
                    window.append((rs, events))
                async for event in self._stream_events(target, *window[0], deadline, timeout):
                    yield event
                window.popleft()  # only now: leaving mid-request must cancel this one too
        finally:
            for rs, _ in window:  # the caller stopped early: withdraw what is left
                self.table.streamed.pop(rs.call.rid, None)
                await self.withdraw(rs.call)

    async def _stream_events(
        self, target: Target, rs: RequestStream, events: asyncio.Queue[Any],
        deadline: float | None, timeout: float | None,
    ) -> AsyncIterator[Event]:
        pacer = StreamPacer(rs, deadline)
        try:
            while (wait := pacer.wait()) is None or wait >= 0:
                try:
                    event = await asyncio.wait_for(events.get(), wait)
                except TimeoutError:
                    if pacer.timed_out():
                        raise Timeout(await self.timeout_text(target, timeout)) from None
                    continue
                for ready in pacer.take(event):
                    yield ready
            done, error = pacer.finish()
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
        subscribed = asyncio.Event()
        self._events = asyncio.get_running_loop().create_task(
            self._read_events(subscribed), name=f"queueserve-events-{self.client_id}"
        )
        try:
            await asyncio.wait_for(subscribed.wait(), RECONNECT_WITHIN_S)
        except TimeoutError:
            raise self._base.subscribe_failed() from None

    async def _read_events(self, subscribed: asyncio.Event) -> None:
        subscription = self.broker.subscribe(self._base.events_channel)
        retry = Retry(self.broker.outage, "event subscriber")
        try:
            while not self._closed:
                try:
                    data = await subscription.get(timeout=1.0)
                except RedisFailure as e:
                    await asyncio.sleep(retry.failed(e))
                    continue
                retry.succeeded()
                if subscription.confirmed:
                    subscribed.set()
                self._base.deliver_event(data)
        finally:
            await subscription.aclose()

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
        if self._durable_task is not None:
            self._durable_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._durable_task, 2.0)
        self.table.fail_all(Cancelled("the client was closed before the answer came"))
        await self.broker.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals -------------------------------------------------------------------------
    async def _target(self, serving: ServingRef) -> Target:
        target = self._base.cached(serving)
        if target is not None:
            return target
        keys = self._base.meta_keys(serving)
        meta = await self.broker.meta(keys) if keys else {}
        last = self._base.last_shard(keys, meta)  # confirms a count of shards over 1
        return self._base.remember(serving, meta, await self.broker.meta(last) if last else None)

    async def timeout_text(self, target: Target, timeout: float | None) -> str:
        return ClientBase.timeout_message(target, timeout, await self._alive(target))

    async def _alive(self, target: Target) -> int | None:
        try:
            return await self.broker.alive_workers(target.keys, ALIVE_WITHIN_S)
        except QueueServeError:
            return None

    async def wait_watched(
        self, target: Target, waiting: asyncio.Future[Any], limit: float | None
    ) -> None:
        """Await ``waiting`` up to ``limit`` (TimeoutError after), warning once if it waits
        on a serving no worker serves. ``waiting`` itself is never cancelled."""
        first = self._base.unserved.first_wait(target.keys.name, limit)
        if first is not None:
            try:
                await wait_uncancelled(waiting, first)
                return
            except TimeoutError:
                self._base.unserved.check(target, await self._alive(target))
                limit = None if limit is None else limit - first
        await wait_uncancelled(waiting, limit)

    async def withdraw(self, call: Call) -> bool:
        """Cancel ``call``: True when it will never run (see ``Client.withdraw``)."""
        if not self._base.cancel_call(call):
            return False
        for box in (self._outbox, self._durable_box):
            for i, outgoing in enumerate(box):
                if outgoing[2] is call:
                    del box[i]
                    return True
        return call.entry_id is not None and await self.broker.cancel(
            call.keys, call.keys.stream(call.batch_key, call.priority), call.entry_id, call.n
        )

    async def _flush(self) -> None:
        self._flushing = True
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                batch = self._set_aside_durable(batch)
                if batch:
                    await self._send_batch(batch, self._send_retry)
        finally:
            self._flushing = False

    def _set_aside_durable(self, batch: list[Outgoing]) -> list[Outgoing]:
        """``batch`` less the requests of durable servings, handed to the durable task."""
        durable = [o for o in batch if o[0].durable]
        if not durable:
            return batch
        self._durable_box += durable
        if self._durable_task is None or self._durable_task.done():
            self._durable_task = asyncio.get_running_loop().create_task(
                self._send_durable(), name=f"queueserve-send-durable-{self.client_id}"
            )
        return [o for o in batch if not o[0].durable]

    async def _send_durable(self) -> None:
        while self._durable_box:
            batch, self._durable_box = self._durable_box, []
            await self._send_batch(batch, self._durable_retry)

    async def _send_batch(self, batch: list[Outgoing], retry: Retry) -> None:
        """Enqueue ``batch``, retrying transient failures; its callers get any error."""
        try:
            await retry.arun(
                functools.partial(self._enqueue, batch), keep_going=lambda: not self._closed,
                give_up_at=time.monotonic() + send_window(batch),
            )
        except QueueServeError as e:
            self._base.fail_batch(batch, e)
        except Exception as e:
            self._base.fail_send(batch, e)

    async def _enqueue(self, batch: list[Outgoing]) -> None:
        for group, keys, requests, max_queue, durable in enqueue_groups(batch):
            try:
                reply = await self.broker.enqueue(keys, requests, max_queue, durable=durable)
            except NotReplicated as e:  # queued, but not safe: these callers are told so
                self._base.fail_batch(group, e)
                continue
            admitted(self.table, group, *reply)

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(
                self._read_inbox(), name=f"queueserve-inbox-{self.client_id}"
            )

    async def _read_inbox(self) -> None:
        retry = Retry(self.broker.outage, "inbox reader")
        while not self._closed:
            try:
                messages = await self.broker.read_inbox(self._base.inbox, INBOX_BLOCK_S)
            except RedisFailure as e:
                await asyncio.sleep(retry.failed(e))
                continue
            retry.succeeded()
            self._base.deliver(messages)

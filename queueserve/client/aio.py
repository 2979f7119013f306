"""The asyncio client: the same methods as ``qs.Client``, awaitable.

Same wire protocol and call table as the sync client; sends are combined the same way (the task
that finds no send in progress sends everything queued), and one task drains the inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

from queueserve.broker.retry import Retry
from queueserve.client.async_sending import AsyncSending
from queueserve.client.base import INBOX_BLOCK_S, ServingRef, timeout_message
from queueserve.client.calls import Call, deadline_after
from queueserve.client.events import RequestStream
from queueserve.client.job_records import job_plan
from queueserve.client.jobs import AsyncJob
from queueserve.client.progress import ProgressCallback
from queueserve.client.targets import Part, Target, in_batches, plan, stream_parts
from queueserve.client.windows import MapWindow, StreamPacer, collect, kept_parts
from queueserve.errors import Cancelled, QueueServeError, Timeout
from queueserve.hooks import Event
from queueserve.wire import protocol as P
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
        self,
        client: AsyncClient,
        target: Target,
        parts: list[Part],
        calls: list[Call],
        futures: list[asyncio.Future[None]],
        timeout: float | None,
    ) -> None:
        self._client = client
        self._target = target
        self._parts = kept_parts(parts)
        self._calls = calls
        self._futures = futures
        self._timeout = timeout

    @property
    def id(self) -> Awaitable[str]:
        """``await ticket.id``: ``Ticket.id``, a job's once it is in Redis."""
        return self._client._sent_id(self._calls)

    def done(self) -> bool:
        return all(c.state != "pending" for c in self._calls)

    async def result(
        self, timeout: float | None = None, *, return_exceptions: bool = False
    ) -> list[Any]:
        limit = (
            self._timeout
            if timeout is None
            else (timeout if self._timeout is None else min(timeout, self._timeout))
        )
        try:
            futures = self._futures
            waiting = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
            await self._client._wait_watched(self._target, waiting, limit)
        except TimeoutError:
            text = await self._client._timeout_text(self._target, limit)
            if limit == self._timeout:  # the request's own deadline: it is over
                self._client._expire(self._calls, text)
            else:
                raise Timeout(text) from None
        return collect(self._target, self._parts, self._calls, return_exceptions)

    def when_done(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once every request of the ticket has ended (answered, failed,
        cancelled or expired), in the event loop."""
        futures = self._futures
        waiting = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
        waiting.add_done_callback(lambda _: callback())

    async def cancel(self) -> bool:
        """Withdraw the request; True when it will never run, in a pack too (False: a worker
        holds it, as ``Ticket.cancel`` says, and its result is dropped)."""
        return all([await self._client._withdraw(call) for call in self._calls])


class AsyncClient(AsyncSending):
    """Dispatch items to servings from asyncio code.

    >>> async with qs.AsyncClient("redis://localhost:6379/0") as client:
    ...     await client.dispatch("square", 2)
    4
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        prefix: str | None = None,
        codec: str | None = None,
        wait_for_worker: bool | None = None,
    ) -> None:
        """``wait_for_worker``: wait for a serving no worker declared yet, not UnknownServing."""
        super().__init__(url, prefix, codec)
        if wait_for_worker is not None:
            self._wait_for_worker = wait_for_worker
        self._reader: asyncio.Task[None] | None = None
        self._events: asyncio.Task[None] | None = None

    async def dispatch(
        self,
        serving: ServingRef,
        item: Any,
        *,
        batch_key: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> Any:
        ticket = await self.submit(
            serving, [item], batch_key=batch_key, timeout=timeout, priority=priority, tenant=tenant
        )
        return (await ticket.result())[0]

    async def dispatch_many(
        self,
        serving: ServingRef,
        items: Iterable[Any],
        *,
        batch_key: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        return_exceptions: bool = False,
        tenant: str | None = None,
    ) -> list[Any]:
        ticket = await self.submit(
            serving, items, batch_key=batch_key, timeout=timeout, priority=priority, tenant=tenant
        )
        return await ticket.result(return_exceptions=return_exceptions)

    async def submit(
        self,
        serving: ServingRef,
        items: Iterable[Any],
        *,
        batch_key: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        keep: float | None = None,
        tenant: str | None = None,
    ) -> AsyncTicket:
        """``Client.submit``: ``keep`` (seconds) makes it a job, followed by ``await ticket.id``."""
        if self._closed:
            raise self._closed_error("AsyncClient")
        timeout = self._timeout_for(timeout)
        priority = P.check_priority(priority)
        target = await self._target(serving)
        parts = plan(target, items if isinstance(items, list) else list(items), batch_key)
        deadline = deadline_after(timeout)
        keep_ms = job_plan(target, parts, keep)
        parts = in_batches(target, parts, job=keep_ms > 0)
        self._jobs_sent = self._jobs_sent or keep_ms > 0
        self._ensure_reader()
        loop = asyncio.get_running_loop()
        calls, futures = [], []
        for outgoing in self._requests(target, parts, deadline, priority, None, keep_ms, tenant):
            future: asyncio.Future[None] = loop.create_future()
            outgoing.call.on_done = lambda _c, f=future: f.done() or f.set_result(None)
            calls.append(outgoing.call)
            futures.append(future)
            self._outbox.append(outgoing)
        if not self._flushing:
            await self._flush()
        return AsyncTicket(self, target, parts, calls, futures, timeout)

    def job(self, job_id: str) -> AsyncJob:
        """``Client.job``: the job ``job_id``, its methods awaited."""
        broker = self._broker
        return AsyncJob(broker.jobs, broker.cancel, self.prefix, job_id, self._trusted_codec)

    async def map(
        self,
        serving: ServingRef,
        items: Iterable[Any],
        *,
        chunk_size: int = 256,
        batch_key: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        max_in_flight: int = 16,
        return_exceptions: bool = False,
        progress: bool = False,
        on_progress: ProgressCallback | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[Any]:
        """Results in input order, ``chunk_size`` items per request, bounded in flight;
        ``progress``/``on_progress`` as in ``Client.map``."""
        window: MapWindow[AsyncTicket] = MapWindow(
            items, chunk_size, max_in_flight, progress, on_progress
        )
        send = functools.partial(self.submit, serving, batch_key=batch_key, tenant=tenant)
        try:
            while True:
                for chunk in window.chunks():
                    window.in_flight.append(await send(chunk, timeout=timeout, priority=priority))
                if not window.in_flight:
                    return
                ticket = window.in_flight.popleft()
                for r in window.done(await ticket.result(return_exceptions=return_exceptions)):
                    yield r
        finally:
            window.meter.close()

    async def stream(
        self,
        serving: ServingRef,
        items: Iterable[Any],
        *,
        batch_key: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        max_in_flight: int = 4,
        tenant: str | None = None,
    ) -> AsyncIterator[Event]:
        """``Client.stream`` for asyncio: ``async for event in client.stream(...)``."""
        timeout = self._timeout_for(timeout)
        priority = P.check_priority(priority)
        target = await self._target(serving)
        todo = deque(stream_parts(target, list(items), batch_key))
        await self._ensure_events()  # subscribed before anything is enqueued
        deadline = deadline_after(timeout)
        window: deque[tuple[RequestStream, asyncio.Queue[Any]]] = deque()
        try:
            while todo or window:
                while todo and len(window) < max_in_flight:
                    offset, part = todo.popleft()
                    events: asyncio.Queue[Any] = asyncio.Queue()
                    rs, outgoing = self._streamed_request(
                        target, offset, part, deadline, events.put_nowait, priority, tenant
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
                self._table.streamed.pop(rs.call.rid, None)
                await self._withdraw(rs.call)

    async def _stream_events(
        self,
        target: Target,
        rs: RequestStream,
        events: asyncio.Queue[Any],
        deadline: float | None,
        timeout: float | None,
    ) -> AsyncIterator[Event]:
        pacer = StreamPacer(rs, deadline)
        try:
            while (wait := pacer.wait()) is None or wait >= 0:
                try:
                    event = await asyncio.wait_for(events.get(), wait)
                except TimeoutError:
                    if pacer.timed_out():
                        raise Timeout(await self._timeout_text(target, timeout)) from None
                    continue
                for ready in pacer.take(event):
                    yield ready
            done, error = pacer.finish()
            for ready in done:
                yield ready
            if error is not None:
                raise error
        finally:
            self._table.streamed.pop(rs.call.rid, None)

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
            raise self._subscribe_failed() from None

    async def _read_events(self, subscribed: asyncio.Event) -> None:
        subscription = self._broker.subscribe(self._events_channel)
        retry = Retry(self._broker.outage, "event subscriber")

        def take(data: bytes | None) -> None:
            if subscription.confirmed:
                subscribed.set()
            self._deliver_event(data)

        try:
            while not self._closed:
                await retry.aonce(functools.partial(subscription.get, timeout=1.0), take)
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
        await self._stop_durable()
        self._table.fail_all(Cancelled("the client was closed before the answer came"))
        await self._broker.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals -------------------------------------------------------------------------
    async def _target(self, serving: ServingRef) -> Target:
        target = self._cached(serving)
        if target is not None:
            return target
        keys = self._meta_keys(serving)
        meta = await self._broker.meta(keys) if keys else {}
        if self._undeclared(keys, meta):
            assert keys is not None
            raise self._unknown(keys.name, await self._broker.servings(self.prefix))
        last = self._last_shard(keys, meta)  # confirms a count of shards over 1
        return self._remember(serving, meta, await self._broker.meta(last) if last else None)

    # -- what AsyncTicket calls: _wait_watched, _timeout_text (and AsyncSending's _expire,
    # _withdraw) --------------------------------------------------------------------------
    async def _timeout_text(self, target: Target, timeout: float | None) -> str:
        return timeout_message(target, timeout, await self._alive(target))

    async def _alive(self, target: Target) -> int | None:
        try:
            return await self._broker.alive_workers(target.keys, ALIVE_WITHIN_S)
        except QueueServeError:
            return None

    async def _wait_watched(
        self, target: Target, waiting: asyncio.Future[Any], limit: float | None
    ) -> None:
        """Await ``waiting`` up to ``limit`` (TimeoutError after), warning once if it waits
        on a serving no worker serves. ``waiting`` itself is never cancelled."""
        first = self._unserved.first_wait(target.keys.name, limit)
        if first is not None:
            try:
                await wait_uncancelled(waiting, first)
                return
            except TimeoutError:
                self._unserved.check(target, await self._alive(target))
                limit = None if limit is None else limit - first
        await wait_uncancelled(waiting, limit)

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(
                self._read_inbox(), name=f"queueserve-inbox-{self.client_id}"
            )

    async def _read_inbox(self) -> None:
        retry = Retry(self._broker.outage, "inbox reader")
        read = functools.partial(self._broker.read_inbox, self._inbox, INBOX_BLOCK_S)
        while not self._closed:
            await retry.aonce(read, self._deliver)


async def job_id_secret(client: AsyncClient) -> bytes:
    """The prefix's key for the job ids gateways hand out (queueserve/gateway/job_ids.py):
    random bytes in Redis, made by the first process that asks."""
    return await client._broker.jobs.secret(P.job_id_key(client.prefix))


async def declare_tenants(client: AsyncClient, weights: Mapping[str, float]) -> None:
    """Write the tenants' weights where the prefix's workers read them (broker/tenants.py)."""
    await client._broker.tenants.declare(client.prefix, weights)

"""The asyncio client: the same methods as ``qs.Client``, awaitable.

Same wire protocol and call table as the sync client; sends are combined the same way (the task
that finds no send in progress sends everything queued), and one task drains the inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from queueserve.broker.retry import Retry
from queueserve.client.async_outbox import AsyncSending
from queueserve.client.async_ticket import AsyncTicket as AsyncTicket
from queueserve.client.caching import cached_plan
from queueserve.client.calls import deadline_after
from queueserve.client.core import INBOX_BLOCK_S, ServingRef
from queueserve.client.events import RequestStream
from queueserve.client.job_handles import AsyncJob
from queueserve.client.once import IdempotencyKey, call_plan, map_key
from queueserve.client.progress import ProgressCallback
from queueserve.client.registry import AsyncRegistry
from queueserve.client.targets import Target, stream_parts
from queueserve.client.windows import MapWindow, StreamPacer
from queueserve.errors import Cancelled, Timeout
from queueserve.hooks import Event
from queueserve.wire.keys import job_id_key
from queueserve.wire.priority import check_priority
from queueserve.wire.timing import RECONNECT_WITHIN_S


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
        self.registry = AsyncRegistry(self._broker, self.prefix)  # what doors ask besides sends

    async def dispatch(
        self,
        serving: ServingRef,
        item: Any,
        *,
        batch_key: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
        idempotency_key: str | None = None,
    ) -> Any:
        ticket = await self.submit(
            serving,
            [item],
            batch_key=batch_key,
            timeout=timeout,
            priority=priority,
            tenant=tenant,
            idempotency_key=idempotency_key,
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
        idempotency_key: IdempotencyKey | None = None,
    ) -> list[Any]:
        ticket = await self.submit(
            serving,
            items,
            batch_key=batch_key,
            timeout=timeout,
            priority=priority,
            tenant=tenant,
            idempotency_key=idempotency_key,
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
        idempotency_key: IdempotencyKey | None = None,
    ) -> AsyncTicket:
        """``Client.submit``: ``keep`` (seconds) makes it a job, followed by ``await ticket.id``;
        ``idempotency_key``: one run per key (``Client.submit``)."""
        if self._closed:
            raise self._closed_error("AsyncClient")
        timeout = self._timeout_for(timeout)
        priority = check_priority(priority)
        target = await self._target(serving)
        items = items if isinstance(items, list) else list(items)
        parts, keep_ms, onces = call_plan(target, items, batch_key, keep, idempotency_key)
        parts, cached = cached_plan(target, parts, keep_ms, onces is not None)
        self._cache_sent = self._cache_sent or cached is not None
        deadline = deadline_after(timeout)
        self._jobs_sent = self._jobs_sent or keep_ms > 0
        self._keys_sent = self._keys_sent or onces is not None
        self._ensure_reader()
        loop = asyncio.get_running_loop()
        calls, futures = [], []
        requests = self._requests(
            target, parts, deadline, priority, None, keep_ms, tenant, onces, cached
        )
        for outgoing in requests:
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
        idempotency_key: Callable[[Any], str] | None = None,
    ) -> AsyncIterator[Any]:
        """Results in input order, ``chunk_size`` items per request, bounded in flight;
        ``progress``/``on_progress`` and ``idempotency_key`` as in ``Client.map``."""
        window: MapWindow[AsyncTicket] = MapWindow(
            items, chunk_size, max_in_flight, progress, on_progress
        )
        key = map_key(idempotency_key)
        send = functools.partial(
            self.submit, serving, batch_key=batch_key, tenant=tenant, idempotency_key=key
        )
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
        priority = check_priority(priority)
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
        closed = Cancelled("the client was closed before the answer came")
        await self._followers.aclose(closed)
        self._table.fail_all(closed)
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
    return await client._broker.jobs.secret(job_id_key(client.prefix))


async def declare_tenants(client: AsyncClient, weights: Mapping[str, float]) -> None:
    """Write the tenants' weights where the prefix's workers read them (broker/tenants.py)."""
    await client._broker.tenants.declare(client.prefix, weights)

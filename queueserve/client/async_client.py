"""The asyncio client: the same methods as ``qs.Client``, awaitable.

Same wire protocol and call table as the sync client; sends are combined the same way (the task
that finds no send in progress sends everything queued), and one task drains the inbox.
``AsyncClient`` holds the same parts as ``Client``: the I/O-free core (core.py), an outbox
(async_outbox.py), an inbox (async_inbox.py) and a jobs part (job_part.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from queueserve.broker.async_producer import AsyncProducer
from queueserve.client.async_inbox import AsyncInbox
from queueserve.client.async_outbox import AsyncOutbox
from queueserve.client.async_ticket import AsyncTicket as AsyncTicket
from queueserve.client.calls import deadline_after
from queueserve.client.core import CallSpec, ClientCore
from queueserve.client.events import RequestStream
from queueserve.client.job_handles import AsyncJob
from queueserve.client.job_part import AsyncJobPart
from queueserve.client.once import IdempotencyKey
from queueserve.client.progress import ProgressCallback
from queueserve.client.registry import AsyncRegistry
from queueserve.client.target_table import ServingRef
from queueserve.client.targets import stream_parts
from queueserve.client.windows import MapWindow, map_sender
from queueserve.errors import Cancelled
from queueserve.hooks import Event
from queueserve.settings import call_timeout
from queueserve.wire.keys import job_id_key
from queueserve.wire.priority import check_priority


class AsyncClient:
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
        self._core = core = ClientCore(url, prefix, codec, wait_for_worker)
        self.url, self.prefix, self.client_id = core.url, core.prefix, core.client_id
        self._broker = AsyncProducer(core.url, owner=core.owner)
        self._jobs = AsyncJobPart(self._broker, core)
        self._outbox = outbox = AsyncOutbox(core, self._broker, self._jobs)
        self._inbox = inbox = AsyncInbox(core, self._broker, outbox)
        # Bound once: the methods every call takes (a submit, a wait, a cancel)
        self._table, self._submit_call, self._send = core.table, outbox.submit, outbox.send
        self._ensure_reader, self._target = inbox.ensure_reader, outbox.target
        self._default_timeout = core.default_timeout
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
        if self._outbox.closed:
            raise self._core.closed_error("AsyncClient")
        timeout = call_timeout(timeout, self._default_timeout)
        priority = check_priority(priority)
        self._ensure_reader()
        spec: CallSpec = (batch_key, timeout, priority, None, keep, tenant, idempotency_key)
        target, parts, calls, futures = await self._submit_call(serving, items, spec)
        return AsyncTicket(self._inbox, target, parts, calls, futures, timeout)

    def job(self, job_id: str) -> AsyncJob:
        """``Client.job``: the job ``job_id``, its methods awaited."""
        return self._jobs.job(job_id)

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
        send = map_sender(self.submit, serving, batch_key, tenant, idempotency_key)
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
        timeout = call_timeout(timeout, self._default_timeout)
        priority = check_priority(priority)
        target = await self._target(serving)
        todo = deque(stream_parts(target, list(items), batch_key))
        await self._inbox.ensure_events()  # subscribed before anything is enqueued
        deadline = deadline_after(timeout)
        window: deque[tuple[RequestStream, asyncio.Queue[Any]]] = deque()
        try:
            while todo or window:
                while todo and len(window) < max_in_flight:
                    offset, part = todo.popleft()
                    events: asyncio.Queue[Any] = asyncio.Queue()
                    rs, outgoing = self._core.streamed_request(
                        target, offset, part, deadline, events.put_nowait, priority, tenant
                    )
                    await self._send([outgoing])
                    window.append((rs, events))
                async for event in self._inbox.stream_events(target, *window[0], deadline, timeout):
                    yield event
                window.popleft()  # only now: leaving mid-request must cancel this one too
        finally:
            for rs, _ in window:  # the caller stopped early: withdraw what is left
                self._table.streamed.pop(rs.call.rid, None)
                await self._outbox.withdraw(rs.call)

    async def aclose(self) -> None:
        """Stop the client's tasks; calls still waiting for an answer fail with Cancelled."""
        if self._outbox.closed:
            return
        await self._outbox.close()
        await self._inbox.close()
        closed = Cancelled("the client was closed before the answer came")
        await self._jobs.close(closed)
        self._table.fail_all(closed)
        await self._broker.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def job_id_secret(client: AsyncClient) -> bytes:
    """The prefix's key for the job ids gateways hand out (queueserve/gateway/job_ids.py):
    random bytes in Redis, made by the first process that asks."""
    return await client._broker.jobs.secret(job_id_key(client.prefix))


async def declare_tenants(client: AsyncClient, weights: Mapping[str, float]) -> None:
    """Write the tenants' weights where the prefix's workers read them (broker/tenants.py)."""
    await client._broker.tenants.declare(client.prefix, weights)

"""The asyncio client's inbox: the task that routes the replies of the client's inbox to their
calls, the event subscriber task of ``stream``, and a caller awaiting its answer, with the
warnings and errors a wait that gets nothing says."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

from queueserve.broker.async_producer import AsyncProducer
from queueserve.broker.retry import Retry
from queueserve.client.async_outbox import AsyncOutbox
from queueserve.client.core import INBOX_BLOCK_S, ClientCore, timeout_message
from queueserve.client.events import RequestStream
from queueserve.client.targets import Target
from queueserve.client.windows import StreamPacer
from queueserve.errors import QueueServeError, Timeout
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


class AsyncInbox:
    """``AsyncClient``'s reader tasks and its callers' waits."""

    def __init__(self, core: ClientCore, broker: AsyncProducer, outbox: AsyncOutbox) -> None:
        self.core = core
        self.outbox = outbox
        self._broker = broker
        self._reader: asyncio.Task[None] | None = None
        self._events: asyncio.Task[None] | None = None

    def ensure_reader(self) -> None:
        """Start the inbox reader task unless it runs."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(
                self._read_inbox(), name=f"queueserve-inbox-{self.core.client_id}"
            )

    async def ensure_events(self) -> None:
        """Subscribe this client's event channel (once), confirmed before anything is sent."""
        if self._events is not None:
            return
        self.ensure_reader()
        subscribed = asyncio.Event()
        self._events = asyncio.get_running_loop().create_task(
            self._read_events(subscribed), name=f"queueserve-events-{self.core.client_id}"
        )
        try:
            await asyncio.wait_for(subscribed.wait(), RECONNECT_WITHIN_S)
        except TimeoutError:
            raise self.core.subscribe_failed() from None

    async def wait_watched(
        self, target: Target, waiting: asyncio.Future[Any], limit: float | None
    ) -> None:
        """Await ``waiting`` up to ``limit`` (TimeoutError after), warning once if it waits
        on a serving no worker serves. ``waiting`` itself is never cancelled."""
        unserved = self.core.unserved
        first = unserved.first_wait(target.keys.name, limit)
        if first is not None:
            try:
                await wait_uncancelled(waiting, first)
                return
            except TimeoutError:
                unserved.check(target, await self._alive(target))
                limit = None if limit is None else limit - first
        await wait_uncancelled(waiting, limit)

    async def stream_events(
        self,
        target: Target,
        rs: RequestStream,
        events: asyncio.Queue[Any],
        deadline: float | None,
        timeout: float | None,
    ) -> AsyncIterator[Event]:
        """The events of one streamed request, in order, until its end; Timeout when
        ``deadline`` passes first."""
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
            self.core.table.streamed.pop(rs.call.rid, None)

    async def timeout_text(self, target: Target, timeout: float | None) -> str:
        """What a caller whose answer did not come within ``timeout`` is told."""
        return timeout_message(target, timeout, await self._alive(target))

    async def close(self) -> None:
        """Stop the reader tasks (the outbox is closed first)."""
        for task in (self._reader, self._events):
            if task is not None:
                task.cancel()
                # redis-py may absorb the cancellation of a blocking read; the loop then sees
                # the close within one BLMPOP timeout.
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(task, 2.0)

    async def _alive(self, target: Target) -> int | None:
        try:
            return await self._broker.alive_workers(target.keys, ALIVE_WITHIN_S)
        except QueueServeError:
            return None

    async def _read_inbox(self) -> None:
        retry = Retry(self._broker.outage, "inbox reader")
        read = functools.partial(self._broker.read_inbox, self.core.inbox, INBOX_BLOCK_S)
        outbox, deliver = self.outbox, self.core.deliver
        while not outbox.closed:
            await retry.aonce(read, deliver)

    async def _read_events(self, subscribed: asyncio.Event) -> None:
        subscription = self._broker.subscribe(self.core.events_channel)
        retry = Retry(self._broker.outage, "event subscriber")
        take = functools.partial(self.core.take_event, subscription, subscribed.set)
        try:
            while not self.outbox.closed:
                await retry.aonce(functools.partial(subscription.get, timeout=1.0), take)
        finally:
            await subscription.aclose()

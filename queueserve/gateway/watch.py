"""Calls withdrawn when their HTTP client disconnects, watched once they are WATCH_AFTER_S old.

Most calls are answered sooner: a watcher task for each cost a tenth of the gateway's CPU per
request, and a timer for each (started with the call, cancelled at its end) a few percent
(bench/gateway.py). Here a call in flight costs an entry in a queue; one task per gateway
looks at the queue every WATCH_AFTER_S and starts a watcher for each call still in flight
that has been for at least that long. A client gone sooner is seen then (the server keeps
the disconnect for ``receive``): its request has run at most twice WATCH_AFTER_S.
"""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.types import Receive

from queueserve.client.async_client import AsyncTicket
from queueserve.gateway.sse import disconnected

WATCH_AFTER_S = 0.05


class Watch:
    """One call's watch: a task once the sweep starts it, none before.

    An ended watch holds nothing of its call: it stays in the sweep's queue for up to
    WATCH_AFTER_S, and the requests it held (ticket, the server's ASGI cycle and scope) stayed
    alive as long, some 500 at a time under 64 callers; let go at the end of each call, the
    gateway's CPU per request is 0.87x (bench/gateway.py, docs/benchmarks.md).
    """

    __slots__ = ("_receive", "_task", "_ticket", "since")

    def __init__(self, receive: Receive, ticket: AsyncTicket, since: float) -> None:
        self._receive: Receive | None = receive
        self._ticket: AsyncTicket | None = ticket
        self.since = since
        self._task: asyncio.Task[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel the call if its client disconnects (nothing once the call has ended)."""
        if self._receive is not None and self._ticket is not None:
            self._task = loop.create_task(cancel_on_disconnect(self._receive, self._ticket))

    def end(self) -> None:
        self._receive = self._ticket = None
        if self._task is not None:
            self._task.cancel()


async def cancel_on_disconnect(receive: Receive, ticket: AsyncTicket) -> None:
    await disconnected(receive)
    await ticket.cancel()


class Watches:
    """The calls in flight, oldest first, and the task that sweeps them (running while there
    are calls: it ends after a sweep that leaves none)."""

    def __init__(self) -> None:
        self._calls: deque[Watch] = deque()
        self._sweeper: asyncio.Task[None] | None = None

    def watch(self, receive: Receive, ticket: AsyncTicket) -> Watch:
        """Watch ``ticket``'s call until ``Watch.end``."""
        loop = asyncio.get_running_loop()
        watch = Watch(receive, ticket, loop.time())
        self._calls.append(watch)
        sweeper = self._sweeper
        if sweeper is None or sweeper.done() or sweeper.get_loop() is not loop:
            self._sweeper = loop.create_task(self._sweep(loop))
        return watch

    async def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        calls = self._calls
        while calls:
            await asyncio.sleep(WATCH_AFTER_S)
            old = loop.time() - WATCH_AFTER_S
            while calls and calls[0].since <= old:
                calls.popleft().start(loop)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

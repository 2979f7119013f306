"""A submitted request of the asyncio client: ``AsyncTicket``, and the wait it awaits with."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from queueserve.client.async_inbox import AsyncInbox
from queueserve.client.calls import Call
from queueserve.client.targets import Part, Target
from queueserve.client.ticket import ticket_id
from queueserve.client.windows import collect, kept_parts
from queueserve.errors import Timeout


class AsyncTicket:
    """A submitted request: ``await .result(timeout)``, ``await .cancel()``, ``.done()``."""

    __slots__ = ("_calls", "_futures", "_parts", "_target", "_timeout", "_waits")

    def __init__(
        self,
        waits: AsyncInbox,
        target: Target,
        parts: list[Part],
        calls: list[Call],
        futures: list[asyncio.Future[None]],
        timeout: float | None,
    ) -> None:
        self._waits = waits  # the client's inbox part; through it, its outbox and core
        self._target = target
        self._parts = kept_parts(parts)
        self._calls = calls
        self._futures = futures
        self._timeout = timeout

    @property
    def id(self) -> Awaitable[str]:
        """``await ticket.id``: ``Ticket.id``, a job's once it is in Redis."""
        return _sent_id(self._waits, self._calls)

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
            await self._waits.wait_watched(self._target, waiting, limit)
        except TimeoutError:
            text = await self._waits.timeout_text(self._target, limit)
            if limit == self._timeout:  # the request's own deadline: it is over
                for call in self._calls:
                    self._waits.core.expire(call, text)
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
        withdraw = self._waits.outbox.withdraw
        return all([await withdraw(call) for call in self._calls])


async def _sent_id(waits: AsyncInbox, calls: list[Call]) -> str:
    """``AsyncTicket.id``: as ``Ticket.id``, a job's once the job is in Redis (with its
    record): from then on the id holds whatever becomes of this process."""
    if calls[0].keep_ms:
        await waits.outbox.until_sent(calls)
    return ticket_id(waits.core.client_id, calls)

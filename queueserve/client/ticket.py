"""A submitted request of the sync client: ``Ticket``."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from queueserve.client.calls import Call
from queueserve.client.inbox import Inbox
from queueserve.client.targets import Part, Target
from queueserve.client.windows import collect, kept_parts
from queueserve.errors import Timeout


def ticket_id(client_id: str, calls: Iterable[Call]) -> str:
    """A ticket's id: ``client_id-request`` of each of its requests (one per batch key); of
    a keyed request answered by its key's first request, that request's job id."""
    return ",".join(c.follows or f"{client_id}-{c.rid}" for c in calls)


class Ticket:
    """A submitted request: ``.result(timeout)``, ``.cancel()``, ``.done()``, ``.id``."""

    __slots__ = ("_calls", "_deadline", "_inbox", "_parts", "_target", "_timeout", "_waits")

    def __init__(
        self,
        waits: Inbox,
        target: Target,
        parts: list[Part],
        calls: list[Call],
        timeout: float | None,
        inbox: str | None = None,
    ) -> None:
        self._waits = waits  # the client's inbox part; through it, its outbox and core
        self._inbox = inbox  # the caller's own inbox, which it reads while it waits
        self._target = target
        self._parts = kept_parts(parts)
        # One call (the common case) kept as itself: a list per ticket in flight is one more
        # object for the garbage collector to walk.
        self._calls: Call | list[Call] = calls[0] if len(calls) == 1 else calls
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout

    @property
    def _each(self) -> list[Call]:
        calls = self._calls
        return [calls] if isinstance(calls, Call) else calls

    @property
    def id(self) -> str:
        """Request id, unique across clients (``client_id-request``; one per batch key). A
        job's (``submit(..., keep=)``) returns once the job is in Redis: from then on any
        process reaches it by this id, whatever becomes of this one."""
        calls = self._each
        if calls[0].keep_ms:
            self._waits.outbox.until_sent(calls)
        return ticket_id(self._waits.core.client_id, calls)

    def done(self) -> bool:
        return all(c.state != "pending" for c in self._each)

    def result(self, timeout: float | None = None, *, return_exceptions: bool = False) -> list[Any]:
        """Results in item order; raises the first item's error unless return_exceptions."""
        calls = self._each
        for call in calls:
            self._wait(call, timeout)
        return collect(self._target, self._parts, calls, return_exceptions)

    def _wait(self, call: Call, timeout: float | None) -> None:
        if call.state != "pending":  # answered already: the common case in a window
            return
        limit = timeout
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            limit = left if limit is None else min(limit, left)
        waits = self._waits
        if waits.wait_watched(self._target, call, limit, self._inbox):
            return
        expired = self._deadline is not None and time.monotonic() >= self._deadline
        if expired:
            waits.core.expire(call, waits.timeout_text(self._target, self._timeout))
            return
        raise Timeout(waits.timeout_text(self._target, timeout))

    def cancel(self) -> bool:
        """Withdraw the request. True when it will never run, also when it shares an entry
        with other requests (a pack: they run on); False when a worker already holds it (it is
        dropped from the batch that would run it, or stops at its next step when it is a step
        or generator request; a batch already running finishes, and its result is dropped),
        or it was on its way to Redis (its send withdraws it as soon as it is there, and it
        never runs), or it had finished.

        >>> ticket = client.submit("square", [1, 2, 3])
        >>> ticket.cancel()
        True
        """
        withdraw = self._waits.outbox.withdraw
        return all([withdraw(call) for call in self._each])

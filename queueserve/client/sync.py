"""The synchronous client: dispatch items to servings from any number of threads.

Sending is combined: a caller that finds no send in progress sends its own request and every
request other threads queued meanwhile, in one Lua call; so one caller pays one round trip and
many concurrent callers share them. One background thread per client drains the client's inbox
and completes calls.

``Client`` is a thin shell over its parts, as ``AsyncClient`` is over the same kinds: the
I/O-free core that plans calls and keeps the call table (core.py), the outbox that sends
(outbox.py), the inbox that waits and routes replies (inbox.py), and the jobs part
(job_part.py).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from queueserve.broker.producer import Producer
from queueserve.client.calls import deadline_after
from queueserve.client.core import CallSpec, ClientCore
from queueserve.client.events import RequestStream
from queueserve.client.inbox import Inbox
from queueserve.client.job_handles import Job
from queueserve.client.job_part import JobPart
from queueserve.client.once import IdempotencyKey
from queueserve.client.outbox import Outbox
from queueserve.client.progress import ProgressCallback
from queueserve.client.target_table import ServingRef
from queueserve.client.targets import stream_parts
from queueserve.client.ticket import Ticket
from queueserve.client.windows import MapWindow, map_sender
from queueserve.errors import Cancelled
from queueserve.hooks import Event
from queueserve.settings import call_timeout
from queueserve.wire.priority import check_priority


class Client:
    """Dispatch items to servings over Redis.

    >>> client = qs.Client("redis://localhost:6379/0")
    >>> client.dispatch("square", 2)
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
        self._broker = Producer(core.url, owner=core.owner)
        self._jobs = JobPart(self._broker, core)
        self._outbox = outbox = Outbox(core, self._broker, self._jobs)
        self._inbox = inbox = Inbox(core, self._broker, outbox)
        # Bound once: the methods every call takes (a submit, a wait, a cancel)
        self._table, self._submit_call, self._send = core.table, outbox.submit, outbox.send
        self._ensure_reader, self._target = inbox.ensure_reader, outbox.target
        self._default_timeout = core.default_timeout

    # -- public API ------------------------------------------------------------------------
    def dispatch(
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
        """Run one item; returns its result or raises its error (``idempotency_key``:
        ``submit``'s)."""
        # The only call in flight: its caller reads the answer itself, from an inbox of its
        # own, as a hand-written XADD + BLPOP would (one thread wake-up less per round trip).
        # Among many concurrent calls the shared inbox and its reader batch the answers. (A
        # keyed call's answer may come from another request's job: not to an inbox.)
        alone = not self._table.calls and idempotency_key is None
        ticket = self._submit(
            serving,
            [item],
            batch_key,
            timeout,
            inline=True,
            priority=priority,
            reply_to=self._core.own_inbox(threading.get_ident()) if alone else None,
            tenant=tenant,
            idempotency_key=idempotency_key,
        )
        return ticket.result()[0]

    def dispatch_many(
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
        """Run items (as requests of at most a batch each); results in item order."""
        ticket = self._submit(
            serving, items, batch_key, timeout, True, priority, None, None, tenant, idempotency_key
        )
        return ticket.result(return_exceptions=return_exceptions)

    def submit(
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
    ) -> Ticket:
        """Send items without waiting, as one request per batch key and batch; returns a Ticket.

        The request is sent by the client's sender thread, together with whatever else is
        queued, so a loop of submits pays no round trip per call.

        ``keep`` (seconds) makes it a job: any process with the same Redis and prefix follows
        it by ``ticket.id`` (``client.job(id)``), and its answer stays in Redis for ``keep``
        after it ends. A job is sent as any submit is; ``ticket.id`` returns once it is in
        Redis, so the id is good in any process from then on, even if this one dies.

        ``tenant`` (a name: letters, digits, ``_-.``) travels in the request's header to the
        worker, its logs, metrics and traces (docs/gateway.md, "Tenants").

        ``idempotency_key`` (a str, or a function of an item: a request per item) runs the
        call once per key and serving: a call of a key sent before, from any process, gets
        the first's job and answer (docs/usage.md, "Idempotency keys")."""
        return self._submit(
            serving,
            items,
            batch_key,
            timeout,
            inline=False,
            priority=priority,
            keep=keep,
            tenant=tenant,
            idempotency_key=idempotency_key,
        )

    def job(self, job_id: str) -> Job:
        """The job ``job_id`` (a ``ticket.id`` of ``submit(..., keep=...)``, from any
        process): its status, progress, result, cancel and forget."""
        return self._jobs.job(job_id)

    def _submit(
        self,
        serving: ServingRef,
        items: Iterable[Any],
        batch_key: str | None,
        timeout: float | None,
        inline: bool,
        priority: int = 0,
        reply_to: str | None = None,
        keep: float | None = None,
        tenant: str | None = None,
        idempotency_key: IdempotencyKey | None = None,
    ) -> Ticket:
        if self._outbox.closed:
            raise self._core.closed_error("Client")
        timeout = call_timeout(timeout, self._default_timeout)
        priority = check_priority(priority)
        self._ensure_reader()
        spec: CallSpec = (batch_key, timeout, priority, reply_to, keep, tenant, idempotency_key)
        target, parts, outgoing = self._submit_call(serving, items, spec, inline)
        inbox = reply_to if len(parts) == 1 else None
        return Ticket(self._inbox, target, parts, [o.call for o in outgoing], timeout, inbox)

    def map(
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
    ) -> Iterator[Any]:
        """Results of ``items`` in input order, sending ``chunk_size`` items per submit (as
        requests of at most a batch) and keeping at most ``max_in_flight`` chunks outstanding
        (constant memory).

        ``progress=True`` draws a tqdm bar (items, items/s, ETA) when stderr is a terminal;
        ``on_progress(done, total)`` is called as results arrive (total None without len()).
        ``idempotency_key``: a function of an item (``submit``).
        """
        window: MapWindow[Ticket] = MapWindow(
            items, chunk_size, max_in_flight, progress, on_progress
        )
        send = map_sender(self.submit, serving, batch_key, tenant, idempotency_key)
        try:
            for chunk in window.chunks():
                window.in_flight.append(send(chunk, timeout=timeout, priority=priority))
            while window.in_flight:
                ticket = window.in_flight.popleft()
                yield from window.done(ticket.result(return_exceptions=return_exceptions))
                for chunk in window.chunks():
                    window.in_flight.append(send(chunk, timeout=timeout, priority=priority))
        finally:
            window.meter.close()

    def stream(
        self,
        serving: ServingRef,
        items: Iterable[Any],
        *,
        batch_key: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        max_in_flight: int = 4,
        tenant: str | None = None,
    ) -> Iterator[Event]:
        """Events of ``items`` as they are produced: ``qs.Hook`` (from ``qs.emit`` in the batch
        function) and ``qs.Output`` (results, or each step of a generator batch function), in
        input order across requests. Items go as requests of at most batch_size (never split).
        An error is raised after the events that preceded it."""
        timeout = call_timeout(timeout, self._default_timeout)
        priority = check_priority(priority)
        target = self._target(serving)
        todo = deque(stream_parts(target, list(items), batch_key))
        self._inbox.ensure_events()  # subscribed before anything is enqueued
        deadline = deadline_after(timeout)
        window: deque[tuple[RequestStream, queue.SimpleQueue[Any]]] = deque()
        try:
            while todo or window:
                while todo and len(window) < max_in_flight:
                    offset, part = todo.popleft()
                    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
                    rs, outgoing = self._core.streamed_request(
                        target, offset, part, deadline, events.put, priority, tenant
                    )
                    self._send([outgoing], inline=True)
                    window.append((rs, events))
                yield from self._inbox.stream_events(target, *window[0], deadline, timeout)
                window.popleft()  # only now: leaving mid-request must cancel this one too
        finally:
            for rs, _ in window:  # the caller stopped early: withdraw what is left
                self._table.streamed.pop(rs.call.rid, None)
                self._outbox.withdraw(rs.call)

    def close(self) -> None:
        """Send what is still queued, stop the client's threads; calls still waiting for an
        answer fail with Cancelled."""
        if self._outbox.closed:
            return
        self._outbox.close()
        self._inbox.close()
        self._outbox.join()
        closed = Cancelled("the client was closed before the answer came")
        self._jobs.close(closed)
        self._table.fail_all(closed)
        self._broker.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

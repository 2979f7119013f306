"""The synchronous client: dispatch items to servings from any number of threads.

Sending is combined: a caller that finds no send in progress sends its own request and every
request other threads queued meanwhile, in one Lua call; so one caller pays one round trip and
many concurrent callers share them. One background thread per client drains the client's inbox
and completes calls.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from queueserve.client.caching import cached_plan
from queueserve.client.calls import deadline_after
from queueserve.client.core import ServingRef
from queueserve.client.events import RequestStream
from queueserve.client.inbox import Waiting
from queueserve.client.job_handles import Job
from queueserve.client.once import IdempotencyKey, call_plan, map_key
from queueserve.client.progress import ProgressCallback
from queueserve.client.targets import Target, stream_parts
from queueserve.client.ticket import Ticket
from queueserve.client.windows import MapWindow, StreamPacer
from queueserve.errors import Cancelled, QueueServeError, Timeout
from queueserve.hooks import Event
from queueserve.wire.priority import check_priority


class Client(Waiting):
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
        super().__init__(url, prefix, codec)
        if wait_for_worker is not None:
            self._wait_for_worker = wait_for_worker

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
            reply_to=self._own_inbox(threading.get_ident()) if alone else None,
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
        broker = self._broker
        return Job(broker.jobs, broker.cancel, self.prefix, job_id, self._trusted_codec)

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
        if self._closed:
            raise self._closed_error("Client")
        timeout = self._timeout_for(timeout)
        priority = check_priority(priority)
        target = self._target(serving)
        items = items if isinstance(items, list) else list(items)
        parts, keep_ms, onces = call_plan(target, items, batch_key, keep, idempotency_key)
        parts, cached = cached_plan(target, parts, keep_ms, onces is not None)
        self._cache_sent = self._cache_sent or cached is not None
        deadline = deadline_after(timeout)
        self._jobs_sent = self._jobs_sent or keep_ms > 0
        self._keys_sent = self._keys_sent or onces is not None
        self._ensure_reader()
        if len(parts) != 1:
            reply_to = None
        outgoing = self._requests(
            target, parts, deadline, priority, reply_to, keep_ms, tenant, onces, cached
        )
        self._send(outgoing, inline)
        return Ticket(self, target, parts, [o.call for o in outgoing], timeout, reply_to)

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
        key = map_key(idempotency_key)
        send = functools.partial(
            self.submit, serving, batch_key=batch_key, tenant=tenant, idempotency_key=key
        )
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
        timeout = self._timeout_for(timeout)
        priority = check_priority(priority)
        target = self._target(serving)
        todo = deque(stream_parts(target, list(items), batch_key))
        self._ensure_events()  # subscribed before anything is enqueued
        deadline = deadline_after(timeout)
        window: deque[tuple[RequestStream, queue.SimpleQueue[Any]]] = deque()
        try:
            while todo or window:
                while todo and len(window) < max_in_flight:
                    offset, part = todo.popleft()
                    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
                    rs, outgoing = self._streamed_request(
                        target, offset, part, deadline, events.put, priority, tenant
                    )
                    self._send([outgoing], inline=True)
                    window.append((rs, events))
                yield from self._stream_events(target, *window[0], deadline, timeout)
                window.popleft()  # only now: leaving mid-request must cancel this one too
        finally:
            for rs, _ in window:  # the caller stopped early: withdraw what is left
                self._table.streamed.pop(rs.call.rid, None)
                self._withdraw(rs.call)

    def _stream_events(
        self,
        target: Target,
        rs: RequestStream,
        events: queue.SimpleQueue[Any],
        deadline: float | None,
        timeout: float | None,
    ) -> Iterator[Event]:
        pacer = StreamPacer(rs, deadline)
        try:
            while (wait := pacer.wait()) is None or wait >= 0:
                try:
                    event = events.get(timeout=wait)
                except queue.Empty:
                    if pacer.timed_out():
                        raise Timeout(self._timeout_text(target, timeout)) from None
                    continue
                yield from pacer.take(event)
            ready, error = pacer.finish()
            yield from ready
            if error is not None:
                raise error
        finally:
            self._table.streamed.pop(rs.call.rid, None)

    def close(self) -> None:
        """Send what is still queued, stop the client's threads; calls still waiting for an
        answer fail with Cancelled."""
        if self._closed:
            return
        self._close_sending()
        if self._reader is not None:
            # Failing that, it sees _closed within one blocking read anyway.
            with contextlib.suppress(QueueServeError):
                self._broker.wake_inbox(self._inbox)
            self._reader.join(timeout=5)
        if self._events is not None:
            self._events.join(timeout=5)
        self._join_senders()
        self._table.fail_all(Cancelled("the client was closed before the answer came"))
        self._broker.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The synchronous client: dispatch items to servings from any number of threads.

Sending is combined: a caller that finds no send in progress sends its own request and every
request other threads queued meanwhile, in one Lua call; so one caller pays one round trip and
many concurrent callers share them. One background thread per client drains the client's inbox
and completes calls.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

from queueserve.broker.retry import Retry
from queueserve.client.base import INBOX_BLOCK_S, ServingRef
from queueserve.client.calls import Call, deadline_after
from queueserve.client.events import RequestStream
from queueserve.client.progress import ProgressCallback
from queueserve.client.sending import Sending
from queueserve.client.targets import Part, Target, plan, stream_parts
from queueserve.client.windows import MapWindow, StreamPacer, collect, kept_parts
from queueserve.errors import Cancelled, QueueServeError, Timeout
from queueserve.hooks import Event
from queueserve.wire import protocol as P
from queueserve.wire.timing import ALIVE_WITHIN_S, RECONNECT_WITHIN_S


class Ticket:
    """A submitted request: ``.result(timeout)``, ``.cancel()``, ``.done()``, ``.id``."""

    __slots__ = ("_calls", "_client", "_deadline", "_inbox", "_parts", "_target", "_timeout")

    def __init__(
        self,
        client: Client,
        target: Target,
        parts: list[Part],
        calls: list[Call],
        timeout: float | None,
        inbox: str | None = None,
    ) -> None:
        self._client = client
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
        """Request id, unique across clients (``client_id-request``; one per batch key)."""
        return ",".join(f"{self._client.client_id}-{c.rid}" for c in self._each)

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
        if self._client._wait_watched(self._target, call, limit, self._inbox):
            return
        expired = self._deadline is not None and time.monotonic() >= self._deadline
        if expired:
            self._client._expire(call, self._target, self._timeout)
            return
        raise Timeout(self._client._timeout_text(self._target, timeout))

    def cancel(self) -> bool:
        """Withdraw the request. True when it will never run; False when a worker already
        holds it or it shares an entry with other requests (a pack: it runs with them; either
        way its result is dropped), or it had finished."""
        return all([self._client._withdraw(call) for call in self._each])


class Client(Sending):
    """Dispatch items to servings over Redis.

    >>> client = qs.Client("redis://localhost:6379/0")
    >>> client.dispatch("square", 2)
    4
    """

    def __init__(
        self, url: str | None = None, *, prefix: str | None = None, codec: str | None = None
    ) -> None:
        super().__init__(url, prefix, codec)
        self._reader: threading.Thread | None = None
        self._events: threading.Thread | None = None
        self._start_lock = threading.Lock()

    # -- public API ------------------------------------------------------------------------
    def dispatch(
        self,
        serving: ServingRef,
        item: Any,
        *,
        batch_key: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> Any:
        """Run one item; returns its result or raises its error."""
        # The only call in flight: its caller reads the answer itself, from an inbox of its
        # own, as a hand-written XADD + BLPOP would (one thread wake-up less per round trip).
        # Among many concurrent calls the shared inbox and its reader batch the answers.
        alone = not self._table.calls
        ticket = self._submit(
            serving,
            [item],
            batch_key,
            timeout,
            inline=True,
            priority=priority,
            reply_to=self._own_inbox(threading.get_ident()) if alone else None,
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
    ) -> list[Any]:
        """Run items as one request; results in item order."""
        ticket = self._submit(serving, items, batch_key, timeout, inline=True, priority=priority)
        return ticket.result(return_exceptions=return_exceptions)

    def submit(
        self,
        serving: ServingRef,
        items: Iterable[Any],
        *,
        batch_key: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> Ticket:
        """Send items as one request (one per batch key) without waiting; returns a Ticket.

        The request is sent by the client's sender thread, together with whatever else is
        queued, so a loop of submits pays no round trip per call."""
        return self._submit(serving, items, batch_key, timeout, inline=False, priority=priority)

    def _submit(
        self,
        serving: ServingRef,
        items: Iterable[Any],
        batch_key: str | None,
        timeout: float | None,
        inline: bool,
        priority: int = 0,
        reply_to: str | None = None,
    ) -> Ticket:
        if self._closed:
            raise self._closed_error("Client")
        timeout = self._timeout_for(timeout)
        priority = P.check_priority(priority)
        target = self._target(serving)
        parts = plan(target, items if isinstance(items, list) else list(items), batch_key)
        deadline = deadline_after(timeout)
        self._ensure_reader()
        if len(parts) != 1:
            reply_to = None
        calls = []
        for part in parts:
            outgoing = self._request(target, part, deadline, priority, reply_to=reply_to)
            calls.append(outgoing.call)
            self._send(outgoing, inline)
        return Ticket(self, target, parts, calls, timeout, reply_to)

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
    ) -> Iterator[Any]:
        """Results of ``items`` in input order, sending ``chunk_size`` items per request and
        keeping at most ``max_in_flight`` requests outstanding (constant memory).

        ``progress=True`` draws a tqdm bar (items, items/s, ETA) when stderr is a terminal;
        ``on_progress(done, total)`` is called as results arrive (total None without len()).
        """
        window: MapWindow[Ticket] = MapWindow(
            items, chunk_size, max_in_flight, progress, on_progress
        )
        try:
            for chunk in window.chunks():
                window.in_flight.append(
                    self.submit(
                        serving, chunk, batch_key=batch_key, timeout=timeout, priority=priority
                    )
                )
            while window.in_flight:
                ticket = window.in_flight.popleft()
                yield from window.done(ticket.result(return_exceptions=return_exceptions))
                for chunk in window.chunks():
                    window.in_flight.append(
                        self.submit(
                            serving, chunk, batch_key=batch_key, timeout=timeout, priority=priority
                        )
                    )
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
    ) -> Iterator[Event]:
        """Events of ``items`` as they are produced: ``qs.Hook`` (from ``qs.emit`` in the batch
        function) and ``qs.Output`` (results, or each step of a generator batch function), in
        input order across requests. Items go as requests of at most batch_size (never split).
        An error is raised after the events that preceded it."""
        timeout = self._timeout_for(timeout)
        priority = P.check_priority(priority)
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
                        target, offset, part, deadline, events.put, priority
                    )
                    self._send(outgoing, inline=True)
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

    def _ensure_events(self) -> None:
        """Subscribe this client's event channel (once) and wait until Redis confirms it."""
        if self._events is not None:
            return
        self._ensure_reader()
        with self._start_lock:
            if self._events is None:
                subscribed = threading.Event()
                thread = threading.Thread(
                    target=self._read_events,
                    args=(subscribed,),
                    name=f"queueserve-events-{self.client_id}",
                    daemon=True,
                )
                thread.start()
                if not subscribed.wait(RECONNECT_WITHIN_S):
                    raise self._subscribe_failed()
                self._events = thread

    def _read_events(self, subscribed: threading.Event) -> None:
        subscription = self._broker.subscribe(self._events_channel)
        retry = Retry(self._broker.outage, "event subscriber")

        def take(data: bytes | None) -> None:
            if subscription.confirmed:
                subscribed.set()
            self._deliver_event(data)

        while not self._closed:
            retry.once(lambda: subscription.get(timeout=0.2), take)  # 0.2: close() seen soon
        subscription.close()

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

    # -- internals -------------------------------------------------------------------------
    def _target(self, serving: ServingRef) -> Target:
        target = self._cached(serving)
        if target is not None:
            return target
        keys = self._meta_keys(serving)
        meta = self._broker.meta(keys) if keys else {}
        last = self._last_shard(keys, meta)  # confirms a count of shards over 1
        return self._remember(serving, meta, self._broker.meta(last) if last else None)

    # -- what Ticket calls: _wait_watched, _expire, _timeout_text, _withdraw --------------
    def _expire(self, call: Call, target: Target, timeout: float | None) -> None:
        """Fail ``call`` with Timeout: its request's own deadline passed."""
        self._table.forget(call)
        call.fail(Timeout(self._timeout_text(target, timeout)))

    def _timeout_text(self, target: Target, timeout: float | None) -> str:
        return self._timeout_message(target, timeout, self._alive(target))

    def _alive(self, target: Target) -> int | None:
        try:
            return self._broker.alive_workers(target.keys, ALIVE_WITHIN_S)
        except QueueServeError:
            return None

    def _wait_watched(
        self, target: Target, call: Call, limit: float | None, inbox: str | None = None
    ) -> bool:
        """``call.wait(limit)``, warning once if it waits on a serving no worker serves;
        reading ``inbox`` meanwhile when the answer goes to the caller's own inbox."""
        wait = call.wait if inbox is None else partial(self._read_own_inbox, inbox, call)
        first = self._unserved.first_wait(target.keys.name, limit)
        if first is not None:
            if wait(first):
                return True
            self._unserved.check(target, self._alive(target))
            limit = None if limit is None else limit - first
        return wait(limit)

    def _read_own_inbox(self, inbox: str, call: Call, limit: float | None) -> bool:
        """Read ``inbox`` until ``call`` is answered (True) or ``limit`` seconds passed."""
        end = None if limit is None else time.monotonic() + limit
        retry = Retry(self._broker.outage, "caller")
        while call.state == "pending":  # close() fails it: seen within one blocking read
            left = INBOX_BLOCK_S if end is None else min(INBOX_BLOCK_S, end - time.monotonic())
            if left <= 0:
                return False
            wait = max(left, 0.001)  # a timeout of 0 would block for ever
            retry.once(partial(self._broker.read_inbox, inbox, wait), self._deliver, most=left)
        return True

    def _ensure_reader(self) -> None:
        if self._reader is not None:
            return
        with self._start_lock:
            if self._reader is None:
                self._start_sender()
                self._reader = threading.Thread(
                    target=self._read_inbox, name=f"queueserve-inbox-{self.client_id}", daemon=True
                )
                self._reader.start()

    def _read_inbox(self) -> None:
        retry = Retry(self._broker.outage, "inbox reader")
        while not self._closed:
            retry.once(lambda: self._broker.read_inbox(self._inbox, INBOX_BLOCK_S), self._deliver)

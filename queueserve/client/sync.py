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

from queueserve.broker.producer import Producer
from queueserve.broker.retry import RedisFailure, Retry
from queueserve.client.base import (
    INBOX_BLOCK_S,
    ClientBase,
    MapWindow,
    Outgoing,
    Part,
    ServingRef,
    StreamPacer,
    Target,
    admitted,
    collect,
    enqueue_groups,
    kept_parts,
    send_window,
)
from queueserve.client.calls import Call, deadline_after
from queueserve.client.events import RequestStream
from queueserve.client.progress import ProgressCallback
from queueserve.errors import Cancelled, NotReplicated, QueueServeError, Timeout
from queueserve.hooks import Event
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
        if self._client.wait_watched(self._target, call, limit, self._inbox):
            return
        expired = self._deadline is not None and time.monotonic() >= self._deadline
        if expired:
            self._client.table.forget(call)
            call.fail(Timeout(self._client.timeout_text(self._target, self._timeout)))
            return
        raise Timeout(self._client.timeout_text(self._target, timeout))

    def cancel(self) -> bool:
        """Withdraw the request. True when it will never run; False when a worker already
        holds it or it shares an entry with other requests (a pack: it runs with them; either
        way its result is dropped), or it had finished."""
        return all([self._client.withdraw(call) for call in self._each])


class Client:
    """Dispatch items to servings over Redis.

    >>> client = qs.Client("redis://localhost:6379/0")
    >>> client.dispatch("square", 2)
    4
    """

    def __init__(
        self, url: str | None = None, *, prefix: str | None = None, codec: str | None = None
    ) -> None:
        self._base = ClientBase(url, prefix, codec)
        self.url = self._base.url
        self.client_id = self._base.client_id
        self.table = self._base.table
        self.broker = Producer(self.url, owner=self._base.owner)
        self._out_lock = threading.Lock()
        self._outbox: list[Outgoing] = []
        self._flushing = False
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._wake_sender = threading.Event()
        # Requests of durable servings wait for a replica (up to DURABLE_WAIT_MS) on a thread
        # of their own, so that wait never holds up the sends of other servings.
        self._durable_box: list[Outgoing] = []
        self._durable_sender: threading.Thread | None = None
        self._wake_durable = threading.Event()
        self._durable_retry = Retry(self.broker.outage, "durable sender")
        self._events: threading.Thread | None = None
        self._closed = False
        self._start_lock = threading.Lock()
        # Inline senders and the sender thread take turns (never two at once): one state.
        self._send_retry = Retry(self.broker.outage, "sender")

    # -- public API ------------------------------------------------------------------------
    def dispatch(
        self, serving: ServingRef, item: Any, *, batch_key: str | None = None,
        timeout: float | None = None, priority: int = 0,
    ) -> Any:
        """Run one item; returns its result or raises its error."""
        # The only call in flight: its caller reads the answer itself, from an inbox of its
        # own, as a hand-written XADD + BLPOP would (one thread wake-up less per round trip).
        # Among many concurrent calls the shared inbox and its reader batch the answers.
        alone = not self.table.calls
        ticket = self._submit(
            serving, [item], batch_key, timeout, inline=True, priority=priority,
            reply_to=self._base.own_inbox(threading.get_ident()) if alone else None,
        )
        return ticket.result()[0]

    def dispatch_many(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, priority: int = 0, return_exceptions: bool = False,
    ) -> list[Any]:
        """Run items as one request; results in item order."""
        ticket = self._submit(serving, items, batch_key, timeout, inline=True, priority=priority)
        return ticket.result(return_exceptions=return_exceptions)

    def submit(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, priority: int = 0,
    ) -> Ticket:
        """Send items as one request (one per batch key) without waiting; returns a Ticket.

        The request is sent by the client's sender thread, together with whatever else is
        queued, so a loop of submits pays no round trip per call."""
        return self._submit(serving, items, batch_key, timeout, inline=False, priority=priority)

    def _submit(
        self, serving: ServingRef, items: Iterable[Any], batch_key: str | None,
        timeout: float | None, inline: bool, priority: int = 0, reply_to: str | None = None,
    ) -> Ticket:
        if self._closed:
            raise self._base.closed_error("Client")
        timeout = self._base.timeout_for(timeout)
        priority = ClientBase.priority(priority)
        target = self._target(serving)
        parts = ClientBase.plan(target, items if isinstance(items, list) else list(items),
                                batch_key)
        deadline = deadline_after(timeout)
        self._ensure_reader()
        if len(parts) != 1:
            reply_to = None
        calls = []
        for part in parts:
            outgoing = self._base.request(target, part, deadline, priority, reply_to=reply_to)
            calls.append(outgoing[2])
            self._send(outgoing, inline)
        return Ticket(self, target, parts, calls, timeout, reply_to)

    def map(
        self, serving: ServingRef, items: Iterable[Any], *, chunk_size: int = 256,
        batch_key: str | None = None, timeout: float | None = None, priority: int = 0,
        max_in_flight: int = 16, return_exceptions: bool = False, progress: bool = False,
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
                    self.submit(serving, chunk, batch_key=batch_key, timeout=timeout,
                                priority=priority)
                )
            while window.in_flight:
                ticket = window.in_flight.popleft()
                yield from window.done(ticket.result(return_exceptions=return_exceptions))
                for chunk in window.chunks():
                    window.in_flight.append(
                        self.submit(serving, chunk, batch_key=batch_key, timeout=timeout,
                                priority=priority)
                    )
        finally:
            window.meter.close()

    def stream(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, priority: int = 0, max_in_flight: int = 4,
    ) -> Iterator[Event]:
        """Events of ``items`` as they are produced: ``qs.Hook`` (from ``qs.emit`` in the batch
        function) and ``qs.Output`` (results, or each step of a generator batch function), in
        input order across requests. Items go as requests of at most batch_size (never split).
        An error is raised after the events that preceded it."""
        timeout = self._base.timeout_for(timeout)
        priority = ClientBase.priority(priority)
        target = self._target(serving)
        todo = deque(ClientBase.stream_parts(target, list(items), batch_key))
        self._ensure_events()  # subscribed before anything is enqueued
        deadline = deadline_after(timeout)
        window: deque[tuple[RequestStream, queue.SimpleQueue[Any]]] = deque()
        try:
            while todo or window:
                while todo and len(window) < max_in_flight:
                    offset, part = todo.popleft()
                    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
                    rs, outgoing = self._base.streamed_request(
                        target, offset, part, deadline, events.put, priority
                    )
                    self._send(outgoing, inline=True)
                    window.append((rs, events))
                yield from self._stream_events(target, *window[0], deadline, timeout)
                window.popleft()  # only now: leaving mid-request must cancel this one too
        finally:
            for rs, _ in window:  # the caller stopped early: withdraw what is left
                self.table.streamed.pop(rs.call.rid, None)
                self.withdraw(rs.call)

    def _stream_events(
        self, target: Target, rs: RequestStream, events: queue.SimpleQueue[Any],
        deadline: float | None, timeout: float | None,
    ) -> Iterator[Event]:
        pacer = StreamPacer(rs, deadline)
        try:
            while (wait := pacer.wait()) is None or wait >= 0:
                try:
                    event = events.get(timeout=wait)
                except queue.Empty:
                    if pacer.timed_out():
                        raise Timeout(self.timeout_text(target, timeout)) from None
                    continue
                yield from pacer.take(event)
            ready, error = pacer.finish()
            yield from ready
            if error is not None:
                raise error
        finally:
            self.table.streamed.pop(rs.call.rid, None)

    def _ensure_events(self) -> None:
        """Subscribe this client's event channel (once) and wait until Redis confirms it."""
        if self._events is not None:
            return
        self._ensure_reader()
        with self._start_lock:
            if self._events is None:
                subscribed = threading.Event()
                thread = threading.Thread(
                    target=self._read_events, args=(subscribed,),
                    name=f"queueserve-events-{self.client_id}", daemon=True,
                )
                thread.start()
                if not subscribed.wait(RECONNECT_WITHIN_S):
                    raise self._base.subscribe_failed()
                self._events = thread

    def _read_events(self, subscribed: threading.Event) -> None:
        subscription = self.broker.subscribe(self._base.events_channel)
        retry = Retry(self.broker.outage, "event subscriber")
        while not self._closed:
            try:
                data = subscription.get(timeout=0.2)  # also how soon close() is seen
            except RedisFailure as e:
                time.sleep(retry.failed(e))
                continue
            retry.succeeded()
            if subscription.confirmed:
                subscribed.set()
            self._base.deliver_event(data)
        subscription.close()

    def close(self) -> None:
        """Send what is still queued, stop the client's threads; calls still waiting for an
        answer fail with Cancelled."""
        if self._closed:
            return
        with self._out_lock:
            unsent = bool(self._outbox) and not self._flushing
            self._flushing = self._flushing or unsent
        if unsent:
            self._flush()
        self._closed = True
        if self._reader is not None:
            # Failing that, it sees _closed within one blocking read anyway.
            with contextlib.suppress(QueueServeError):
                self.broker.wake_inbox(self._base.inbox)
            self._reader.join(timeout=5)
        if self._events is not None:
            self._events.join(timeout=5)
        if self._sender is not None:
            self._wake_sender.set()
            self._sender.join(timeout=5)
        if self._durable_sender is not None:
            self._wake_durable.set()
            self._durable_sender.join(timeout=5)
            with self._out_lock:
                left, self._durable_box = self._durable_box, []
            if left:  # set aside by the flush above, after the durable sender's last look
                self._send_batch(left, self._durable_retry)
        self.table.fail_all(Cancelled("the client was closed before the answer came"))
        self.broker.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _target(self, serving: ServingRef) -> Target:
        target = self._base.cached(serving)
        if target is not None:
            return target
        keys = self._base.meta_keys(serving)
        meta = self.broker.meta(keys) if keys else {}
        last = self._base.last_shard(keys, meta)  # confirms a count of shards over 1
        return self._base.remember(serving, meta, self.broker.meta(last) if last else None)

    def timeout_text(self, target: Target, timeout: float | None) -> str:
        return ClientBase.timeout_message(target, timeout, self._alive(target))

    def _alive(self, target: Target) -> int | None:
        try:
            return self.broker.alive_workers(target.keys, ALIVE_WITHIN_S)
        except QueueServeError:
            return None

    def wait_watched(
        self, target: Target, call: Call, limit: float | None, inbox: str | None = None
    ) -> bool:
        """``call.wait(limit)``, warning once if it waits on a serving no worker serves;
        reading ``inbox`` meanwhile when the answer goes to the caller's own inbox."""
        wait = call.wait if inbox is None else partial(self._read_own_inbox, inbox, call)
        first = self._base.unserved.first_wait(target.keys.name, limit)
        if first is not None:
            if wait(first):
                return True
            self._base.unserved.check(target, self._alive(target))
            limit = None if limit is None else limit - first
        return wait(limit)

    def _read_own_inbox(self, inbox: str, call: Call, limit: float | None) -> bool:
        """Read ``inbox`` until ``call`` is answered (True) or ``limit`` seconds passed."""
        end = None if limit is None else time.monotonic() + limit
        retry = Retry(self.broker.outage, "caller")
        while call.state == "pending":  # close() fails it: seen within one blocking read
            left = INBOX_BLOCK_S if end is None else min(INBOX_BLOCK_S, end - time.monotonic())
            if left <= 0:
                return False
            try:  # a timeout of 0 would block for ever
                messages = self.broker.read_inbox(inbox, max(left, 0.001))
            except RedisFailure as e:
                time.sleep(min(retry.failed(e), left))
                continue
            retry.succeeded()
            self._base.deliver(messages)
        return True

    def _send(self, outgoing: Outgoing, inline: bool) -> None:
        """Queue a request; with ``inline`` (a caller that will wait anyway) send it now from
        this thread, with everything queued meanwhile, unless another thread is sending."""
        with self._out_lock:
            self._outbox.append(outgoing)
            if self._flushing:
                return  # the thread flushing now sends it too
            if not inline:
                if not self._wake_sender.is_set():  # set() takes a lock even when set
                    self._wake_sender.set()
                return
            self._flushing = True
        self._flush()

    def withdraw(self, call: Call) -> bool:
        """Cancel ``call``: True when it will never run (taken out of the outbox before it was
        sent, or out of its stream before a worker read it)."""
        if not self._base.cancel_call(call):
            return False
        with self._out_lock:
            for box in (self._outbox, self._durable_box):
                for i, outgoing in enumerate(box):
                    if outgoing[2] is call:
                        del box[i]
                        return True
        return call.entry_id is not None and self.broker.cancel(
            call.keys, call.keys.stream(call.batch_key, call.priority), call.entry_id, call.n
        )

    def _sender_loop(self) -> None:
        while not self._closed:
            self._wake_sender.wait(1.0)
            self._wake_sender.clear()
            with self._out_lock:
                if self._flushing or not self._outbox:
                    continue
                self._flushing = True
            self._flush()

    def _flush(self) -> None:
        while True:
            with self._out_lock:
                batch, self._outbox = self._outbox, []
                if not batch:
                    self._flushing = False
                    return
            try:
                batch = self._set_aside_durable(batch)
                if batch:
                    self._send_batch(batch, self._send_retry)
            except BaseException:
                with self._out_lock:
                    self._flushing = False
                raise

    def _set_aside_durable(self, batch: list[Outgoing]) -> list[Outgoing]:
        """``batch`` less the requests of durable servings, handed to the durable sender."""
        durable = [o for o in batch if o[0].durable]
        if not durable:
            return batch
        with self._out_lock:
            self._durable_box += durable
            if self._durable_sender is None:
                self._durable_sender = threading.Thread(
                    target=self._durable_loop, name=f"queueserve-send-durable-{self.client_id}",
                    daemon=True,
                )
                self._durable_sender.start()
        self._wake_durable.set()
        return [o for o in batch if not o[0].durable]

    def _durable_loop(self) -> None:
        while not self._closed:
            self._wake_durable.wait(1.0)
            self._wake_durable.clear()
            with self._out_lock:
                batch, self._durable_box = self._durable_box, []
            if batch:
                self._send_batch(batch, self._durable_retry)

    def _send_batch(self, batch: list[Outgoing], retry: Retry) -> None:
        """Enqueue ``batch``, retrying transient failures; its callers get any error."""
        try:
            retry.run(
                lambda: self._enqueue(batch), keep_going=lambda: not self._closed,
                give_up_at=time.monotonic() + send_window(batch),
            )
        except QueueServeError as e:
            self._base.fail_batch(batch, e)
        except Exception as e:
            self._base.fail_send(batch, e)

    def _enqueue(self, batch: list[Outgoing]) -> None:
        for group, keys, requests, max_queue, durable in enqueue_groups(batch):
            try:
                reply = self.broker.enqueue(keys, requests, max_queue, durable=durable)
            except NotReplicated as e:  # queued, but not safe: these callers are told so
                self._base.fail_batch(group, e)
                continue
            admitted(self.table, group, *reply)

    def _ensure_reader(self) -> None:
        if self._reader is not None:
            return
        with self._start_lock:
            if self._reader is None:
                self._sender = threading.Thread(
                    target=self._sender_loop, name=f"queueserve-send-{self.client_id}",
                    daemon=True,
                )
                self._sender.start()
                self._reader = threading.Thread(
                    target=self._read_inbox, name=f"queueserve-inbox-{self.client_id}", daemon=True
                )
                self._reader.start()

    def _read_inbox(self) -> None:
        retry = Retry(self.broker.outage, "inbox reader")
        while not self._closed:
            try:
                messages = self.broker.read_inbox(self._base.inbox, INBOX_BLOCK_S)
            except RedisFailure as e:
                time.sleep(retry.failed(e))
                continue
            retry.succeeded()
            self._base.deliver(messages)

"""The synchronous client: dispatch items to servings from any number of threads.

Sending is combined: a caller that finds no send in progress sends its own request and every
request other threads queued meanwhile, in one Lua call; so one caller pays one round trip and
many concurrent callers share them. One background thread per client drains the client's inbox
and completes calls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import redis

from . import protocol as P
from ._calls import Call, deadline_after, encode_request
from ._client_base import (
    ALIVE_WITHIN,
    ClientBase,
    Outgoing,
    Part,
    ServingRef,
    Target,
    admitted,
    by_serving,
    collect,
    send_window,
)
from ._streams import Event, RequestStream
from .broker import RedisBroker, backoff
from .errors import (
    BadRequest,
    Cancelled,
    QueueServeError,
    RedisUnavailable,
    Timeout,
)
from .progress import Progress, ProgressCallback, total_of

log = logging.getLogger(__name__)

# How long a stream waits, after a request's answer, for events the answer says were sent.
STREAM_GRACE = 0.5



class Ticket:
    """A submitted request: ``.result(timeout)``, ``.cancel()``, ``.done()``, ``.id``."""

    __slots__ = ("_calls", "_client", "_deadline", "_parts", "_target", "_timeout")

    def __init__(
        self,
        client: Client,
        target: Target,
        parts: list[Part],
        calls: list[Call],
        timeout: float | None,
    ) -> None:
        self._client = client
        self._target = target
        self._parts = parts
        self._calls = calls
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout

    @property
    def id(self) -> str:
        """Request id, unique across clients (``client_id-request``; one per batch key)."""
        return ",".join(f"{self._client.client_id}-{c.rid}" for c in self._calls)

    def done(self) -> bool:
        return all(c.state != "pending" for c in self._calls)

    def result(self, timeout: float | None = None, *, return_exceptions: bool = False) -> list[Any]:
        """Results in item order; raises the first item's error unless return_exceptions."""
        for call in self._calls:
            self._wait(call, timeout)
        return collect(self._target, self._parts, self._calls, return_exceptions)

    def _wait(self, call: Call, timeout: float | None) -> None:
        limit = timeout
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            limit = left if limit is None else min(limit, left)
        if call.wait(limit):
            return
        expired = self._deadline is not None and time.monotonic() >= self._deadline
        if expired:
            self._client.table.forget(call)
            call.fail(Timeout(self._client.timeout_text(self._target, self._timeout)))
            return
        raise Timeout(self._client.timeout_text(self._target, timeout))

    def cancel(self) -> bool:
        """Withdraw the request. True when it will never run; False when a worker already
        holds it (its result is then dropped) or it had finished."""
        never_runs = True
        for call in self._calls:
            if call.state != "pending":
                never_runs = False
                continue
            self._client.table.forget(call)
            call.fail(Cancelled(f"request {self._client.client_id}-{call.rid} was cancelled"))
            call.state = "cancelled"
            if self._client.withdraw_unsent(call):
                continue
            if call.entry_id is None or not self._client.broker.cancel(
                call.keys, call.keys.stream(call.batch_key), call.entry_id, call.n
            ):
                never_runs = False
        return never_runs


class Client:
    """Dispatch items to servings over Redis.

    >>> client = qs.Client("redis://localhost:6379/0")
    >>> client.dispatch("square", 2)
    4
    """

    def __init__(self, url: str | None = None, *, prefix: str | None = None) -> None:
        self._base = ClientBase(url, prefix)
        self.url = self._base.url
        self.client_id = self._base.client_id
        self.table = self._base.table
        self.broker = RedisBroker(self.url)
        self._out_lock = threading.Lock()
        self._outbox: list[Outgoing] = []
        self._flushing = False
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._wake_sender = threading.Event()
        self._events: threading.Thread | None = None
        self._events_channel = P.events_channel(self._base.prefix, self.client_id)
        self._closed = False
        self._start_lock = threading.Lock()

    # -- public API ------------------------------------------------------------------------
    def dispatch(
        self, serving: ServingRef, item: Any, *, batch_key: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Run one item; returns its result or raises its error."""
        return self._submit(serving, [item], batch_key, timeout, inline=True).result()[0]

    def dispatch_many(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, return_exceptions: bool = False,
    ) -> list[Any]:
        """Run items as one request; results in item order."""
        ticket = self._submit(serving, items, batch_key, timeout, inline=True)
        return ticket.result(return_exceptions=return_exceptions)

    def submit(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None,
    ) -> Ticket:
        """Send items as one request (one per batch key) without waiting; returns a Ticket.

        The request is sent by the client's sender thread, together with whatever else is
        queued, so a loop of submits pays no round trip per call."""
        return self._submit(serving, items, batch_key, timeout, inline=False)

    def _submit(
        self, serving: ServingRef, items: Iterable[Any], batch_key: str | None,
        timeout: float | None, inline: bool,
    ) -> Ticket:
        if self._closed:
            raise QueueServeError("this client is closed; create a new qs.Client")
        target = self._target(serving)
        items = items if isinstance(items, list) else list(items)
        parts = ClientBase.plan(target, items, batch_key)
        deadline = deadline_after(timeout)
        self._ensure_reader()
        calls = []
        for part in parts:
            call = self.table.new(len(part.items), target.keys, part.batch_key)
            call.deadline = deadline
            header, payload = encode_request(
                target.codec, call.rid, part.items, self._base.inbox, deadline
            )
            try:
                target.check_payload(payload, call.n)
            except BadRequest:
                self.table.forget(call)
                raise
            calls.append(call)
            self._send((target, part.batch_key, call, header, payload), inline)
        return Ticket(self, target, parts, calls, timeout)

    def map(
        self, serving: ServingRef, items: Iterable[Any], *, chunk_size: int = 256,
        batch_key: str | None = None, timeout: float | None = None,
        max_in_flight: int = 16, return_exceptions: bool = False, progress: bool = False,
        on_progress: ProgressCallback | None = None,
    ) -> Iterator[Any]:
        """Results of ``items`` in input order, sending ``chunk_size`` items per request and
        keeping at most ``max_in_flight`` requests outstanding (constant memory).

        ``progress=True`` draws a tqdm bar (items, items/s, ETA) when stderr is a terminal;
        ``on_progress(done, total)`` is called as results arrive (total None without len()).
        """
        if chunk_size < 1 or max_in_flight < 1:
            raise ValueError("chunk_size and max_in_flight must be >= 1")
        meter = Progress(total_of(items), progress, on_progress)
        it = iter(items)
        window: deque[Ticket] = deque()
        try:
            while True:
                while len(window) < max_in_flight:
                    chunk = list(islice(it, chunk_size))
                    if not chunk:
                        break
                    window.append(
                        self.submit(serving, chunk, batch_key=batch_key, timeout=timeout)
                    )
                if not window:
                    return
                results = window.popleft().result(return_exceptions=return_exceptions)
                meter.advance(len(results))
                yield from results
        finally:
            meter.close()

    def stream(
        self, serving: ServingRef, items: Iterable[Any], *, batch_key: str | None = None,
        timeout: float | None = None, max_in_flight: int = 4,
    ) -> Iterator[Event]:
        """Events of ``items`` as they are produced: ``qs.Hook`` (from ``qs.emit`` in the batch
        function) and ``qs.Output`` (results, or each step of a generator batch function), in
        input order across requests. Items go as requests of at most batch_size (never split).
        An error is raised after the events that preceded it."""
        target = self._target(serving)
        parts = ClientBase.stream_parts(target, list(items), batch_key)
        self._ensure_events()  # subscribed before anything is enqueued
        deadline = deadline_after(timeout)
        window: deque[tuple[RequestStream, queue.SimpleQueue[Any]]] = deque()
        todo = deque(parts)
        try:
            while todo or window:
                while todo and len(window) < max_in_flight:
                    offset, part = todo.popleft()
                    window.append(self._submit_streamed(target, offset, part, deadline))
                yield from self._stream_events(target, *window[0], deadline, timeout)
                window.popleft()  # only now: leaving mid-request must cancel this one too
        finally:
            for rs, _ in window:  # the caller stopped early: withdraw what is left
                self.table.streamed.pop(rs.call.rid, None)
                Ticket(self, target, [], [rs.call], None).cancel()

    def _submit_streamed(
        self, target: Target, offset: int, part: Part, deadline: float | None
    ) -> tuple[RequestStream, queue.SimpleQueue[Any]]:
        call = self.table.new(len(part.items), target.keys, part.batch_key)
        call.deadline = deadline
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        call.on_event = lambda seq, body: events.put((seq, body))
        call.on_done = lambda _call: events.put(None)
        self.table.streamed[call.rid] = call
        header, payload = encode_request(
            target.codec, call.rid, part.items, self._base.inbox, deadline, self._events_channel
        )
        target.check_payload(payload, call.n)
        self._send((target, part.batch_key, call, header, payload), inline=True)
        return RequestStream(call, offset), events

    def _stream_events(
        self, target: Target, rs: RequestStream, events: queue.SimpleQueue[Any],
        deadline: float | None, timeout: float | None,
    ) -> Iterator[Event]:
        try:
            while True:  # until the answer
                left = None if deadline is None else max(0.0, deadline - time.time())
                try:
                    event = events.get(timeout=left)
                except queue.Empty:
                    raise Timeout(self.timeout_text(target, timeout)) from None
                if event is None:
                    break
                yield from rs.add(*event)
            grace_end = time.monotonic() + STREAM_GRACE
            while rs.waiting_for_events and (left := grace_end - time.monotonic()) > 0:
                try:
                    event = events.get(timeout=left)
                except queue.Empty:
                    break
                if event is not None:
                    yield from rs.add(*event)
            ready, error = rs.complete()
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
                if not subscribed.wait(30):
                    raise RedisUnavailable(f"could not subscribe to events on Redis at {self.url}")
                self._events = thread

    def _read_events(self, subscribed: threading.Event) -> None:
        pubsub = self.broker.redis.pubsub(  # type: ignore[no-untyped-call]
            ignore_subscribe_messages=False
        )
        attempt = 0
        while not self._closed:
            try:
                if not pubsub.subscribed:
                    pubsub.subscribe(self._events_channel)
                message = pubsub.get_message(timeout=0.2)  # also how soon close() is seen
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("event reader: Redis at %s unavailable (%s); retrying", self.url, e)
                time.sleep(backoff(attempt))
                attempt += 1
                continue
            attempt = 0
            if message is None:
                continue
            if message["type"] == "subscribe":
                subscribed.set()
            elif message["type"] == "message":
                try:
                    self.table.deliver_event(message["data"])
                except Exception:
                    log.exception("dropped an undecodable event on %s", self._events_channel)
        pubsub.close()

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
            try:
                self.broker.redis.rpush(self._base.inbox, b"")  # wakes the reader
                self.broker.redis.pexpire(self._base.inbox, 1000)
            except Exception:
                log.debug("could not wake the inbox reader", exc_info=True)
            self._reader.join(timeout=5)
        if self._events is not None:
            self._events.join(timeout=5)
        if self._sender is not None:
            self._wake_sender.set()
            self._sender.join(timeout=5)
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
        name = serving if isinstance(serving, str) else None
        meta = self.broker.meta(P.Keys(self._base.prefix, name)) if name else {}
        return self._base.remember(serving, meta)

    def timeout_text(self, target: Target, timeout: float | None) -> str:
        try:
            alive: int | None = self.broker.alive_workers(target.keys, ALIVE_WITHIN)
        except RedisUnavailable:
            alive = None
        return ClientBase.timeout_message(target, timeout, alive)

    def _send(self, outgoing: Outgoing, inline: bool) -> None:
        """Queue a request; with ``inline`` (a caller that will wait anyway) send it now from
        this thread, with everything queued meanwhile, unless another thread is sending."""
        with self._out_lock:
            self._outbox.append(outgoing)
            if self._flushing:
                return  # the thread flushing now sends it too
            if not inline:
                self._wake_sender.set()
                return
            self._flushing = True
        self._flush()

    def withdraw_unsent(self, call: Call) -> bool:
        """Take a request out of the outbox before it is sent; False when it is gone already."""
        with self._out_lock:
            for i, outgoing in enumerate(self._outbox):
                if outgoing[2] is call:
                    del self._outbox[i]
                    return True
        return False

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
                self._enqueue_retrying(batch)
            except QueueServeError as e:
                for _, _, call, _, _ in batch:
                    self.table.forget(call)
                    call.fail(e)
            except BaseException:
                with self._out_lock:
                    self._flushing = False
                raise

    def _enqueue_retrying(self, batch: list[Outgoing]) -> None:
        give_up = time.monotonic() + send_window(batch)
        attempt = 0
        while True:
            try:
                self._enqueue(batch)
            except RedisUnavailable as e:
                if time.monotonic() >= give_up or self._closed:
                    raise
                log.warning("sending to Redis: %s; retrying", e)
                time.sleep(backoff(attempt))
                attempt += 1
                continue
            if attempt:
                log.warning("sending to Redis at %s works again", self.url)
            return

    def _enqueue(self, batch: list[Outgoing]) -> None:
        for group in by_serving(batch):
            target = group[0][0]
            requests = [(key, call.n, h, p) for _, key, call, h, p in group]
            admitted(self.table, group, *self.broker.enqueue(target.keys, requests,
                                                               target.max_queue))

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
        attempt = 0
        while not self._closed:
            try:
                messages = self.broker.read_inbox(self._base.inbox, timeout=1.0)
            except RedisUnavailable as e:
                log.warning("inbox reader: %s; retrying", e)
                time.sleep(backoff(attempt))
                attempt += 1
                continue
            if attempt:
                log.warning("inbox reader: Redis at %s is reachable again", self.url)
                attempt = 0
            for message in messages:
                if message:
                    try:
                        self.table.deliver(message)
                    except Exception:
                        log.exception("dropped an undecodable reply in %s", self._base.inbox)

"""The sync client's inbox: the reader thread that routes the replies of the client's inbox to
their calls, the event subscriber thread of ``stream``, and a caller waiting for its answer
(on the shared inbox, or on its own), with the warnings and errors a wait that gets nothing
says."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

from queueserve.broker.producer import Producer
from queueserve.broker.retry import Retry
from queueserve.client.calls import Call
from queueserve.client.core import INBOX_BLOCK_S, ClientCore, timeout_message
from queueserve.client.events import RequestStream
from queueserve.client.outbox import Outbox
from queueserve.client.targets import Target
from queueserve.client.windows import StreamPacer
from queueserve.errors import QueueServeError, Timeout
from queueserve.hooks import Event
from queueserve.wire.timing import ALIVE_WITHIN_S, RECONNECT_WITHIN_S


class Inbox:
    """``Client``'s reader threads and its callers' waits."""

    def __init__(self, core: ClientCore, broker: Producer, outbox: Outbox) -> None:
        self.core = core
        self.outbox = outbox
        self._broker = broker
        self._reader: threading.Thread | None = None
        self._events: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def ensure_reader(self) -> None:
        """Start the inbox reader (and the outbox's sender) unless they run."""
        if self._reader is not None:
            return
        with self._start_lock:
            if self._reader is None:
                self.outbox.start()
                self._reader = threading.Thread(
                    target=self._read_inbox,
                    name=f"queueserve-inbox-{self.core.client_id}",
                    daemon=True,
                )
                self._reader.start()

    def ensure_events(self) -> None:
        """Subscribe this client's event channel (once) and wait until Redis confirms it."""
        if self._events is not None:
            return
        self.ensure_reader()
        with self._start_lock:
            if self._events is None:
                subscribed = threading.Event()
                thread = threading.Thread(
                    target=self._read_events,
                    args=(subscribed,),
                    name=f"queueserve-events-{self.core.client_id}",
                    daemon=True,
                )
                thread.start()
                if not subscribed.wait(RECONNECT_WITHIN_S):
                    raise self.core.subscribe_failed()
                self._events = thread

    def wait_watched(
        self, target: Target, call: Call, limit: float | None, inbox: str | None = None
    ) -> bool:
        """``call.wait(limit)``, warning once if it waits on a serving no worker serves;
        reading ``inbox`` meanwhile when the answer goes to the caller's own inbox."""
        wait = call.wait if inbox is None else partial(self._read_own_inbox, inbox, call)
        unserved = self.core.unserved
        first = unserved.first_wait(target.keys.name, limit)
        if first is not None:
            if wait(first):
                return True
            unserved.check(target, self._alive(target))
            limit = None if limit is None else limit - first
        return wait(limit)

    def stream_events(
        self,
        target: Target,
        rs: RequestStream,
        events: queue.SimpleQueue[Any],
        deadline: float | None,
        timeout: float | None,
    ) -> Iterator[Event]:
        """The events of one streamed request, in order, until its end; Timeout when
        ``deadline`` passes first."""
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
            self.core.table.streamed.pop(rs.call.rid, None)

    def timeout_text(self, target: Target, timeout: float | None) -> str:
        """What a caller whose answer did not come within ``timeout`` is told."""
        return timeout_message(target, timeout, self._alive(target))

    def close(self) -> None:
        """Wake the reader threads (the outbox is closed first) and wait for them to end."""
        if self._reader is not None:
            # Failing that, it sees the close within one blocking read anyway.
            with contextlib.suppress(QueueServeError):
                self._broker.wake_inbox(self.core.inbox)
            self._reader.join(timeout=5)
        if self._events is not None:
            self._events.join(timeout=5)

    def _alive(self, target: Target) -> int | None:
        try:
            return self._broker.alive_workers(target.keys, ALIVE_WITHIN_S)
        except QueueServeError:
            return None

    def _read_own_inbox(self, inbox: str, call: Call, limit: float | None) -> bool:
        """Read ``inbox`` until ``call`` is answered (True) or ``limit`` seconds passed."""
        end = None if limit is None else time.monotonic() + limit
        retry = Retry(self._broker.outage, "caller")
        deliver = self.core.deliver
        while call.state == "pending":  # close() fails it: seen within one blocking read
            left = INBOX_BLOCK_S if end is None else min(INBOX_BLOCK_S, end - time.monotonic())
            if left <= 0:
                return False
            wait = max(left, 0.001)  # a timeout of 0 would block for ever
            retry.once(partial(self._broker.read_inbox, inbox, wait), deliver, most=left)
        return True

    def _read_inbox(self) -> None:
        retry = Retry(self._broker.outage, "inbox reader")
        outbox, inbox, deliver = self.outbox, self.core.inbox, self.core.deliver
        while not outbox.closed:
            retry.once(lambda: self._broker.read_inbox(inbox, INBOX_BLOCK_S), deliver)

    def _read_events(self, subscribed: threading.Event) -> None:
        subscription = self._broker.subscribe(self.core.events_channel)
        retry = Retry(self._broker.outage, "event subscriber")
        take = partial(self.core.take_event, subscription, subscribed.set)
        while not self.outbox.closed:
            retry.once(lambda: subscription.get(timeout=0.2), take)  # 0.2: close() seen soon
        subscription.close()

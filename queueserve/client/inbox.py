"""The sync client's waiting: resolving a serving, the inbox reader and event subscriber
threads, and a caller waiting for its answer (on the shared inbox, or on its own), with the
warnings and errors a wait that gets nothing says. ``Client`` (sync.py) adds the calls."""

from __future__ import annotations

import threading
import time
from functools import partial

from queueserve.broker.retry import Retry
from queueserve.client.calls import Call, check_placed, unsent
from queueserve.client.core import INBOX_BLOCK_S, ServingRef, timeout_message
from queueserve.client.outbox import Sending
from queueserve.client.targets import Target
from queueserve.errors import QueueServeError, Timeout
from queueserve.wire.timing import ALIVE_WITHIN_S, RECONNECT_WITHIN_S

_SENT_POLL_S = 0.0005  # another thread is sending this job: its send takes a round trip


class Waiting(Sending):
    """``Client``'s reader thread and its callers' waits (``Client`` adds the calls)."""

    def __init__(self, url: str | None, prefix: str | None, codec: str | None) -> None:
        super().__init__(url, prefix, codec)
        self._reader: threading.Thread | None = None
        self._events: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def _target(self, serving: ServingRef) -> Target:
        target = self._cached(serving)
        if target is not None:
            return target
        keys = self._meta_keys(serving)
        meta = self._broker.meta(keys) if keys else {}
        if self._undeclared(keys, meta):
            assert keys is not None
            raise self._unknown(keys.name, self._broker.servings(self.prefix))
        last = self._last_shard(keys, meta)  # confirms a count of shards over 1
        return self._remember(serving, meta, self._broker.meta(last) if last else None)

    # -- what Ticket calls: _wait_watched, _expire, _timeout_text, _withdraw --------------
    def _until_sent(self, calls: list[Call]) -> None:
        """Return once the jobs of ``calls`` are enqueued (with their records), sending what
        is queued from this thread if no one is sending; RedisUnavailable when they are still
        being sent after RECONNECT_WITHIN_S (a send that fails fails its calls)."""
        with self._out_lock:
            mine = not self._flushing and bool(self._outbox)
            self._flushing = self._flushing or mine
        if mine:
            self._flush()
        end = time.monotonic() + RECONNECT_WITHIN_S
        while unsent(calls) and time.monotonic() < end:
            time.sleep(_SENT_POLL_S)
        check_placed(calls, RECONNECT_WITHIN_S)

    def _expire(self, call: Call, target: Target, timeout: float | None) -> None:
        """Fail ``call`` with Timeout: its request's own deadline passed."""
        self._table.forget(call)
        call.fail(Timeout(self._timeout_text(target, timeout)))

    def _timeout_text(self, target: Target, timeout: float | None) -> str:
        return timeout_message(target, timeout, self._alive(target))

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

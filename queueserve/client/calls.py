"""The caller's side of requests in flight: building them, and filling them from replies.

Shared by the sync and async clients; only their transport differs. Replies are applied per item:
an item already answered is never answered again, which is what makes redelivered (re-executed)
requests invisible to callers.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from queueserve.errors import Cancelled, QueueServeError, RedisUnavailable
from queueserve.results import unbatch
from queueserve.wire.cache import answer as cache_answer
from queueserve.wire.cache import bad_value_message
from queueserve.wire.codec import Codec, MsgpackCodec
from queueserve.wire.error import raised
from queueserve.wire.event import event_problem, parse_events
from queueserve.wire.keys import Keys
from queueserve.wire.kinds import ERROR, RESULTS
from queueserve.wire.reply import parse_reply

MSGPACK_TAG = MsgpackCodec.tag


class Call:
    """One request in flight: its results so far and a way to wait for all of them."""

    __slots__ = (
        "_waiter",
        "batch_key",
        "cache",
        "deadline",
        "entry_id",
        "error",
        "events_total",
        "filled",
        "follows",
        "group",
        "keep_ms",
        "keys",
        "kind",
        "n",
        "on_done",
        "on_event",
        "once",
        "priority",
        "remaining",
        "results",
        "rid",
        "run",
        "state",
    )

    def __init__(self, rid: int, n: int, keys: Keys, batch_key: str, priority: int = 0) -> None:
        self.rid = rid
        self.n = n
        self.keys = keys
        self.batch_key = batch_key
        self.priority = priority
        # Filled by the answer; a list of n only once a partial answer needs one (most
        # answers come whole, and an empty list per call in flight is one more object the
        # garbage collector walks).
        self.results: list[Any] = _NO_RESULTS
        self.filled = bytearray(n)
        self.remaining = n
        self.error: QueueServeError | None = None  # fails the whole request (not per item)
        self.entry_id: bytes | None = None
        self.deadline: float | None = None  # unix seconds; sending gives up by then
        self.state = "pending"  # pending -> done | cancelled
        self.on_done: Callable[[Call], None] | None = None
        self.on_event: Callable[[int, list[Any]], None] | None = None  # streamed requests
        self.kind = RESULTS  # of the last slice applied (STEPS: a generator's answer)
        self.events_total = 0  # events published before the answer (streamed requests)
        self.run = 0  # the run that answered: 0 its first, else a replay's token (events.py)
        self.keep_ms = 0  # a job's keep (wire/job_record.py): its answer is kept in Redis too
        # When its caller's call went as several requests: the first one's rid (they are
        # admitted together or not at all); 0 for a call of one request
        self.group = 0
        # A request with an idempotency key (client/once.py): (key, digest, TTL ms of its
        # record); ``follows``: the job id whose answer it takes (the key's first request)
        self.once: tuple[str, str, int] | None = None
        self.follows: str | None = None
        # A request of a serving that caches results (client/caching.py): its item's digest
        self.cache: bytes | None = None
        # Made only when a caller waits before the answer came: most calls of a window of
        # submits are answered before their caller looks, and need none.
        self._waiter: threading.Lock | None = None

    def apply(self, offset: int, values: list[Any]) -> None:
        count = len(values)
        end = offset + count
        if self.remaining == self.n and offset == 0 and count == self.n:
            self.results = values
            self.filled[:] = b"\x01" * count
            self.remaining = 0
            return
        if self.results is _NO_RESULTS:
            self.results = [None] * self.n
        if self.filled.count(0, offset, end) == count:
            self.results[offset:end] = values
            self.filled[offset:end] = b"\x01" * count
            self.remaining -= count
        else:  # overlaps an earlier answer: keep the first answer of every item
            for i in range(offset, end):
                if not self.filled[i]:
                    self.filled[i] = 1
                    self.results[i] = values[i - offset]
                    self.remaining -= 1

    def fail(self, error: QueueServeError) -> None:
        if self.state == "pending":
            self.error = error
            self.finish()

    def finish(self) -> None:
        if self.state != "pending":
            return
        # State first, then the waiter; ``wait`` does the reverse. Each thread's step is atomic
        # under the GIL, so either this sees the waiter's lock, or the waiter sees "done".
        self.state = "done"
        waiter = self._waiter
        if waiter is not None:
            waiter.release()
        if self.on_done is not None:
            self.on_done(self)

    def wait(self, timeout: float | None) -> bool:
        if self.state != "pending":
            return True
        waiter = self._waiter
        if waiter is None:
            with _WAITERS:  # two threads waiting on one call share one lock
                waiter = self._waiter
                if waiter is None:
                    waiter = threading.Lock()
                    waiter.acquire()
                    self._waiter = waiter
        if self.state != "pending":
            return True
        if not waiter.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        waiter.release()
        return True


_WAITERS = threading.Lock()
_NO_RESULTS: list[Any] = []  # shared, never filled: see Call.results


class CallTable:
    """Calls by request id, for one client's inbox."""

    def __init__(self) -> None:
        self.calls: dict[int, Call] = {}
        # Streamed calls stay reachable for events until their stream is consumed: events may
        # arrive after the answer (they travel another connection).
        self.streamed: dict[int, Call] = {}
        self._ids = itertools.count(1)
        # Replies are only decoded with codecs this client sent requests with: a client that
        # never chose pickle never unpickles what someone pushed into its inbox.
        self._accepted = {MSGPACK_TAG}

    def accept(self, codec: Codec) -> None:
        self._accepted.add(codec.tag)

    def new(self, n: int, keys: Keys, batch_key: str, priority: int = 0) -> Call:
        call = Call(next(self._ids), n, keys, batch_key, priority)
        self.calls[call.rid] = call
        return call

    def deliver(self, message: bytes) -> None:
        """Apply one reply message (one worker batch's slices for this client)."""
        calls = self.calls
        for rid, offset, count, kind, body, *events_total in parse_reply(message, self._accepted):
            call = calls.get(rid)
            if call is None:  # finished already (a duplicate), cancelled, or not ours
                continue
            if kind == ERROR:
                values = [raised(body)] * count
            else:
                values = unbatch(kind, body)
                call.kind = kind
            if events_total:
                call.events_total = max(call.events_total, events_total[0])
                if len(events_total) > 1 and type(events_total[1]) is int:
                    call.run = events_total[1]
            call.apply(offset, values)
            if call.remaining == 0:
                del calls[rid]
                call.finish()

    def answer_cached(self, call: Call, answer: bytes) -> None:
        """Apply enqueue.lua's answer of a cached request (``HIT`` + the cached value after
        its digest, wire/cache.py): the call ends with its result, or, for a value no worker
        writes, with an error saying so (never another item's answer: enqueue.lua answers
        only from a value bound to this item's digest)."""
        assert call.cache is not None
        self.forget(call)
        call.entry_id = b""  # answered without an entry: nothing to cancel
        try:
            kind, values = cache_answer(answer[1:], self._accepted)
        except ValueError as e:
            entry = call.keys.cached(call.cache.hex())
            call.fail(QueueServeError(bad_value_message(call.keys.name, entry, str(e))))
            return
        call.kind = kind
        call.apply(0, values)
        call.finish()

    def deliver_event(self, message: bytes) -> None:
        """Route streamed events to their calls (pub/sub; events of finished calls drop): one
        event, or the list of one step's events for this client. Events reach the callers'
        own threads, so each is checked here first (anyone who can publish on this client's
        channel can send one); a bad one is dropped, and raised after the others are routed."""
        problem = None
        for event in parse_events(message, self._accepted):
            unnamed = event_problem(event, None)
            if unnamed is not None:
                problem = unnamed
                continue
            call = self.streamed.get(event[0])
            if call is None or call.on_event is None:
                continue
            wrong = event_problem(event, call.n)
            if wrong is None:
                call.on_event(event[1], event[2:])
            else:
                problem = wrong
        if problem is not None:
            raise ValueError(problem)

    def fail_all(self, error: QueueServeError) -> None:
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call.fail(error)

    def forget(self, call: Call) -> None:
        self.calls.pop(call.rid, None)


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.time() + timeout


def outcome(call: Call, return_exceptions: bool) -> list[Any]:
    """The call's results, raising its error (or the first per-item error) unless asked not to."""
    if call.error is not None:
        if return_exceptions:
            return [call.error] * call.n
        raise call.error
    if call.state == "cancelled":
        raise Cancelled(f"request {call.rid} was cancelled")
    if not return_exceptions:
        for r in call.results:
            if isinstance(r, QueueServeError):
                raise r
    return call.results


def unsent(calls: list[Call]) -> bool:
    """Whether a request of ``calls`` is neither in Redis yet nor ended (refused, failed)."""
    return any(c.entry_id is None and c.state == "pending" for c in calls)


def check_placed(calls: list[Call], waited_s: float) -> None:
    """What ``Ticket.id`` ends with for a job: nothing once its requests are in Redis (or
    ended); RedisUnavailable while one is still being sent after ``waited_s``, as its id
    would name no job yet (the send goes on: the ticket still gets its answer)."""
    if unsent(calls):
        raise RedisUnavailable(
            f"the job was not in Redis after {waited_s:g}s of sending (Redis unreachable?): "
            "its id names no job yet; ask for ticket.id again, or follow the ticket"
        )

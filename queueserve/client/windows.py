"""``map``'s window of tickets in flight, ``stream``'s pacing of one request's events, and
results collected back into the caller's item order."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from itertools import islice
from typing import Any, Generic, TypeVar

from queueserve.client.calls import Call, outcome
from queueserve.client.events import RequestStream
from queueserve.client.once import map_key
from queueserve.client.progress import Progress, ProgressCallback, total_of
from queueserve.client.targets import Part, Target
from queueserve.errors import QueueServeError
from queueserve.hooks import Event

# How long a stream waits, after a request's answer, for events the answer says were sent.
STREAM_GRACE = 0.5


TicketT = TypeVar("TicketT")


def map_sender(
    submit: Callable[..., TicketT],
    serving: object,
    batch_key: str | None,
    tenant: str | None,
    idempotency_key: Callable[[Any], str] | None,
) -> Callable[..., TicketT]:
    """``map``'s submit of one chunk (``send(chunk, timeout=, priority=)``), with the options
    every chunk shares; ``idempotency_key`` checked first (``once.map_key``)."""
    key = map_key(idempotency_key)
    return partial(submit, serving, batch_key=batch_key, tenant=tenant, idempotency_key=key)


class MapWindow(Generic[TicketT]):
    """``map``'s bookkeeping: the chunks to send next and the tickets in flight, oldest first."""

    def __init__(
        self,
        items: Iterable[Any],
        chunk_size: int,
        max_in_flight: int,
        progress: bool,
        on_progress: ProgressCallback | None,
    ) -> None:
        if chunk_size < 1 or max_in_flight < 1:
            raise ValueError(
                f"chunk_size and max_in_flight must be >= 1, got {chunk_size} and {max_in_flight}"
            )
        self.meter = Progress(total_of(items), progress, on_progress)
        self._items = iter(items)
        self._chunk_size = chunk_size
        self._max = max_in_flight
        self.in_flight: deque[TicketT] = deque()

    def chunks(self) -> Iterator[list[Any]]:
        """Chunks to submit now (append each ticket to ``in_flight`` before the next)."""
        while len(self.in_flight) < self._max:
            chunk = list(islice(self._items, self._chunk_size))
            if not chunk:
                return
            yield chunk

    def done(self, results: list[Any]) -> list[Any]:
        self.meter.advance(len(results))
        return results


class StreamPacer:
    """When ``stream`` waits for one request's events, and when it stops: until its answer
    (or the deadline), then up to STREAM_GRACE for events the answer says are on their way."""

    def __init__(self, rs: RequestStream, deadline: float | None) -> None:
        self.rs = rs
        self.deadline = deadline
        self.grace_end: float | None = None  # set once the answer came

    def wait(self) -> float | None:
        """Seconds to wait for the next event (None: no limit); negative: stop waiting."""
        if self.grace_end is None:
            return None if self.deadline is None else max(0.0, self.deadline - time.time())
        if not self.rs.waiting_for_events:
            return -1.0
        return self.grace_end - time.monotonic()

    def take(self, event: Any) -> list[Event]:
        """Events ready after ``event`` (None marks the answer)."""
        if event is None:
            self.grace_end = time.monotonic() + STREAM_GRACE
            return []
        return self.rs.add(*event)

    def timed_out(self) -> bool:
        """Waiting ran out: True when the answer never came (the caller gets Timeout)."""
        if self.grace_end is None:
            return True
        self.grace_end = time.monotonic()  # the grace period is over
        return False

    def finish(self) -> tuple[list[Event], QueueServeError | None]:
        return self.rs.complete()


def kept_parts(parts: list[Part]) -> list[Part] | None:
    """What a ticket keeps of its parts: None when one request holds all the items in order,
    its results as they come (a ticket in flight keeps fewer objects for the collector)."""
    return None if len(parts) == 1 and parts[0].positions is None else parts


def collect(
    target: Target, parts: list[Part] | None, calls: list[Call], return_exceptions: bool
) -> list[Any]:
    """Results of finished calls, back in the caller's item order, through map_results;
    ``parts`` as ``kept_parts`` gives them."""
    if parts is None:  # one request: results as they came
        results = outcome(calls[0], return_exceptions)
    else:
        results = [None] * sum(len(p.items) for p in parts)
        for part, call in zip(parts, calls, strict=True):
            assert part.positions is not None
            for pos, r in zip(part.positions, outcome(call, return_exceptions), strict=True):
                results[pos] = r
    serving = target.serving
    if serving is not None and serving.has_client_maps:
        return [r if isinstance(r, QueueServeError) else serving.finish_result(r) for r in results]
    return results

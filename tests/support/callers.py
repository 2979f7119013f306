"""A ``client.stream`` caller in a thread of its own, for the streaming and step-serving tests."""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from typing import Any, cast

import queueserve as qs
from tests.support.helpers import WAIT_S


class Caller:
    """Iterates ``client.stream(...)`` in its own thread and hands each event to the test.

    ``stop_after=n`` closes the stream after n events: the caller goes away mid-stream.
    """

    def __init__(
        self,
        client: qs.Client,
        serving: qs.Serving | str,
        items: list[Any],
        *,
        stop_after: int | None = None,
        **options: Any,
    ) -> None:
        self.received: list[qs.Hook | qs.Output | qs.Restart] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._events: queue.Queue[qs.Hook | qs.Output | qs.Restart] = queue.Queue()
        options.setdefault("timeout", 60)
        self._stream = cast(
            Generator[qs.Hook | qs.Output | qs.Restart, None, None],
            client.stream(serving, items, **options),
        )
        self._stop_after = stop_after
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._stream:
                self.received.append(event)
                self._events.put(event)
                if self._stop_after is not None and len(self.received) >= self._stop_after:
                    break
        except BaseException as e:  # the test looks at it
            self.error = e
        finally:
            self._stream.close()  # what a `break` out of a for loop does, done at once
            self.finished.set()

    def next_event(self) -> qs.Hook | qs.Output | qs.Restart:
        try:
            return self._events.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(
                f"no event within {WAIT_S:g}s; received so far: {self.received}"
            ) from None

    def has_pending_event(self) -> bool:
        return not self._events.empty()

    def join(self) -> list[qs.Hook | qs.Output | qs.Restart]:
        """All events, once the stream ended; re-raises what the stream raised."""
        assert self.finished.wait(WAIT_S), f"stream never ended; got {self.received}"
        self._thread.join(WAIT_S)
        if self.error is not None:
            raise self.error
        return self.received

    def outputs(self) -> list[Any]:
        """Every output value received, in order (one item per request), less what a
        ``qs.Restart`` said to discard, as a caller must."""
        kept: list[tuple[int, Any]] = []  # (the item's position, value)
        for e in self.received:
            if isinstance(e, qs.Restart):
                kept = [(i, v) for i, v in kept if not e.start <= i < e.start + e.size]
            elif isinstance(e, qs.Output):
                kept += [(e.start + k, v) for k, v in enumerate(e.results)]
        return [v for _, v in kept]

"""Each serving's own figures in this partition (wire/figures.py): items, batches, failures,
and histograms of queue time and end to end. The partition's heartbeat carries them in its
registry record every half second, where the dashboard reads them, so a batch costs Redis
nothing more, and two servings of one partition are counted apart (the record's totals are
the partition's, every serving's together).

It counts without prometheus-client, so the dashboard shows the same whether or not the worker
serves /metrics; its buckets are the Prometheus histograms' (LATENCY_BOUNDS).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING

from queueserve.serving import Partition, Serving
from queueserve.steps import StepServing
from queueserve.wire.figures import FAILURE_KINDS, LATENCY_BOUNDS, Figures, field_of
from queueserve.worker.metrics import since_enqueue
from queueserve.worker.middleware import Middleware

if TYPE_CHECKING:
    from queueserve.worker.pipeline.batching import Slice


class ServingFigures(Middleware):
    """Counts what each serving of this partition ran; ``fields()`` for its heartbeat."""

    def __init__(self, servings: Sequence[Serving] = ()) -> None:
        # Hooks come from each serving's execute and reply threads: one lock, held for a few
        # additions per batch or reply
        self._lock = threading.Lock()
        # Every serving from the start: an idle one says 0, not nothing
        self._figures: dict[str, Figures] = {s.name: Figures() for s in servings}

    def _of(self, serving: Serving) -> Figures:
        found = self._figures.get(serving.name)
        if found is None:
            found = self._figures[serving.name] = Figures()
        return found

    def batch_opened(
        self, serving: Serving, key: str, partition: Partition, slices: Sequence[Slice]
    ) -> None:
        if isinstance(serving, StepServing):  # decode steps, not arrivals
            return
        now = time.time()
        waits = [
            bisect_left(LATENCY_BOUNDS, since_enqueue(piece.request.entry_id, now))
            for piece in slices
            if piece.offset == 0  # a request's first batch (a split one has several)
        ]
        with self._lock:
            counts = self._of(serving).queue_time
            for i in waits:
                counts[i] += 1

    def batch_finished(
        self, serving: Serving, key: str, partition: Partition, size: int, seconds: float
    ) -> None:
        with self._lock:
            self._of(serving).batches += 1

    def replied(self, serving: Serving, items: int, requests: int, errors: dict[str, int]) -> None:
        failed = sum(n for kind, n in errors.items() if kind in FAILURE_KINDS)
        with self._lock:
            figures = self._of(serving)
            figures.items += items
            figures.failures += failed

    def requests_answered(self, serving: Serving, entry_ids: Sequence[bytes]) -> None:
        now = time.time()
        ends = [bisect_left(LATENCY_BOUNDS, since_enqueue(e, now)) for e in entry_ids]
        with self._lock:
            counts = self._of(serving).end_to_end
            for i in ends:
                counts[i] += 1

    def fields(self) -> dict[str, str]:
        """The record's field of each serving, with its figures."""
        with self._lock:
            return {field_of(name): f.encode() for name, f in self._figures.items()}

"""Running one batch: preparation and the batch function, poison isolation, and per-caller
reply rows."""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from queueserve.results import BatchResultError, BatchResults
from queueserve.serving import Batch, Partition, Serving
from queueserve.wire.error import error_body
from queueserve.wire.kinds import ERROR
from queueserve.wire.tenants import split_lane
from queueserve.worker.pipeline.batching import Request, Slice

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Unfinished:
    """What handle_batch returned, for ``finish_batch`` to turn into results off the device's
    thread (the replier's)."""

    batch: Batch
    output: Any

    def finish(self, serving: Serving) -> BatchResults | list[str]:
        """The checked results, or the error body for the whole segment: finishing cannot be
        bisected without running the device again."""
        try:
            return serving.results(self.batch, self.output)
        except Exception as e:
            return error_body(e)


@dataclass(slots=True)
class Part:
    """Items ``start:start+count`` of a batch as the preparation stage left them: prepared
    together (``prepared``), or failed (``error``, the wire error body)."""

    start: int
    count: int
    prepared: Any = None
    error: list[str] | None = None


# Marks a part whose preparation has not run yet (None is a valid prepared value).
NOT_PREPARED: Any = object()

# (start, count, outcome) over a batch's items; outcome is results, an error body, or an
# output still to be finished (Done: finished).
Segment = tuple[int, int, BatchResults | list[str] | Unfinished]
Done = tuple[int, int, BatchResults | list[str]]
# What the replier sends for one slice: request, offset in the request, count, kind, body.
Row = tuple[Request, int, int, int, Any]


def is_out_of_memory(e: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError (or torch's older RuntimeError wording), without importing
    torch for servings that do not use it."""
    if type(e).__name__ == "OutOfMemoryError" and type(e).__module__.startswith("torch"):
        return True
    return isinstance(e, RuntimeError) and "CUDA out of memory" in str(e)


def _free_device_memory() -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


Drive = Callable[[Iterator[Any], int], list[Segment]]


def prepare_isolated(
    serving: Serving,
    items: list[Any],
    key: str,
    partition: Partition,
    start: int = 0,
    state: Any = None,
) -> list[Part]:
    """Prepare ``items`` as one batch. When prepare_batch raises and on_error is "isolate",
    bisect, so only the failing items get the error and the healthy ones are prepared in
    parts (each part then runs on the device as a batch of its own)."""
    try:
        batch = Batch(items, split_lane(key)[0], partition, state=state)
        return [Part(start, len(items), serving.prepare_batch(batch))]
    except Exception as e:
        if len(items) == 1 or serving.on_error == "fail":
            return [Part(start, len(items), error=error_body(e))]
        mid = _bisecting("preparing a batch", serving, key, items, e)
        return prepare_isolated(
            serving, items[:mid], key, partition, start, state
        ) + prepare_isolated(serving, items[mid:], key, partition, start + mid, state)


def _bisecting(what: str, serving: Serving, key: str, items: list[Any], e: Exception) -> int:
    """Where a failing batch is cut in two (each half then runs alone), logged."""
    log.debug(
        "serving %s key %s: %s of %d raised %r; bisecting", serving.name, key, what, len(items), e
    )
    return len(items) // 2


def run_isolated(
    serving: Serving,
    items: list[Any],
    key: str,
    partition: Partition,
    drive: Drive,
    start: int = 0,
    prepared: Any = NOT_PREPARED,
    state: Any = None,
) -> list[Segment]:
    """Run ``items`` (``prepared`` is what prepare_batch made of them; a serving with a
    preparation stage prepares the halves of a bisected batch again, here). Out of device
    memory, halve the batch and retry, down to one item. When the batch raises and on_error
    is "isolate", bisect it so only the failing items get the error and every healthy item
    still gets its result. A generator batch function is run by ``drive`` (its steps were
    already sent, so it is never re-run). With a ``finish_batch``, outputs come back
    unfinished: the replier finishes them. ``state``: the key's state (``batch.state``)."""
    batch = Batch(items, split_lane(key)[0], partition, state=state)  # a lane: its batch key
    try:
        if serving.has_prepare:
            batch.prepared = serving.prepare_batch(batch) if prepared is NOT_PREPARED else prepared
        output = serving.handle_batch(batch)
        if isinstance(output, types.GeneratorType):
            return [(start + a, n, o) for a, n, o in drive(output, len(items))]
        if serving.has_finish:
            return [(start, len(items), Unfinished(batch, output))]
        results = BatchResults(output, len(items), serving.name)
    except BatchResultError as e:  # the function's contract is broken for the whole batch
        return [(start, len(items), error_body(e))]
    except Exception as e:
        oom = is_out_of_memory(e)
        if len(items) == 1 or (serving.on_error == "fail" and not oom):
            return [(start, len(items), error_body(e))]
        if oom:
            _free_device_memory()
            log.warning(
                "serving %s key %s partition %d: out of memory on a batch of %d; halving",
                serving.name,
                key,
                partition.index,
                len(items),
            )
            mid = len(items) // 2
        else:
            mid = _bisecting("a batch", serving, key, items, e)
        return run_isolated(
            serving, items[:mid], key, partition, drive, start, state=state
        ) + run_isolated(serving, items[mid:], key, partition, drive, start + mid, state=state)
    return [(start, len(items), results)]


def finish_segments(serving: Serving, segments: list[Segment]) -> list[Done]:
    """Segments with their unfinished outputs finished (on the replier's thread)."""
    return [(a, n, o.finish(serving) if isinstance(o, Unfinished) else o) for a, n, o in segments]


def rows_for(slices: list[Slice], segments: list[Done]) -> list[Row]:
    """Cut batch-wide segments into one reply row per (slice, segment) overlap."""
    if len(segments) == 1 and isinstance(segments[0][2], BatchResults):
        results = segments[0][2]
        rows: list[Row] = []
        pos = 0
        for s in slices:
            n = len(s.items)
            kind, body = results.body(pos, n)
            rows.append((s.request, s.offset, n, kind, body))
            pos += n
        return rows
    rows = []
    pos = 0
    for s in slices:
        a, b = pos, pos + len(s.items)
        pos = b
        for seg_start, seg_count, outcome in segments:
            lo, hi = max(a, seg_start), min(b, seg_start + seg_count)
            if lo >= hi:
                continue
            if isinstance(outcome, list):
                rows.append((s.request, s.offset + lo - a, hi - lo, ERROR, outcome))
            else:
                kind, body = outcome.body(lo - seg_start, hi - lo)
                rows.append((s.request, s.offset + lo - a, hi - lo, kind, body))
    return rows


def error_rows(slices: list[Slice], body: list[str]) -> list[Row]:
    return [(s.request, s.offset, len(s.items), ERROR, body) for s in slices]

"""Running one batch: the batch function, poison isolation, and per-caller reply rows."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from . import protocol as P
from ._calls import error_to_wire
from .batching import Request, Slice
from .results import BatchResultError, BatchResults
from .serving import Batch, Partition, Serving

log = logging.getLogger(__name__)

# (start, count, outcome) over a batch's items; outcome is results, or an error body.
Segment = tuple[int, int, BatchResults | list[str]]
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


def run_isolated(
    serving: Serving, items: list[Any], key: str, partition: Partition, drive: Drive,
    start: int = 0,
) -> list[Segment]:
    """Run ``items``. Out of device memory, halve the batch and retry, down to one item. When
    the batch raises and on_error is "isolate", bisect it so only the failing items get the
    error and every healthy item still gets its result. A generator batch function is run by
    ``drive`` (its steps were already sent, so it is never re-run)."""
    try:
        results = serving.run_batch(Batch(items, key, partition))
        if not isinstance(results, BatchResults):
            return [(start + a, n, o) for a, n, o in drive(results, len(items))]
    except BatchResultError as e:  # the function's contract is broken for the whole batch
        return [(start, len(items), error_to_wire(e))]
    except Exception as e:
        oom = is_out_of_memory(e)
        if len(items) == 1 or (serving.on_error == "fail" and not oom):
            return [(start, len(items), error_to_wire(e))]
        if oom:
            _free_device_memory()
            log.warning(
                "serving %s key %s partition %d: out of memory on a batch of %d; halving",
                serving.name, key, partition.index, len(items),
            )
        else:
            log.debug(
                "serving %s key %s: batch of %d raised %r; bisecting",
                serving.name, key, len(items), e,
            )
        mid = len(items) // 2
        return run_isolated(serving, items[:mid], key, partition, drive, start) + run_isolated(
            serving, items[mid:], key, partition, drive, start + mid
        )
    return [(start, len(items), results)]


def rows_for(slices: list[Slice], segments: list[Segment]) -> list[Row]:
    """Cut batch-wide segments into one reply row per (slice, segment) overlap."""
    if len(segments) == 1 and not isinstance(segments[0][2], list):
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
                rows.append((s.request, s.offset + lo - a, hi - lo, P.ERROR, outcome))
            else:
                kind, body = outcome.body(lo - seg_start, hi - lo)
                rows.append((s.request, s.offset + lo - a, hi - lo, kind, body))
    return rows


def error_rows(slices: list[Slice], body: list[str]) -> list[Row]:
    return [(s.request, s.offset, len(s.items), P.ERROR, body) for s in slices]

"""Identical items waiting in one batch run once: a serving that caches results names each
item by its digest (``Request.cache``, wire/cache.py), and the requests of one batch whose
items share a digest (same bytes, batch key and cache_version) are run as the first of them;
each other one gets a copy of its answer (a result or an error alike)."""

from __future__ import annotations

import inspect

from queueserve.serving import Serving
from queueserve.worker.pipeline.batching import Slice
from queueserve.worker.pipeline.execute import Row

# (a slice left out of the batch, the slice whose answer it gets)
Dupe = tuple[Slice, Slice]


def unique(serving: Serving, slices: list[Slice]) -> tuple[list[Slice], list[Dupe]]:
    """``slices`` less each one whose item another before it has, and those left out. Not
    for a generator batch function: its steps go to the callers of the batch as they come
    (batch_context.py), and some are answered whole before the batch ends, which a slice
    left out would never see."""
    if any(map(inspect.isgeneratorfunction, (serving.fn, type(serving).handle_batch))):
        return slices, []
    first: dict[bytes, Slice] = {}
    kept: list[Slice] = []
    dupes: list[Dupe] = []
    for piece in slices:
        digest = piece.request.cache
        if digest is None:
            kept.append(piece)
            continue
        original = first.get(digest)
        if original is None:
            first[digest] = piece
            kept.append(piece)
        else:
            dupes.append((piece, original))
    return kept, dupes


def fan_out(rows: list[Row], dupes: list[Dupe]) -> list[Row]:
    """``rows`` and, for each slice left out, the rows of the one it was run as (a cached
    request holds one item: its original's rows answer it whole)."""
    by_request: dict[int, list[Row]] = {}
    for row in rows:
        by_request.setdefault(id(row[0]), []).append(row)
    out = list(rows)
    for dupe, original in dupes:
        for _, _, count, kind, body in by_request.get(id(original.request), ()):
            out.append((dupe.request, dupe.offset, count, kind, body))
    return out

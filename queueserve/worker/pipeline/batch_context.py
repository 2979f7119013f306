"""A running batch's callers: where its hook events (``qs.emit``) and generator steps go.

While a batch runs, the executor installs its ``BatchContext`` as the hook sink
(``queueserve.hooks.running``), so ``qs.emit`` called from the batch function's thread knows which
callers' items are in the batch. Events are
not sent from the executor: they go to the replier in order, which publishes them on each
caller's pub/sub channel before it writes the durable replies of the same batch. Each event of
a request carries a sequence number, and its durable reply the count of events sent before it,
so the caller can order events across partitions and notice lost ones; a replay's events follow
a restart marker (``event_rows``).

A generator batch function yields steps: one entry per item of the batch (a list, or an
array/tensor whose first axis is the batch). ``qs.END`` in an item's place ends that item,
``qs.NO_OUTPUT`` there gives nothing for that item in this step (it goes on); a
request whose items have all ended is answered at once, while the batch goes on for the others.
Each item's result is the list of its step values.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

from queueserve.hooks import END, NO_OUTPUT
from queueserve.results import BatchResults
from queueserve.wire.cancel import CancelKey
from queueserve.wire.error import error_body
from queueserve.wire.event import hook_event, output_event, restart_event
from queueserve.wire.kinds import DROP, EVENT, JOB_HOOK, STEPS
from queueserve.worker.pipeline.batching import Request, Slice
from queueserve.worker.pipeline.execute import Row, Segment
from queueserve.worker.pipeline.ledger import cancel_key


class BatchContext:
    """What a running batch knows about its callers, for hooks and generator steps."""

    def __init__(
        self,
        hooks: frozenset[str] | None,
        slices: list[Slice],
        sink: Callable[[list[Row]], None],
        cancelled: set[CancelKey],
        serving: str,
    ) -> None:
        self.hooks = hooks
        self.slices = slices
        self.sink = sink
        self.cancelled = cancelled
        self.serving = serving
        self.finished: set[int] = set()  # ids of requests answered before the batch ended

    def _positions(self) -> Iterator[tuple[int, Slice]]:
        pos = 0
        for s in self.slices:
            yield pos, s
            pos += len(s.items)

    def hook(self, name: str, payload: Any) -> None:
        if self.hooks is None or name not in self.hooks:
            return
        rows: list[Row] = []
        for start, s in self._positions():
            if id(s.request) in self.finished:
                continue
            if s.request.events:
                rows += event_rows(s.request, hook_event(name, payload, start, len(s.items)))
            elif s.request.fields is not None and "job_keep" in s.request.fields:
                # a job's progress keeps its last hook event (wire/job_record.py, field r.h)
                body = hook_event(name, payload, start, len(s.items))
                rows.append((s.request, 0, 0, JOB_HOOK, body))
        if rows:
            self.sink(rows)

    def drive(self, steps: Iterator[Any], size: int) -> list[Segment]:
        """Run a generator batch function to its end; returns segments of per-item step lists
        (or the error) for the requests not answered early."""
        values: list[list[Any]] = [[] for _ in range(size)]
        ended = [False] * size
        try:
            for step in steps:
                self._step(step, size, values, ended)
                if all(ended):
                    break
        except Exception as e:
            error = error_body(e)
            return [
                (i, 1, BatchResults([values[i]], 1, self.serving, STEPS) if ended[i] else error)
                for i in range(size)
            ]
        return [(0, size, BatchResults(values, size, self.serving, STEPS))]

    def _step(self, step: Any, size: int, values: list[list[Any]], ended: list[bool]) -> None:
        items = BatchResults(step, size, self.serving).as_list()
        rows: list[Row] = []
        for start, s in self._positions():
            request = s.request
            if id(request) in self.finished:
                continue
            if self.cancelled and cancel_key(request) in self.cancelled:  # its caller left
                self.finished.add(id(request))
                rows.append((request, s.offset, len(s.items), DROP, None))
                continue
            rows += self._slice_step(s, start, items, values, ended)
        if rows:
            self.sink(rows)

    def _slice_step(
        self, s: Slice, start: int, items: list[Any], values: list[list[Any]], ended: list[bool]
    ) -> list[Row]:
        """One slice's share of a step: its Output events, and its answer once all ended."""
        request, end = s.request, start + len(s.items)
        rows: list[Row] = []
        for run_start, run in _active_runs(items, ended, start, len(s.items)):
            for i, v in enumerate(run):
                values[run_start + i].append(v)
            if request.events:
                first = s.offset + run_start - start
                rows += event_rows(request, output_event(run, first))
        for i in range(start, end):
            ended[i] = ended[i] or items[i] is END
        if all(ended[start:end]):
            self.finished.add(id(request))
            rows.append((request, s.offset, len(s.items), STEPS, values[start:end]))
        return rows

    def unfinished(self) -> list[Slice]:
        return [s for s in self.slices if id(s.request) not in self.finished]


def _active_runs(
    items: list[Any], ended: list[bool], start: int, count: int
) -> Iterator[tuple[int, list[Any]]]:
    """Contiguous runs of items in ``start:start+count`` that have a value in this step."""
    run: list[Any] = []
    run_start = start
    for i in range(start, start + count):
        if ended[i] or items[i] is END or items[i] is NO_OUTPUT:
            if run:
                yield run_start, run
            run, run_start = [], i + 1
        else:
            run.append(items[i])
    if run:
        yield run_start, run


def event_rows(request: Request, body: list[Any]) -> list[Row]:
    """The rows that publish event ``body`` of ``request``. The first event of a replay (a
    request redelivered after its worker died or stalled) goes after a restart marker: another
    run may have streamed to the caller already, and with sampling this one need not say the
    same. The marker tells the caller to discard that and to follow this run's events, which
    carry a token of its own, as its answer does (client/events.py): a caller never sees two
    runs spliced, and what it keeps adds up to the answer it gets."""
    rows = []
    if (request.redelivered or request.replay) and not request.run:
        request.run = secrets.randbits(62) + 1  # not `random`: a serving may seed that
        rows.append(_numbered(request, restart_event(request.run)))
    if request.run:
        body.append(request.run)
    rows.append(_numbered(request, body))
    return rows


def _numbered(request: Request, body: list[Any]) -> Row:
    seq = request.events_sent
    request.events_sent += 1
    return (request, seq, 0, EVENT, body)

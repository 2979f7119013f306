"""Hook events and partial outputs: what a batch function sends while it runs, and what a
caller of ``client.stream`` receives.

Inside a batch function, ``qs.emit(name, payload)`` sends a hook event to every caller whose
items are in the batch, and a generator batch function yields steps, with ``qs.END`` in an item's
place to end that item (``qs.NO_OUTPUT`` there: nothing from that item this step). The worker
installs the running batch's sink (``running``) around the batch function; inline runs install
none, so ``emit`` there reaches nobody.

A caller receives ``Hook`` and ``Output`` events, in the order the worker produced them, and a
``Restart`` when a request's run was replaced by a replay.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Final, Protocol


@dataclass(frozen=True, slots=True)
class Hook:
    """A hook event from the batch function (``qs.emit``); ``start``/``size`` locate this
    caller's items in the batch, to pick them out of a batch-wide payload."""

    name: str
    payload: Any
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class Output:
    """Results for this caller's items ``start:start+size`` (positions in the items given to
    ``stream``): the whole answer, or one step of a generator batch function."""

    results: list[Any]
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class Restart:
    """The request of this caller's items ``start:start+size`` runs again from its first step:
    the worker running it died (or stalled) mid-stream and another took it over. Discard what
    was streamed for those items; the events that follow are the new run's, and the answer
    is the one they lead to. A run with sampling need not repeat what the aborted run said,
    so a stream never splices two runs (docs/streaming.md, Replays)."""

    start: int
    size: int


Event = Hook | Output | Restart


class _End:
    __slots__ = ()

    def __repr__(self) -> str:
        return "qs.END"


END: Final = _End()
"""Yield in an item's place from a generator batch function to end that item's stream."""


class _NoOutput:
    __slots__ = ()

    def __repr__(self) -> str:
        return "qs.NO_OUTPUT"


NO_OUTPUT: Final = _NoOutput()
"""Yield (or return from a step serving's ``decode``) in an item's place when that item goes on
but has nothing to show this step, e.g. it read prompt positions inside the batched step:
nothing is streamed or kept for it, and it is not ended."""


class HookSink(Protocol):
    """Where ``emit`` sends a running batch's hook events (the worker's batch context)."""

    def hook(self, name: str, payload: Any) -> None: ...


class _Nowhere:
    def hook(self, name: str, payload: Any) -> None:
        pass


_CURRENT: contextvars.ContextVar[HookSink] = contextvars.ContextVar("queueserve_batch")


class running:  # (lower case: a context manager used as a function, ``with running(sink)``)
    """Route ``emit`` calls of this thread's batch function to ``sink`` while the block runs
    (``None``: an inline run, whose hook events have no callers to reach). A class, not a
    ``contextlib.contextmanager``: every batch enters one, and a generator costs more."""

    __slots__ = ("_sink", "_token")

    def __init__(self, sink: HookSink | None) -> None:
        self._sink = _Nowhere() if sink is None else sink

    def __enter__(self) -> None:
        self._token = _CURRENT.set(self._sink)

    def __exit__(self, *_: object) -> None:
        _CURRENT.reset(self._token)


def emit(name: str, payload: Any = None) -> None:
    """Send hook event ``name`` to every caller whose items are in the running batch.

    Only valid inside the batch function of a serving marked ``serving.streaming(hooks=...)``;
    events for hooks not listed there are not sent. Each caller receives ``qs.Hook(name,
    payload, start, size)`` where ``start``/``size`` locate its items in the batch.

    >>> import queueserve as qs
    >>> def embed(texts):
    ...     qs.emit("progress", {"done": 0, "total": len(texts)})
    ...     return [len(t) for t in texts]
    """
    sink = _CURRENT.get(None)
    if sink is None:
        raise RuntimeError(
            "qs.emit() called outside a batch: call it from the thread running the batch "
            "function of a streaming serving"
        )
    sink.hook(name, payload)

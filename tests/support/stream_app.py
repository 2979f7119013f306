"""Servings for the streaming tests (issue 5), importable by worker processes as
``tests.support.stream_app:NAME``.

``Hooks`` and ``Steps`` run in a worker inside the test process: they record every batch they
run and wait at gates the test opens, so a test decides when a batch (or a generator step) may
go on. ``Ordered`` runs in real worker processes and records into Redis, under
``$QS_TEST_PREFIX:rec:*`` on ``$QS_TEST_URL`` (read when a batch runs, never at import).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis

import queueserve as qs

# How long a held batch or step waits for its gate before it gives up (a test that forgot).
GATE_LIMIT_S = 30.0


class _Recorder:
    """Thread-safe record of the batches a serving ran, in the order they started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: list[list[Any]] = []

    def add(self, batch: qs.Batch) -> None:
        with self._lock:
            self._batches.append(list(batch))

    @property
    def batches(self) -> list[list[Any]]:
        with self._lock:
            return [list(b) for b in self._batches]


class Hooks(qs.Serving):
    """A hook serving: each batch emits ``start`` (payload: the batch's items), then waits at
    ``gate``, then emits ``secret`` and ``done`` (payload: the batch size); results are
    ``"r:<item>"``. Only the hooks in ``hooks`` are listed (``hooks=None``: not streaming).
    """

    def __init__(
        self,
        *,
        hooks: Sequence[str] | None = ("start", "done"),
        gated: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if hooks is not None:
            self.streaming(hooks=hooks)
        self.record = _Recorder()
        self.gate = threading.Event()  # start_worker's teardown sets it
        if not gated:
            self.gate.set()

    def handle_batch(self, batch: qs.Batch) -> list[str]:
        self.record.add(batch)
        qs.emit("start", list(batch))
        if not self.gate.wait(GATE_LIMIT_S):
            raise RuntimeError(f"gate of serving {self.name!r} stayed shut for {GATE_LIMIT_S}s")
        qs.emit("secret", "never listed")
        qs.emit("done", len(batch))
        return [f"r:{x}" for x in batch]


class StepGates:
    """One gate per generator step. ``set()`` opens every gate, present and future (what the
    ``start_worker`` fixture calls when it stops the worker)."""

    def __init__(self, opened: bool) -> None:
        self._lock = threading.Lock()
        self._gates: dict[int, threading.Event] = {}
        self._all_open = opened

    def _gate(self, step: int) -> threading.Event:
        with self._lock:
            gate = self._gates.get(step)
            if gate is None:
                gate = self._gates[step] = threading.Event()
                if self._all_open:
                    gate.set()
            return gate

    def open(self, step: int) -> None:
        self._gate(step).set()

    def set(self) -> None:
        with self._lock:
            self._all_open = True
            for gate in self._gates.values():
                gate.set()

    def wait(self, step: int) -> None:
        if not self._gate(step).wait(GATE_LIMIT_S):
            raise RuntimeError(f"gate of step {step} stayed shut for {GATE_LIMIT_S}s")


def parse_item(item: str) -> tuple[str, int]:
    """``"<name>:<n>"`` -> (name, n)."""
    name, _, steps = item.partition(":")
    return name, int(steps)


def step_value(item: str, step: int) -> str:
    """What ``Steps`` yields for ``item`` at ``step``."""
    return f"{item}#{step}"


class Steps(qs.Serving):
    """A generator batch function. Item ``"<name>:<n>"`` yields ``"<name>:<n>#<k>"`` for steps
    ``k < n``, then ``qs.END``; an item named ``boom`` raises ValueError at step ``n`` instead.

    Before step ``k`` it waits at gate ``k`` (all open unless ``gated``), then emits hook
    ``step`` (payload ``k``), which reaches callers when ``hooks`` lists it.
    """

    def __init__(
        self, *, hooks: Sequence[str] | None = None, gated: bool = False, **options: Any
    ) -> None:
        super().__init__(**options)
        if hooks is not None:
            self.streaming(hooks=hooks)
        self.record = _Recorder()
        self.gate = StepGates(opened=not gated)

    def handle_batch(self, batch: qs.Batch) -> Iterator[list[Any]]:
        self.record.add(batch)
        return self._steps([parse_item(x) for x in batch])

    def _steps(self, items: list[tuple[str, int]]) -> Iterator[list[Any]]:
        last = max(n + (name == "boom") for name, n in items)
        for k in range(last):
            self.gate.wait(k)
            qs.emit("step", k)
            step: list[Any] = []
            for name, n in items:
                if name == "boom" and k == n:
                    raise ValueError(f"boom at step {k}")
                step.append(step_value(f"{name}:{n}", k) if k < n else qs.END)
            yield step


# --- served by real worker processes ------------------------------------------------------------
WAIT_S = 30.0


def _recorder() -> tuple[redis.Redis, str]:
    return redis.Redis.from_url(os.environ["QS_TEST_URL"]), os.environ["QS_TEST_PREFIX"]


class Ordered(qs.Serving):
    """Emits ``begin`` (payload: the batch's items). The batch holding item 0 waits until the
    key ``rec:go`` exists; every other batch appends ``<partition>:<items>`` to ``rec:done``.
    Results are ``item * 10``."""

    name = "ordered"
    batch_size = 4
    batch_timeout = 0.0

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.streaming(hooks=["begin"])

    def handle_batch(self, batch: qs.Batch) -> list[int]:
        r, prefix = _recorder()
        try:
            qs.emit("begin", list(batch))
            if 0 in batch:
                deadline = time.monotonic() + WAIT_S
                while not r.exists(f"{prefix}:rec:go"):  # polls a condition, bounded
                    if time.monotonic() > deadline:
                        raise TimeoutError("rec:go was never set")
                    time.sleep(0.005)
            else:
                r.rpush(f"{prefix}:rec:done", f"{batch.partition.index}:{list(batch)}")
        finally:
            r.close()
        return [x * 10 for x in batch]

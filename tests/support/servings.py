"""Servings for the integration tests, importable by worker subprocesses as
``tests.support.servings:NAME``.

``Recording`` is the workhorse: a serving that remembers every batch it ran (batch key and items,
in order) and that a test can hold shut with its ``gate``, so the test decides when the executor
is busy. Module-level servings (``square``, ``echo``) exist for ``queueserve worker`` runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import queueserve as qs

# How long a held batch waits for its gate before it gives up (a test that forgot to release).
GATE_LIMIT_S = 30.0


def echo_items(items: list[Any]) -> list[Any]:
    return list(items)


def square_items(items: list[int]) -> list[int]:
    return [x * x for x in items]


def tag_items(items: list[Any]) -> list[str]:
    """A result that differs from its input, so a swapped or echoed answer is noticed."""
    return [f"r:{x}" for x in items]


def upper_items(items: list[str]) -> list[str]:
    return [s.upper() for s in items]


def fail_on_negative(items: list[int]) -> list[int]:
    """Raises for the whole batch when any item is negative (a poison item)."""
    for x in items:
        if x < 0:
            raise ValueError(f"negative item {x} is not allowed")
    return [x * 10 for x in items]


def drop_last(items: list[Any]) -> list[Any]:
    """Breaks the contract: one result short."""
    return list(items)[:-1]


square = qs.Serving(square_items, name="square", batch_size=10, batch_timeout=0.01)
echo = qs.Serving(echo_items, name="echo", batch_size=32, batch_timeout=0.005)


class Recording(qs.Serving):
    """Records each batch as ``(batch_key, items)`` and runs ``fn`` on it (echo by default).

    ``gated=True`` starts with the gate shut: every batch then waits in the executor until the
    test calls ``release()``. Poison isolation may run a batch again in halves; each run is
    recorded.
    """

    def __init__(
        self,
        fn: Callable[[list[Any]], Any] | None = None,
        *,
        gated: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(fn if fn is not None else echo_items, **options)
        self._lock = threading.Lock()
        self._batches: list[tuple[str, list[Any]]] = []
        self.gate = threading.Event()
        if not gated:
            self.gate.set()

    def handle_batch(self, batch: qs.Batch) -> Any:
        with self._lock:
            self._batches.append((batch.key, list(batch)))
        if not self.gate.wait(GATE_LIMIT_S):
            raise RuntimeError(f"gate of serving {self.name!r} stayed shut for {GATE_LIMIT_S}s")
        return super().handle_batch(batch)

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    @property
    def batches(self) -> list[tuple[str, list[Any]]]:
        """``(batch_key, items)`` of every batch run so far, in the order they started."""
        with self._lock:
            return [(key, list(items)) for key, items in self._batches]

    @property
    def item_batches(self) -> list[list[Any]]:
        return [items for _, items in self.batches]

    @property
    def items_run(self) -> list[Any]:
        return [x for _, items in self.batches for x in items]


def client_process_job(
    redis_url: str, prefix: str, serving_name: str, caller: int, n: int
) -> tuple[int, list[Any], list[Any]]:
    """Run in a spawned client process: dispatch this caller's own values, one by one and then
    as one request, and return (caller, values, results) for the parent to check."""
    values = [f"p{caller}-{i}" for i in range(n)]
    with qs.Client(redis_url, prefix=prefix) as client:
        one_by_one = [client.dispatch(serving_name, v, timeout=30) for v in values]
        as_request = client.dispatch_many(serving_name, values, timeout=30)
    return caller, values, one_by_one + as_request

"""A batch's results, checked against its size and cut into per-caller slices.

A batch function returns one result per item: a list (or tuple), or an array/tensor — or a dict
of them — whose first axis is the batch. Batched results travel as one array slice per caller and
are split into rows only on the caller's side, which keeps the worker's per-item work at zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from queueserve.errors import QueueServeError
from queueserve.wire.kinds import BATCHED, RESULTS, STEPS


class BatchResultError(QueueServeError):
    """The batch function's return value does not give one result per item."""


def _first_axis(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(value, "__getitem__") or len(shape) == 0:
        return None
    return int(shape[0])


class BatchResults:
    """Results of one batch of ``size`` items, sliceable into wire bodies."""

    __slots__ = ("_kind", "_value")

    _value: Any

    def __init__(self, value: Any, size: int, serving: str, kind: int = RESULTS) -> None:
        if isinstance(value, list | tuple):
            if len(value) != size:
                raise BatchResultError(
                    f"serving {serving!r} returned {len(value)} results for a batch of {size} "
                    "items; return exactly one result per item, in item order"
                )
            self._kind, self._value = kind, value
            return
        if isinstance(value, dict) and value:
            rows = {k: _first_axis(v) for k, v in value.items()}
            if any(n != size for n in rows.values()):
                raise BatchResultError(
                    f"serving {serving!r} returned a dict whose first axes are {rows} for a "
                    f"batch of {size} items; every value must be an array or tensor with "
                    f"{size} rows"
                )
            self._kind, self._value = BATCHED, value
            return
        rows_n = _first_axis(value)
        if rows_n is None:
            raise BatchResultError(
                f"serving {serving!r} returned {type(value).__qualname__}; return a list with one "
                "result per item, or an array/tensor (or dict of them) whose first axis is the "
                "batch"
            )
        if rows_n != size:
            raise BatchResultError(
                f"serving {serving!r} returned an array with {rows_n} rows for a batch of {size} "
                "items; its first axis must be the batch"
            )
        self._kind, self._value = BATCHED, value

    def body(self, start: int, count: int) -> tuple[int, Any]:
        """The wire (kind, body) of results ``start:start+count``."""
        value = self._value
        if self._kind == BATCHED and isinstance(value, dict):
            return BATCHED, {k: v[start : start + count] for k, v in value.items()}
        return self._kind, value[start : start + count]

    def as_list(self) -> list[Any]:
        kind, body = self.body(0, len(self))
        return unbatch(kind, body)

    def __len__(self) -> int:
        value = self._value
        if self._kind != BATCHED:
            return len(value)
        if isinstance(value, dict):
            return int(_first_axis(next(iter(value.values()))) or 0)
        return int(_first_axis(value) or 0)


def unbatch(kind: int, body: Any) -> list[Any]:
    """Per-item results from a wire body (the caller's side of ``BatchResults.body``)."""
    if kind in (RESULTS, STEPS):
        return body if isinstance(body, list) else list(body)
    if isinstance(body, dict):
        columns: Sequence[tuple[str, Any]] = list(body.items())
        n = _first_axis(columns[0][1]) or 0
        return [{k: v[i] for k, v in columns} for i in range(n)]
    return list(body)

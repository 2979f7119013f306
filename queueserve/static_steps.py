"""A step serving's steps run statically, as generator batching would: its prompts prefilled
together, then decoded until every sequence ended, none joining or leaving early. What a step
serving's ``inline``/``inline_many`` give, and the static baseline its continuous batching
is measured against (bench/generate.py); workers run the continuous executor instead
(worker/stepping/)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

from queueserve.hooks import END, NO_OUTPUT


class Steps(Protocol):
    """What a step serving defines (queueserve/steps.py's StepServing)."""

    def prefill(self, items: list[Any]) -> list[Any]: ...

    def decode(self, states: list[Any]) -> list[Any]: ...

    def result(self, state: Any, outputs: list[Any]) -> Any: ...


def static_steps(serving: Steps, items: list[Any]) -> Generator[list[Any], None, list[Any]]:
    """Prefill ``items`` together, then decode until every one ended, yielding each step
    (``qs.END`` in the place of ended items, ``qs.NO_OUTPUT`` where decode gave none) and
    finally returning the states."""
    states = serving.prefill(list(items))
    if len(states) != len(items):
        raise ValueError(
            f"{type(serving).__name__}.prefill returned {len(states)} states for {len(items)} "
            "items; return one state per item"
        )
    live = list(range(len(items)))
    while live:
        step = serving.decode([states[i] for i in live])
        if len(step) != len(live):
            raise ValueError(
                f"{type(serving).__name__}.decode returned {len(step)} outputs for "
                f"{len(live)} states; return one output (or qs.END) per state"
            )
        row: list[Any] = [END] * len(items)
        for i, out in zip(live, step, strict=True):
            row[i] = out
        live = [i for i in live if row[i] is not END]
        yield row
    return states


def static_results(serving: Steps, items: list[Any]) -> list[Any]:
    """``items`` run statically to their end: each one's ``result`` of its outputs."""
    outputs: list[list[Any]] = [[] for _ in items]
    steps = static_steps(serving, items)
    while True:
        try:
            row = next(steps)
        except StopIteration as done:
            states: list[Any] = done.value
            break
        for i, out in enumerate(row):
            if out is not END and out is not NO_OUTPUT:
                outputs[i].append(out)
    return [serving.result(s, o) for s, o in zip(states, outputs, strict=True)]

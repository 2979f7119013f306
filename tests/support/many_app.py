"""A worker of many servings (issue 36): ``queueserve worker tests.support.many_app:servings``
runs SERVINGS of them in one partition, more than redis-py's default pool of 100 connections
held when each serving blocked on a connection of its own and listened on one more.

Each answers an item with its own name, so a test can tell which serving answered."""

from __future__ import annotations

from typing import Any

import queueserve as qs

SERVINGS = 130


def name_of(index: int) -> str:
    return f"many{index:03d}"


def _answer_as(name: str) -> Any:
    def answer(items: list[Any]) -> list[str]:
        return [f"{name}:{item}" for item in items]

    return answer


def many_servings(count: int) -> list[qs.Serving]:
    return [
        qs.Serving(_answer_as(name_of(i)), name=name_of(i), batch_size=4, batch_timeout=0.0)
        for i in range(count)
    ]


servings = many_servings(SERVINGS)

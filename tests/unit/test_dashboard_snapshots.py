"""The dashboard's overview is computed once for concurrent callers and kept about a second
(queueserve/dashboard/board.py, ``Snapshots``; docs/operations.md, "Dashboard"): N pollers
cost Redis one overview, not N. tests/integration/test_listing_cost.py counts it in Redis's
commands through a real dashboard."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from queueserve.dashboard.board import Snapshots


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_callers_that_arrive_while_it_runs_wait_for_the_one_computation() -> None:
    release = threading.Event()
    calls: list[tuple[int, str]] = []

    def compute(offset: int, name_filter: str) -> dict[str, Any]:
        calls.append((offset, name_filter))
        release.wait(10)  # held until every caller is waiting on it
        return {"n": len(calls)}

    snapshots = Snapshots(compute, ttl=1.0, clock=Clock())

    async def scenario() -> list[dict[str, Any]]:
        callers = [asyncio.create_task(snapshots.get(0, "")) for _ in range(20)]
        while not calls:  # the first caller's computation started, in its thread
            await asyncio.sleep(0.001)
        for _ in range(50):  # every other caller runs up to its wait on that computation
            await asyncio.sleep(0)
        release.set()
        return await asyncio.gather(*callers)

    answers = asyncio.run(scenario())
    assert calls == [(0, "")] and snapshots.computed == 1
    assert all(a is answers[0] for a in answers)


def test_a_snapshot_is_kept_for_its_page_and_its_ttl_only() -> None:
    clock = Clock()
    calls: list[tuple[int, str]] = []

    def compute(offset: int, name_filter: str) -> dict[str, Any]:
        calls.append((offset, name_filter))
        return {"call": len(calls)}

    snapshots = Snapshots(compute, ttl=1.0, clock=clock)

    async def get(offset: int, name_filter: str) -> dict[str, Any]:
        return await snapshots.get(offset, name_filter)

    assert asyncio.run(get(0, "")) == {"call": 1}
    clock.now += 0.9
    assert asyncio.run(get(0, "")) == {"call": 1}  # within the second: kept
    assert asyncio.run(get(100, "")) == {"call": 2}  # another page: its own
    assert asyncio.run(get(0, "emb")) == {"call": 3}
    clock.now += 0.2
    assert asyncio.run(get(0, "")) == {"call": 4}  # past it: computed again

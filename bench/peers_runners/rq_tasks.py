"""The function rq's worker runs (rq imports it by name: bench.peers_runners.rq_tasks.identity)."""

from __future__ import annotations


def identity(x: int) -> int:
    return x

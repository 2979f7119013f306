"""Servings for the dashboard's health tests (``tests.support.health_app:NAME``): one that
runs what it is sent, one that no one sends to, and one whose batch function always raises;
``together`` serves the three on one partition, so the idle one shares it with the busy."""

from __future__ import annotations

import queueserve as qs


def _square(xs: list[int]) -> list[int]:
    return [x * x for x in xs]


def _broken(xs: list[int]) -> list[int]:
    raise RuntimeError("this serving fails every call")


busy = qs.Serving(_square, name="busy", batch_size=16, batch_timeout=0.002)
idle = qs.Serving(_square, name="idle", batch_size=16)
broken = qs.Serving(_broken, name="broken", batch_size=16)

together = [busy, idle, broken]

"""Servings for the dashboard's health tests and the alerts' (``tests.support.health_app:NAME``):
one that runs what it is sent, one that no one sends to, one whose batch function always
raises, and one whose batches hang; ``together`` serves the first three on one partition, so
the idle one shares it with the busy."""

from __future__ import annotations

import time

import queueserve as qs


def _square(xs: list[int]) -> list[int]:
    if -1 in xs:  # a failing item: with on_error="isolate", its batch's others still answer
        raise ValueError("-1 has no square here")
    return [x * x for x in xs]


def _broken(xs: list[int]) -> list[int]:
    raise RuntimeError("this serving fails every call")


busy = qs.Serving(_square, name="busy", batch_size=16, batch_timeout=0.002)
idle = qs.Serving(_square, name="idle", batch_size=16)
broken = qs.Serving(_broken, name="broken", batch_size=16)

together = [busy, idle, broken]


def _stuck(xs: list[int]) -> list[int]:
    time.sleep(STUCK_S)  # a batch that does not end while the test looks (it kills the worker)
    return xs


STUCK_S = 600
stuck = qs.Serving(_stuck, name="stuck", batch_size=16)

# For the alerts' test: the three, and one whose batches hang
alerting = [busy, idle, broken, stuck]

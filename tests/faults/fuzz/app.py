"""Servings of the fuzzer's worker process (``queueserve worker tests.faults.fuzz.app:NAME``).

Every plain item a batch runs is counted in ``$QS_TEST_PREFIX:fuzz:exec`` (a hash: item ->
runs) on ``$QS_TEST_URL``, so the test can tell that each valid request ran exactly once.
With ``$QS_FUZZ_TRACING`` set (the fuzzer's worker process), the process sets a TracerProvider
that keeps nothing: its partitions then read the trace context of every request they run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import redis

import queueserve as qs
from tests.support.step_app import Count

if os.environ.get("QS_FUZZ_TRACING"):  # the worker's process only: the test's is left alone
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    trace.set_tracer_provider(TracerProvider())

_REDIS: redis.Redis | None = None


def _count_runs(items: list[Any]) -> None:
    global _REDIS
    if _REDIS is None:
        _REDIS = redis.Redis.from_url(os.environ["QS_TEST_URL"], socket_timeout=10.0)
    pipe = _REDIS.pipeline(transaction=False)
    for item in items:
        pipe.hincrby(f"{os.environ['QS_TEST_PREFIX']}:fuzz:exec", str(item), 1)
    pipe.execute()


def answer(item: Any) -> str:
    """What the plain servings answer for ``item``."""
    return f"r:{item}"


class Plain(qs.Serving):
    """Answers ``r:<item>`` and counts each run."""

    name = "fz"
    batch_size = 16
    batch_timeout = 0.002

    def load_key(self, key: str) -> str:
        """A state per batch key (docs/usage.md, "Many models behind one serving"): so its
        worker says which keys it holds, and reads what ghost records say they hold."""
        return key

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        _count_runs(list(batch))
        assert batch.state == batch.key
        return [answer(x) for x in batch]


class Victim(Plain):
    """The serving whose shared keys (queued, wake, seen...) the fuzzer replaces with keys of
    the wrong type: its callers may fail meanwhile, the worker's other servings must not."""

    name = "fzx"


class Steps(qs.Serving):
    """A generator serving: item x yields ``x:0``, ``x:1``, ``x:2``."""

    name = "fzs"
    batch_size = 8
    batch_timeout = 0.002

    def handle_batch(self, batch: qs.Batch) -> Iterator[list[Any]]:
        _count_runs(list(batch))
        for step in range(3):
            yield [f"{x}:{step}" for x in batch]


class Generate(Count):
    """A step serving (continuous batching), deterministic: see tests/support/step_app.py."""

    name = "fzt"


plain = Plain()
victim = Victim()
steps = Steps()
generate = Generate()

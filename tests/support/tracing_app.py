"""Servings for tests/integration/test_tracing.py, loaded by worker processes as
``tests.support.tracing_app:NAME``. The module sets the process's TracerProvider: every span
ends up as a JSON line in the file named by QS_TEST_SPANS (tests/support/span_file.py)."""

from __future__ import annotations

import os
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import queueserve as qs
from tests.support.span_file import JsonLinesExporter

_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ["QS_TEST_SPANS"])))
trace.set_tracer_provider(_provider)
_tracer = trace.get_tracer("tests.tracing_app")


@qs.serving(name="traced", batch_size=3, batch_timeout=60.0)
def traced(xs: list[int]) -> list[int]:
    """Runs once three items wait (one batch of three requests of one item each), in a
    span of its own: a child of the batch's span."""
    with _tracer.start_as_current_span("inside"):
        return [x * 10 for x in xs]


class Countdown(qs.StepServing):
    name = "countdown"
    max_slots = 4

    def prefill(self, items: list[int]) -> list[dict[str, int]]:
        return [{"left": n} for n in items]

    def decode(self, states: list[dict[str, int]]) -> list[Any]:
        out: list[Any] = []
        for s in states:
            s["left"] -= 1
            out.append(qs.END if s["left"] < 0 else s["left"])
        return out


countdown = Countdown()

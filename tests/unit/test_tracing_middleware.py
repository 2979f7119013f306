"""The worker's tracing middleware (worker/tracing.py) with and without a TracerProvider set:
without one opentelemetry's spans are no-ops, so a batch builds nothing for them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import queueserve as qs
from queueserve import tracing
from queueserve.worker.tracing import TracingMiddleware

SERVING = qs.Serving(lambda xs: xs, name="traced")
PARTITION: Any = SimpleNamespace(index=0)
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def one_batch(middleware: TracingMiddleware, fields: list[dict[str, str]]) -> None:
    slices: Any = [SimpleNamespace(request=SimpleNamespace(fields=f)) for f in fields]
    middleware.batch_opened(SERVING, "default", PARTITION, slices)
    middleware.batch_started(SERVING, "default", PARTITION, len(slices), 0.0)
    middleware.batch_finished(SERVING, "default", PARTITION, len(slices), 0.001)


def test_without_a_provider_a_batch_parses_no_context_and_starts_no_span(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)

    def parsed(fields: Any) -> None:
        pytest.fail("a request's trace context was parsed with no TracerProvider set")

    monkeypatch.setattr(tracing, "remote_context", parsed)
    middleware = TracingMiddleware()
    one_batch(middleware, [{"trace": PARENT}])
    assert getattr(middleware._local, "span", None) is None


def test_with_a_provider_a_batch_span_links_each_producer_span_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    middleware = TracingMiddleware()
    middleware.tracer = provider.get_tracer("tests")
    other = PARENT.replace("b7ad6b7169203331", "00f067aa0ba902b7")
    one_batch(middleware, [{"trace": PARENT}, {"trace": PARENT}, {"trace": other}, {}])
    (span,) = exporter.get_finished_spans()
    assert span.name == "traced batch" and span.attributes["queueserve.batch.requests"] == 4
    assert [f"{link.context.span_id:016x}" for link in span.links] == [
        "b7ad6b7169203331",
        "00f067aa0ba902b7",
    ]

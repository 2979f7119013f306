"""Tracing middleware (the ``otel`` extra): one span per batch, and per step of a step
serving, linked to the span each of its requests was sent from.

A batch's requests come from many traces, so its span is a root of its own with a link to
every request's context (queueserve/tracing.py reads them from the header) rather than a
child of one of them. The span is current while the batch function runs: spans the function
starts are its children. Spans go to whatever TracerProvider the process set (the served
module, or opentelemetry's own configuration); while none is set, opentelemetry's spans are
no-ops, so the hooks build nothing (no links, attributes or context) and cost one check each.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context, trace

from queueserve import tracing
from queueserve.serving import Partition, Serving
from queueserve.steps import StepServing
from queueserve.wire.tenants import TENANT_NAME
from queueserve.worker.middleware import Middleware

if TYPE_CHECKING:
    from queueserve.worker.pipeline.batching import Slice


MAX_LINKS = 128  # links per span: OpenTelemetry's default limit (OTEL_SPAN_LINK_COUNT_LIMIT)


def provider_set() -> bool:
    """Whether the process set a TracerProvider (until then ``get_tracer_provider`` gives
    opentelemetry's proxy, and every span is a no-op)."""
    return type(trace.get_tracer_provider()) is not trace.ProxyTracerProvider


class TracingMiddleware(Middleware):
    """Spans of batches. Hooks of one batch run on one thread (its device thread): the span
    in progress is kept per thread."""

    def __init__(self) -> None:
        self.tracer = trace.get_tracer("queueserve")
        self._local = threading.local()

    def batch_opened(
        self, serving: Serving, key: str, partition: Partition, slices: Sequence[Slice]
    ) -> None:
        self._local.on = on = provider_set()
        if not on:
            return
        links: list[trace.Link] = []
        requests: set[int] = set()
        contexts: set[str] = set()
        tenants: set[str] = set()
        for piece in slices:
            request = piece.request
            if id(request) in requests:  # a request's several slices (or sequences) link once
                continue
            requests.add(id(request))
            # Requests sent from one span share its context: one link for them all, checked
            # once; past MAX_LINKS the SDK would drop them anyway (its default link limit).
            fields = request.fields
            tenant = fields.get("tenant") if fields else None
            if type(tenant) is str and len(tenants) < MAX_LINKS and TENANT_NAME.fullmatch(tenant):
                tenants.add(tenant)
            text = fields.get(tracing.TRACE_FIELD) if fields else None
            if type(text) is not str or text in contexts or len(links) >= MAX_LINKS:
                continue
            contexts.add(text)
            remote = tracing.remote_context(fields)
            if remote is not None:
                links.append(trace.Link(remote))
        self._local.links = links
        self._local.requests = len(requests)
        self._local.tenants = sorted(tenants)

    def batch_started(
        self, serving: Serving, key: str, partition: Partition, size: int, waited: float
    ) -> None:
        local = self._local
        if not getattr(local, "on", False):
            return
        links, local.links = getattr(local, "links", []), []
        attributes: dict[str, Any] = {
            "queueserve.serving": serving.name,
            "queueserve.batch.size": size,
            "queueserve.batch.requests": getattr(local, "requests", 0),
            "queueserve.batch.key": key,
            "queueserve.partition": partition.index,
        }
        tenants, local.tenants = getattr(local, "tenants", []), []
        if tenants:  # the tenants whose requests the batch runs (their headers name them)
            attributes["queueserve.batch.tenants"] = tenants
        kind = "step" if isinstance(serving, StepServing) else "batch"
        span = self.tracer.start_span(
            f"{serving.name} {kind}",
            kind=trace.SpanKind.CONSUMER,
            links=links,
            attributes=attributes,
        )
        local.span = span
        local.token = context.attach(trace.set_span_in_context(span))

    def batch_finished(
        self, serving: Serving, key: str, partition: Partition, size: int, seconds: float
    ) -> None:
        local = self._local
        span = getattr(local, "span", None)
        if span is None:
            return
        local.span = None
        context.detach(local.token)
        span.end()

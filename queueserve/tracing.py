"""Trace context across the queue (the ``otel`` extra): what a client puts in a request's
header, and how a worker reads it back.

A client sends its current span's context (W3C ``traceparent`` text) in the header's
optional field ``trace``, only when a span is current and only to servings whose workers
declared that they read optional fields (``HEADER_FIELDS`` in the meta hash; docs/architecture.md,
"Wire versions"). The worker links each batch's span to the contexts of its requests
(worker/tracing.py). Without opentelemetry installed nothing here imports it, and clients
check one flag per request.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, NamedTuple

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanContext

TRACE_FIELD: Final = "trace"
HEADER_FIELDS: Final = "header_fields"  # meta hash field: the optional fields workers read
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def _installed() -> bool:
    """Whether opentelemetry-api is importable, looked up without importing it (its
    namespace package alone is imported: it holds no code)."""
    try:
        return importlib.util.find_spec("opentelemetry.trace") is not None
    except (ImportError, ValueError):  # no opentelemetry, or one blocked in sys.modules
        return False


AVAILABLE: Final = _installed()


def reads_trace(meta: Mapping[str, str]) -> bool:
    """Whether a serving's workers declared that they read trace context (``meta``: its
    meta hash, written by whoever can write to Redis: anything else means no)."""
    declared = meta.get(HEADER_FIELDS)
    return isinstance(declared, str) and TRACE_FIELD in declared.split(",")


def trace_fields() -> dict[str, str] | None:
    """The header's optional fields carrying the current span's context; None when no span
    is current (or opentelemetry is not installed).

    Called per request. opentelemetry's context is an immutable mapping replaced whenever a
    span is made current, so each thread keeps the last one it saw with its ``traceparent``
    text: a caller's requests from one span look the span up once."""
    if not AVAILABLE:
        return None
    current = _otel().get_current()
    last = getattr(_seen, "last", None)
    if last is None or last[0] is not current:
        context = _otel().get_current_span(current).get_span_context()
        last = _seen.last = (current, _traceparent(context) if context.is_valid else None)
    return None if last[1] is None else {TRACE_FIELD: last[1]}


def _traceparent(context: SpanContext) -> str:
    flags = int(context.trace_flags)
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"


_seen = threading.local()  # .last: (the context last seen, its traceparent or None)


class _Otel(NamedTuple):
    get_current: Callable[[], Context]
    get_current_span: Callable[[Context], Span]


@functools.cache
def _otel() -> _Otel:
    """opentelemetry's lookups, imported once, on first use."""
    from opentelemetry.context import get_current
    from opentelemetry.trace import get_current_span

    return _Otel(get_current, get_current_span)


def remote_context(fields: Mapping[str, Any] | None) -> SpanContext | None:
    """The span context a request's optional fields carry; None when they carry none or
    something that is not a ``traceparent`` (the fields are a stranger's)."""
    if not fields:
        return None
    text = fields.get(TRACE_FIELD)
    if type(text) is not str or len(text) != 55:
        return None
    match = _TRACEPARENT.fullmatch(text)
    if match is None:
        return None
    from opentelemetry.trace import SpanContext, TraceFlags

    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(match[3], 16)))

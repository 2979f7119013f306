"""A span exporter that appends each finished span to a file as one JSON line: how a test
reads the spans a worker process made (opentelemetry's in-memory exporter lives in one process).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """What the tests compare of a span: ids as hex, links, parent, attributes."""
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "links": [
            [f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}"] for link in span.links
        ],
        "attributes": dict(span.attributes or {}),
    }


class JsonLinesExporter(SpanExporter):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(span)) + "\n" for span in spans)
        with self._lock, self.path.open("a") as out:
            out.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans written so far (a line being written is left for the next read)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out

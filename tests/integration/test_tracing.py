"""Trace context across the queue (the ``otel`` extra, docs/operations.md "Tracing"): the
producer's span context rides in the request header's optional fields, and the worker's span
of the batch (or step) links to each request's. Spans of a real worker process come back
through a JSON-lines exporter (tests/support/span_file.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import Tracer

import queueserve as qs
from queueserve.wire.keys import Keys
from queueserve.wire.protocol import H_FIELDS
from queueserve.wire.request import parse_header
from tests.support.fault_app import WorkerProc
from tests.support.helpers import REPO, child_env, entry_headers, wait_until
from tests.support.span_file import read_spans


@pytest.fixture
def producer() -> tuple[Tracer, InMemorySpanExporter]:
    """The caller's tracer and what it exported (not the process's global provider: a test
    makes spans current with use_span, which the client reads as any caller's)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("tests.producer"), exporter


@pytest.fixture
def spans_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("QS_TEST_SPANS", str(path))
    return path


@pytest.fixture
def traced_worker(redis_url: str, prefix: str, tmp_path: Path, spans_file: Path) -> Iterator[Any]:
    started: list[WorkerProc] = []

    def start(spec: str) -> WorkerProc:
        args = [f"tests.support.tracing_app:{spec}", "--redis-url", redis_url]
        args += ["--prefix", prefix, "--partitions", "1"]
        worker = WorkerProc(args, redis_url, prefix, tmp_path / f"worker-{len(started)}.log")
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill_group()


def hex_ids(span: Any) -> list[str]:
    context = span.get_span_context()
    return [f"{context.trace_id:032x}", f"{context.span_id:016x}"]


def test_a_batch_span_links_to_the_span_of_every_request_in_it(
    traced_worker: Any,
    producer: tuple[Tracer, InMemorySpanExporter],
    spans_file: Path,
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a worker process of a serving that runs once three requests wait
    tracer, _ = producer
    worker = traced_worker("traced")
    keys = Keys(prefix, "traced")
    wait_until(lambda: redis_client.hget(keys.meta, "header_fields"), "the declaration")

    # When three callers each send one item from a span of their own
    answers: dict[int, int] = {}
    sent: list[list[str]] = []
    with qs.Client(redis_url, prefix=prefix) as client:

        def call(i: int) -> None:
            with tracer.start_as_current_span(f"caller {i}") as span:
                sent.append(hex_ids(span))
                answers[i] = client.dispatch("traced", i, timeout=60)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert answers == {0: 0, 1: 10, 2: 20}, (answers, worker.output())

    # Then one span of the batch links to all three callers' spans, with the batch's figures,
    # and the span the batch function started is its child
    def batch_spans() -> list[dict[str, Any]]:
        return [s for s in read_spans(spans_file) if s["name"] == "traced batch"]

    wait_until(lambda: batch_spans() and len(read_spans(spans_file)) >= 2, "the worker's spans")
    [batch] = batch_spans()
    assert sorted(batch["links"]) == sorted(sent)
    assert batch["attributes"] == {
        "queueserve.serving": "traced",
        "queueserve.batch.size": 3,
        "queueserve.batch.requests": 3,
        "queueserve.batch.key": "default",
        "queueserve.partition": 0,
    }
    [inside] = [s for s in read_spans(spans_file) if s["name"] == "inside"]
    assert inside["parent"] == batch["span_id"] and inside["trace_id"] == batch["trace_id"]


def test_each_step_of_a_step_serving_has_a_span_linked_to_its_sequences(
    traced_worker: Any,
    producer: tuple[Tracer, InMemorySpanExporter],
    spans_file: Path,
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    tracer, _ = producer
    worker = traced_worker("countdown")
    keys = Keys(prefix, "countdown")
    wait_until(lambda: redis_client.hget(keys.meta, "header_fields"), "the declaration")

    with qs.Client(redis_url, prefix=prefix) as client, tracer.start_as_current_span("g") as span:
        assert client.dispatch("countdown", 2, timeout=60) == [1, 0], worker.output()

    def steps() -> list[dict[str, Any]]:
        return [s for s in read_spans(spans_file) if s["name"] == "countdown step"]

    wait_until(lambda: len(steps()) >= 3, "a span per decode step")
    assert all(s["links"] == [hex_ids(span)] for s in steps())
    assert all(s["attributes"]["queueserve.batch.size"] == 1 for s in steps())


def headers_sent(redis_client: redis.Redis, keys: Keys) -> list[list[Any]]:
    stream = keys.stream("default")
    return [
        parse_header(h) for _, fields in redis_client.xrange(stream) for h in entry_headers(fields)
    ]


@pytest.mark.parametrize("declared", [None, "job,tenant", "trace,job,tenant"])
def test_trace_context_goes_only_to_servings_whose_workers_read_it(
    declared: str | None,
    producer: tuple[Tracer, InMemorySpanExporter],
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a serving declared as workers of a version before the optional fields declare it
    # (no header_fields: such workers refuse a header carrying the map), or as this one does
    tracer, _ = producer
    keys = Keys(prefix, "gated")
    meta = {"codec": "msgpack", "batch_size": "8"}
    if declared is not None:
        meta["header_fields"] = declared
    redis_client.hset(keys.meta, mapping=meta)

    # When a caller with a current span sends to it (by name and with the Serving object)
    with qs.Client(redis_url, prefix=prefix) as client, tracer.start_as_current_span("c") as span:
        client.submit("gated", [1])
        client.submit(qs.Serving(lambda xs: xs, name="gated"), [2])

    # Then the header carries the span's context only where the workers declared they read it
    headers = headers_sent(redis_client, keys)
    assert len(headers) == 2
    if declared == "trace,job,tenant":
        trace_id, span_id = hex_ids(span)
        flags = int(span.get_span_context().trace_flags)
        expected = {"trace": f"00-{trace_id}-{span_id}-{flags:02x}"}
        assert [h[H_FIELDS] for h in headers] == [expected, expected]
    else:
        assert all(len(h) == 6 for h in headers), headers  # byte for byte the old header


def test_no_span_current_sends_no_fields(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    keys = Keys(prefix, "gated")
    redis_client.hset(keys.meta, mapping={"codec": "msgpack", "header_fields": "trace"})
    with qs.Client(redis_url, prefix=prefix) as client:
        client.submit("gated", [1])
    assert [len(h) for h in headers_sent(redis_client, keys)] == [6]


def test_without_opentelemetry_nothing_imports_it_and_requests_are_answered(
    redis_url: str, prefix: str
) -> None:
    # A process where opentelemetry cannot be imported (as if the extra were not installed)
    # serves and calls as always, and tries to import nothing of it but the one look-up that
    # tells it is missing. (Blocking it with sys.modules["opentelemetry"] = None would hide an
    # attempt: every one fails quietly, and nothing of it can be in sys.modules.)
    script = f"""
import sys

class Missing:
    tried = []  # (module, the queueserve function that asked) of each attempt of queueserve's

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] != "opentelemetry":
            return None
        frame = sys._getframe(1)
        while frame is not None and "importlib" in frame.f_code.co_filename:
            frame = frame.f_back
        where = frame.f_code.co_filename if frame is not None else "?"
        if "/queueserve/" in where:  # redis-py looks it up too (its own observability)
            cls.tried.append((name, where.rpartition("/queueserve/")[2], frame.f_code.co_name))
        raise ModuleNotFoundError(name)

sys.meta_path.insert(0, Missing)
import queueserve as qs
from queueserve import tracing
assert not tracing.AVAILABLE
LOOKUP = [("opentelemetry", "tracing.py", "_installed")]  # the one that tells it is missing
assert Missing.tried == LOOKUP, Missing.tried
square = qs.Serving(lambda xs: [x * x for x in xs], name="plain", batch_size=4)
worker = qs.Worker([square], redis_url={redis_url!r}, prefix={prefix!r}, handle_signals=False)
worker.start()
with qs.Client({redis_url!r}, prefix={prefix!r}) as client:
    assert client.dispatch("plain", 3, timeout=60) == 9
worker.stop(timeout=10)
assert Missing.tried == LOOKUP, Missing.tried
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
